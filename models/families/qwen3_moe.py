"""Qwen3-MoE: Qwen3's attention, and MoE layers (decoder_sparse_step, mlp_only_layers) of
softmax-routed experts, renormalised or not (norm_topk_prob), without a shared expert."""

from __future__ import annotations

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import MoEConfig
from mindspeed_core.models.families.base import transformers_aux_loss
from mindspeed_core.models.families.mixtral import moe_sizes, router_to_hf
from mindspeed_core.models.families.qwen3 import Qwen3


class QwenMoE:
    """Qwen's MoE layers (Qwen2-MoE's with a gated shared expert): a mixin over the dense family."""

    builds, experts = "moe", True
    peft_export = False
    shared_expert = False

    def moe_from_hf(self, hf: dict) -> tuple:
        topk, experts = moe_sizes(hf)
        shared = hf.get("shared_expert_intermediate_size") if self.shared_expert else None
        if self.shared_expert and not shared:
            raise CheckpointError("config.json: qwen2_moe needs a positive shared_expert_intermediate_size")
        moe = MoEConfig(num_experts=experts, topk=topk, ffn_hidden_size=hf["moe_intermediate_size"],
                        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                        aux_loss_coeff=transformers_aux_loss(hf, topk), shared_expert_size=shared,
                        shared_expert_gate=self.shared_expert)
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
        return moe, None if len(layers) == hf["num_hidden_layers"] else layers

    def hf_config(self, cfg):
        out = super().hf_config(cfg)
        moe = router_to_hf(cfg, out)
        if self.shared_expert != bool(moe.shared_expert_size and moe.shared_expert_gate):
            raise CheckpointError(f"{cfg.family}: " + ("qwen2_moe needs a gated shared expert" if self.shared_expert
                                                       else "qwen3_moe has no shared expert"))
        out.update(num_experts=moe.num_experts, moe_intermediate_size=moe.ffn_hidden_size or cfg.ffn_hidden_size,
                   norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)])
        return out


class Qwen3MoE(QwenMoE, Qwen3):
    name = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    aliases = ("qwen3-moe",)
    specs = ("qwen3_moe_spec",)
    # MindSpeed-LLM's hunyuan3 and ling_v2 scripts build HY-V3's and Ling-V2's folders with bailing_spec (Qwen3's layer)
    spec_also = ("hy_v3", "bailing_moe_v2")
    dense = "qwen3"
    presets = {
        "tiny-qwen3-moe": dict(family="qwen3_moe", hidden_size=128, num_layers=4, num_attention_heads=4,
                               num_query_groups=2, kv_channels=32, ffn_hidden_size=352, qk_layernorm=True,
                               norm_epsilon=1e-6, moe=dict(num_experts=8, topk=2, ffn_hidden_size=96)),
    }


FAMILY = Qwen3MoE()
