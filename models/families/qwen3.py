"""Qwen3: LLaMA's decoder with q/k norms, one attention_bias switch and Qwen's sliding windows."""

from __future__ import annotations

from mindspeed_core.models.families.base import LlamaLike


class Qwen3(LlamaLike):
    name = "qwen3"
    architecture = "Qwen3ForCausalLM"
    aliases = ("qwen3",)
    specs = ("qwen3_spec",)
    window = "typed"
    one_attention_bias = True
    qk_norm = True
    presets = {
        "tiny-qwen3": dict(family="qwen3", hidden_size=128, num_layers=4, num_attention_heads=4, num_query_groups=2,
                           kv_channels=32, ffn_hidden_size=352, qk_layernorm=True, norm_epsilon=1e-6),
    }


FAMILY = Qwen3()
