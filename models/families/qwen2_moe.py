"""Qwen2-MoE: Qwen2's attention (q/k/v biases unless qkv_bias is false), softmax-routed experts
beside a shared expert with a sigmoid gate."""

from __future__ import annotations

from mindspeed_core.models.families.qwen2 import Qwen2
from mindspeed_core.models.families.qwen3_moe import QwenMoE


class Qwen2MoE(QwenMoE, Qwen2):
    name = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    aliases = ("qwen2-moe",)
    specs = ()
    dense = "qwen2"
    shared_expert = True
    presets = {
        "tiny-qwen2-moe": dict(family="qwen2_moe", hidden_size=128, num_layers=4, num_attention_heads=4,
                               num_query_groups=2, ffn_hidden_size=352, add_qkv_bias=True, norm_epsilon=1e-6,
                               moe=dict(num_experts=8, topk=2, ffn_hidden_size=96, norm_topk_prob=False,
                                        shared_expert_size=256, shared_expert_gate=True)),
    }

    def hf_config(self, cfg):
        out = super().hf_config(cfg)
        out.update(shared_expert_intermediate_size=cfg.moe.shared_expert_size, qkv_bias=cfg.add_qkv_bias)
        return out


FAMILY = Qwen2MoE()
