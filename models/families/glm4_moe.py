"""GLM-4.5 (and GLM-4.5-Air): grouped-query attention with q/k/v biases, optional q/k norms and
RoPE on part of each head; dense layers first, then DeepSeek-V3's router and shared experts; its
folders may carry multi-token prediction layers."""

from __future__ import annotations

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.families import deepseek
from mindspeed_core.models.families.base import Family, decoder_hf_config, partial_rotary_factor, rope


class GLM4MoE(Family):
    name = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    aliases = ("glm45", "glm45-air")
    experts = True
    mtp_layers = trailing_layers = True
    partial_rotary = True
    shared_experts_prefix = "shared_experts."
    presets = {
        # GLM-4.5's layer: q/k/v biases, q/k norms, RoPE on half of each head, a dense first layer,
        # then sigmoid routing with the expert bias, normalised and scaled, beside a shared expert
        "tiny-glm45": dict(family="glm4_moe", hidden_size=128, num_layers=4, num_attention_heads=4,
                           num_query_groups=2, kv_channels=32, ffn_hidden_size=352, add_qkv_bias=True,
                           qk_layernorm=True, rotary_percent=0.5, norm_epsilon=1e-5, moe_layers=(1, 2, 3),
                           moe=dict(num_experts=8, topk=2, ffn_hidden_size=96, score_function="sigmoid",
                                    scaling_factor=2.5, enable_expert_bias=True, load_balancing_type="none",
                                    aux_loss_coeff=0.0, shared_expert_size=96)),
    }

    def config_from_hf(self, hf: dict) -> ModelConfig:
        if hf.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {hf.get('hidden_act')!r} is not supported for glm4_moe (silu only)")
        theta, scaling = rope(hf)
        layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
        dense = hf.get("first_k_dense_replace", 1)
        moe_layers = tuple(range(min(dense, layers), layers)) if hf.get("n_routed_experts") else ()
        return ModelConfig(
            family="glm4_moe", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=layers,
            num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
            kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_hidden_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048), norm_epsilon=hf.get("rms_norm_eps", 1e-5),
            rotary_base=theta, rope_scaling=scaling, add_qkv_bias=bool(hf.get("attention_bias")),
            qk_layernorm=bool(hf.get("use_qk_norm")), rotary_percent=float(partial_rotary_factor(hf, default=0.5)),
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            moe=deepseek.moe_from_hf(hf, "glm4_moe") if moe_layers else None, moe_layers=moe_layers or None)

    def hf_config(self, cfg: ModelConfig) -> dict:
        out = decoder_hf_config(self, cfg)
        if cfg.attention_output_bias or cfg.add_bias_linear or cfg.mla is not None:
            raise CheckpointError("glm4_moe has grouped-query attention with biases on q, k and v only "
                                  "(attention_bias): this model has another attention or other biases")
        out.update(attention_bias=cfg.add_qkv_bias, use_qk_norm=cfg.qk_layernorm, first_k_dense_replace=cfg.num_layers,
                   num_nextn_predict_layers=cfg.mtp_num_layers)
        deepseek.moe_to_hf(cfg, out, v3=True)
        out.pop("topk_method", None)  # its router has no method or scoring keys
        return out


FAMILY = GLM4MoE()
