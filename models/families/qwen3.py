"""Qwen3: LLaMA's decoder with q/k norms, one attention_bias switch and Qwen's sliding windows.

MindSpeed-LLM's bailing_spec (Ling-V2's, and its Hunyuan-V3 scripts') builds this layer too: grouped-
query attention with per-head q/k norms; its rotated share, its experts (sigmoid scores in groups with
the expert bias, a shared expert) and its multi-token prediction come from the flags. Ling-V2's own
folders (BailingMoeV2, modelling code outside transformers) are the family-ling-v2 row's."""

from __future__ import annotations

from mindspeed_core.models.families.base import LlamaLike


class Qwen3(LlamaLike):
    name = "qwen3"
    architecture = "Qwen3ForCausalLM"
    aliases = ("qwen3",)
    specs = ("qwen3_spec", "bailing_spec")
    window = "typed"
    one_attention_bias = True
    qk_norm = True
    presets = {
        "tiny-qwen3": dict(family="qwen3", hidden_size=128, num_layers=4, num_attention_heads=4, num_query_groups=2,
                           kv_channels=32, ffn_hidden_size=352, qk_layernorm=True, norm_epsilon=1e-6),
    }


FAMILY = Qwen3()
