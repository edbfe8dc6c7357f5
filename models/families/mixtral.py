"""Mixtral: Mistral's attention, and in every layer an MoE of eight-style experts (w1, w3, w2)
routed by softmax top-k, renormalised."""

from __future__ import annotations

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import MoEConfig
from mindspeed_core.models.families.base import transformers_aux_loss
from mindspeed_core.models.families.mistral import Mistral


class Mixtral(Mistral):
    name = "mixtral"
    architecture = "MixtralForCausalLM"
    aliases = ("mixtral",)
    specs = ("mixtral_spec",)
    builds, dense, experts = "moe", "mistral", True
    peft_export = False
    presets = {
        "tiny-mixtral": dict(family="mixtral", hidden_size=128, num_layers=4, num_attention_heads=4,
                             num_query_groups=2, ffn_hidden_size=256, moe=dict(num_experts=8, topk=2)),
    }

    def moe_from_hf(self, hf: dict) -> tuple:
        topk, experts = moe_sizes(hf)
        return MoEConfig(num_experts=experts, topk=topk, ffn_hidden_size=hf["intermediate_size"],
                         norm_topk_prob=True, aux_loss_coeff=transformers_aux_loss(hf, topk)), None

    def hf_config(self, cfg):
        out = super().hf_config(cfg)
        moe = router_to_hf(cfg, out)
        if cfg.moe_layers is not None or not moe.norm_topk_prob or moe.shared_expert_size:
            raise CheckpointError("mixtral has an MoE MLP in every layer, renormalised top-k weights and no shared "
                                  "expert")
        out.update(num_local_experts=moe.num_experts, intermediate_size=moe.ffn_hidden_size or cfg.ffn_hidden_size)
        return out

    def moe_names(self, cfg, i):
        return f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")


def moe_sizes(hf: dict) -> tuple[int, int]:
    """(top k, experts) of transformers' softmax-routed MoE blocks (Mixtral's, Qwen's)."""
    if hf.get("router_jitter_noise"):
        raise CheckpointError(f"config.json: router_jitter_noise {hf['router_jitter_noise']!r} is not supported "
                              f"(set it to 0)")
    return moe_sizes_of(hf)


def moe_sizes_of(hf: dict) -> tuple[int, int]:
    """(top k, experts) of an MoE block's config.json keys."""
    # Mixtral's num_local_experts, Qwen's num_experts (transformers 5 writes either for both)
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if experts is None:
        raise CheckpointError("config.json has no 'num_experts' (or 'num_local_experts')")
    return hf["num_experts_per_tok"], experts


def router_to_hf(cfg, out: dict):
    """The router keys of transformers' softmax-routed MoE blocks into ``out``; returns the MoE
    settings, refused where that router cannot hold them."""
    moe = cfg.moe
    if moe is None:
        raise CheckpointError(f"a {cfg.family} model needs its mixture-of-experts settings")
    # what transformers' MoE blocks compute: softmax scores, no groups, bias, scaling or capacity
    if (moe.score_function != "softmax" or moe.num_groups or moe.scaling_factor != 1.0 or moe.enable_expert_bias
            or moe.capacity_factor is not None):
        raise CheckpointError(f"{cfg.family} routes by softmax top-k only: this model's router (score function "
                              f"{moe.score_function}, groups {moe.num_groups}, scaling {moe.scaling_factor}, expert "
                              f"bias {moe.enable_expert_bias}, capacity {moe.capacity_factor}) has no equivalent there")
    out.update(num_experts_per_tok=moe.topk, output_router_logits=moe.aux_loss_coeff > 0,
               router_aux_loss_coef=moe.aux_loss_coeff / moe.topk)
    return moe


FAMILY = Mixtral()
