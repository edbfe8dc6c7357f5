"""MiniMax-M2 (transformers' minimax_m2; MindSpeed-LLM's minimax27 scripts): grouped-query
attention whose q/k RMSNorms run over all heads at once (one weight per feature of the whole
query or key projection, one mean square over it: models/layers.py HeadsRMSNorm; under tensor
parallelism the ranks add their heads' squares), RoPE on part of each head (the release's
``rotary_dim``), and in every layer experts chosen by sigmoid scores steered by the block's
``e_score_correction_bias`` (aux-loss-free balancing), their weights renormalised; no shared
expert."""

from __future__ import annotations

import dataclasses

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import ModelConfig, MoEConfig
from mindspeed_core.models.families.base import LlamaLike, transformers_aux_loss
from mindspeed_core.models.families.mixtral import moe_sizes_of


class MiniMaxM2(LlamaLike):
    name = "minimax_m2"
    architecture = "MiniMaxM2ForCausalLM"
    aliases = ("minimax_m2",)
    specs = ("minimax_spec",)
    spec_fields = {"qk_norm_across_heads": True}  # its spec's q/k norms (no flag of their own)
    builds, experts = "moe", True
    partial_rotary = True
    qk_norm = True
    peft_export = False
    expert_bias_name = "e_score_correction_bias"  # on the block, not under its gate
    presets = {
        "tiny-minimax-m2": dict(family="minimax_m2", hidden_size=128, num_layers=4, num_attention_heads=4,
                                num_query_groups=2, kv_channels=32, ffn_hidden_size=96, qk_layernorm=True,
                                qk_norm_across_heads=True, rotary_percent=0.5, norm_epsilon=1e-6,
                                moe=dict(num_experts=8, topk=2, ffn_hidden_size=96, score_function="sigmoid",
                                         enable_expert_bias=True, load_balancing_type="none", aux_loss_coeff=0.0)),
    }

    def config_from_hf(self, hf: dict) -> ModelConfig:
        if hf.get("rotary_dim") is not None and "partial_rotary_factor" not in (hf.get("rope_parameters") or {}):
            # the released folders give RoPE's share as rotary_dim (transformers reads it so)
            head = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
            hf = {**hf, "partial_rotary_factor": hf["rotary_dim"] / head}
        return dataclasses.replace(super().config_from_hf(hf), qk_norm_across_heads=True)

    def moe_from_hf(self, hf: dict) -> tuple:
        topk, experts = moe_sizes_of(hf)
        if hf.get("router_jitter_noise"):
            raise CheckpointError(f"config.json: router_jitter_noise {hf['router_jitter_noise']!r} is not supported "
                                  f"(set it to 0)")
        return MoEConfig(num_experts=experts, topk=topk, ffn_hidden_size=hf["intermediate_size"],
                         score_function="sigmoid", norm_topk_prob=True, enable_expert_bias=True,
                         aux_loss_coeff=transformers_aux_loss(hf, topk),
                         load_balancing_type="aux_loss" if hf.get("output_router_logits") else "none"), None

    def hf_config(self, cfg: ModelConfig) -> dict:
        out = super().hf_config(cfg)
        moe = cfg.moe
        if not (cfg.qk_layernorm and cfg.qk_norm_across_heads) or cfg.add_qkv_bias or cfg.attention_output_bias:
            raise CheckpointError("minimax_m2 has q/k norms over all heads and no attention biases: this model's "
                                  "attention has no equivalent there")
        if (moe is None or cfg.moe_layers is not None or moe.score_function != "sigmoid" or not moe.enable_expert_bias
                or not moe.norm_topk_prob or moe.num_groups or moe.scaling_factor != 1.0 or moe.shared_expert_size
                or moe.capacity_factor is not None):
            raise CheckpointError("minimax_m2 has in every layer experts routed by sigmoid scores with the expert "
                                  "bias, renormalised, without groups, scaling, a shared expert or capacity")
        out.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.topk,
                   intermediate_size=moe.ffn_hidden_size or cfg.ffn_hidden_size, router_jitter_noise=0.0,
                   output_router_logits=moe.aux_loss_coeff > 0, router_aux_loss_coef=moe.aux_loss_coeff / moe.topk,
                   # transformers' defaults name ids past a small vocabulary
                   bos_token_id=None, eos_token_id=None)
        return out

    def moe_names(self, cfg, i):
        return f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")


FAMILY = MiniMaxM2()
