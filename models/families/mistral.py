"""Mistral: LLaMA's decoder with a sliding window in every layer (or none), no attention biases."""

from __future__ import annotations

from mindspeed_core.models.families.base import LlamaLike


class Mistral(LlamaLike):
    name = "mistral"
    architecture = "MistralForCausalLM"
    aliases = ("mistral", "magistral")  # Magistral (MindSpeed-LLM's magistral scripts) is Mistral's architecture
    specs = ("mistral_spec",)
    window = "every"
    presets = {
        "tiny-mistral": dict(family="mistral", hidden_size=128, num_layers=4, num_attention_heads=4,
                             num_query_groups=1, ffn_hidden_size=352),
    }


FAMILY = Mistral()
