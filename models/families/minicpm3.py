"""MiniCPM3: DeepSeek-V2's latent attention (its rotation in halves) in a dense model with
MiniCPM's scalings of the embeddings (scale_emb), the residual branches (scale_depth) and the
output (dim_model_base)."""

from __future__ import annotations

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.families.base import Family, decoder_hf_config, rope
from mindspeed_core.models.families.deepseek import mla_from_hf


class MiniCPM3(Family):
    name = "minicpm3"
    architecture = "MiniCPM3ForCausalLM"
    aliases = ("minicpm3",)
    expresses = ("minicpm",)
    presets = {
        # MiniCPM3's: latent attention with a query latent (rotated in halves), tied embeddings,
        # embeddings times 12, residual branches times 1.4 / sqrt(4), the output divided by 128 / 32
        "tiny-minicpm3": dict(family="minicpm3", hidden_size=128, num_layers=4, num_attention_heads=4,
                              ffn_hidden_size=352, qk_layernorm=True, untie_embeddings_and_output_weights=False,
                              norm_epsilon=1e-5, scale_emb=12.0, scale_depth=1.4, dim_model_base=32.0,
                              mla=dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                       v_head_dim=32, rope_interleave=False)),
    }

    def config_from_hf(self, hf: dict) -> ModelConfig:
        mla = mla_from_hf(hf, "minicpm3", interleave=False)
        theta, scaling = rope(hf)
        depth = hf.get("scale_depth", 1.4)
        base = hf.get("dim_model_base", 256)
        return ModelConfig(
            family="minicpm3", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"], num_attention_heads=hf["num_attention_heads"],
            ffn_hidden_size=hf["intermediate_size"], max_position_embeddings=hf.get("max_position_embeddings", 32768),
            norm_epsilon=hf.get("rms_norm_eps", 1e-5), rotary_base=theta, rope_scaling=scaling,
            attention_output_bias=bool(hf.get("attention_bias")), qk_layernorm=True, mla=mla,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
            scale_emb=float(hf.get("scale_emb", 12)),
            # None in the config: transformers' no-op values (sqrt(layers), the hidden size)
            scale_depth=None if depth is None else float(depth), dim_model_base=None if base is None else float(base))

    def hf_config(self, cfg: ModelConfig) -> dict:
        out = decoder_hf_config(self, cfg)
        mla = cfg.mla
        if (mla is None or mla.rope_interleave or not cfg.qk_layernorm or cfg.add_qkv_bias or cfg.add_bias_linear
                or cfg.dsa is not None):
            raise CheckpointError("minicpm3 has multi-latent attention (rotated in halves) with its latents' norms, "
                                  "and no q/k/v or MLP biases or sparse attention: this model lacks one of them or "
                                  "has more")
        del out["head_dim"]
        out.update(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
                   qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
                   num_key_value_heads=cfg.num_attention_heads, attention_bias=cfg.attention_output_bias,
                   scale_emb=cfg.scale_emb if cfg.scale_emb is not None else 1.0, scale_depth=cfg.scale_depth,
                   dim_model_base=None if cfg.dim_model_base is None else int(cfg.dim_model_base))  # an int there
        if cfg.dim_model_base is not None and cfg.dim_model_base != int(cfg.dim_model_base):
            raise CheckpointError(f"minicpm3's dim_model_base is a whole number, this model's is {cfg.dim_model_base}")
        return out


FAMILY = MiniCPM3()
