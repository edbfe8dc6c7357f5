"""LLaMA (Llama 2, Llama 3): the decoder every other family here is a variation of."""

from __future__ import annotations

from mindspeed_core.models.families.base import LlamaLike


class Llama(LlamaLike):
    name = "llama"
    architecture = "LlamaForCausalLM"
    aliases = ("llama2", "llama3")
    specs = ("llama_spec",)
    one_attention_bias = True
    presets = {
        # tiny shapes that train on a CPU in minutes
        "tiny-llama": dict(family="llama", hidden_size=128, num_layers=4, num_attention_heads=4, num_query_groups=2,
                           ffn_hidden_size=352, max_position_embeddings=256),
        # the real shapes, for --dry-run arithmetic and conversion
        "llama2-7b": dict(family="llama", hidden_size=4096, num_layers=32, num_attention_heads=32,
                          ffn_hidden_size=11008, vocab_size=32000, max_position_embeddings=4096, norm_epsilon=1e-5),
        "llama3-8b": dict(family="llama", hidden_size=4096, num_layers=32, num_attention_heads=32, num_query_groups=8,
                          ffn_hidden_size=14336, vocab_size=128256, max_position_embeddings=8192,
                          rotary_base=500000.0),
    }

    def mlp_bias_from_hf(self, hf: dict) -> bool:
        return bool(hf.get("mlp_bias"))  # the MLP's three projections

    def hf_config(self, cfg):
        out = super().hf_config(cfg)
        out["mlp_bias"] = cfg.add_bias_linear
        return out


FAMILY = Llama()
