"""Qwen2 / Qwen2.5: LLaMA's decoder with q/k/v biases (no output bias) and sliding windows in
the layers its layer_types name."""

from __future__ import annotations

from mindspeed_core.models.families.base import LlamaLike


class Qwen2(LlamaLike):
    name = "qwen2"
    architecture = "Qwen2ForCausalLM"
    aliases = ("qwen2", "qwen25")
    specs = ("qwen2_spec",)
    window = "typed"
    presets = {
        "tiny-qwen2": dict(family="qwen2", hidden_size=128, num_layers=4, num_attention_heads=4, num_query_groups=2,
                           ffn_hidden_size=352, add_qkv_bias=True, norm_epsilon=1e-6, rotary_base=1000000.0),
        "qwen2.5-7b": dict(family="qwen2", hidden_size=3584, num_layers=28, num_attention_heads=28,
                           num_query_groups=4, ffn_hidden_size=18944, vocab_size=152064,
                           max_position_embeddings=32768, add_qkv_bias=True, norm_epsilon=1e-6,
                           rotary_base=1000000.0),
    }

    def qkv_bias_from_hf(self, hf: dict) -> bool:
        return bool(hf.get("qkv_bias", True))  # Qwen2-MoE's may turn them off


FAMILY = Qwen2()
