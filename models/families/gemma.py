"""Gemma 2 and Gemma 3's text model: RMSNorm weights as offsets from one, norms after attention
and after the MLP too, embeddings scaled by sqrt(hidden), GeGLU, query_pre_attn_scalar,
soft-capped scores and logits, sliding windows on the layers layer_types names; Gemma 3 adds q/k
norms, its layer pattern and a local RoPE base for its sliding layers."""

from __future__ import annotations

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.families.base import Family, refuse_partial_rotary, rope

# Gemma's gated MLP: its hidden_activation on the gate half
_GATED_ACTS = {"gelu_pytorch_tanh": "geglu_tanh", "gelu_new": "geglu_tanh", "gelu": "geglu"}


class Gemma2(Family):
    name = "gemma2"
    architecture = "Gemma2ForCausalLM"
    aliases = ("gemma2",)
    specs = ("gemma2_spec",)
    one_attention_bias = True
    expresses = ("gemma",)
    peft_export = True
    presets = {
        # Gemma 2's shape in small: (1 + w) norms before and after each block, GeGLU, scores scaled by
        # query_pre_attn_scalar and soft-capped, every other layer attending to a 16-token window
        "tiny-gemma2": dict(family="gemma2", hidden_size=128, num_layers=4, num_attention_heads=4,
                            num_query_groups=2, kv_channels=32, ffn_hidden_size=256, activation="geglu_tanh",
                            norm_epsilon=1e-6, norm_offset=True, post_norm=True, scale_embeddings=True,
                            query_pre_attn_scalar=32, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                            sliding_window=16, sliding_window_layers=(0, 2),
                            untie_embeddings_and_output_weights=False),
    }
    gemma3 = False

    def config_from_hf(self, hf: dict) -> ModelConfig:
        kind = hf["model_type"]
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GATED_ACTS:
            raise CheckpointError(f"config.json: hidden_activation {act!r} is not supported for {kind} "
                                  f"({', '.join(_GATED_ACTS)})")
        if hf.get("use_bidirectional_attention"):
            raise CheckpointError("config.json: use_bidirectional_attention (an encoder's attention) is not supported")
        refuse_partial_rotary(hf, kind, False)
        gemma3 = self.gemma3
        if gemma3:
            theta, scaling, local = _gemma3_rope(hf)
        else:
            (theta, scaling), local = rope(hf), None
        heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
        every = hf.get("sliding_window_pattern", 6) if gemma3 else 2  # each every-th layer attends globally
        types = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                          for i in range(layers)]
        if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
            raise CheckpointError(f"config.json: layer_types must name sliding_attention or full_attention for each "
                                  f"of the {layers} layers")
        window = hf.get("sliding_window", 4096)
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        bias = bool(hf.get("attention_bias"))
        return ModelConfig(
            family=self.name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            num_layers=layers, num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
            kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_hidden_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 131072 if gemma3 else 8192),
            norm_epsilon=hf.get("rms_norm_eps", 1e-6), activation=_GATED_ACTS[act], rotary_base=theta,
            rope_scaling=scaling, add_qkv_bias=bias, attention_output_bias=bias, qk_layernorm=gemma3,
            norm_offset=True, post_norm=True, scale_embeddings=True,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
            attn_logit_softcapping=hf.get("attn_logit_softcapping", None if gemma3 else 50.0),
            final_logit_softcapping=hf.get("final_logit_softcapping", None if gemma3 else 30.0),
            sliding_window=window if window and sliding else None,
            sliding_window_layers=sliding if window and sliding else None,
            local_rotary_base=local if window and sliding else None,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True))

    def hf_config(self, cfg: ModelConfig) -> dict:
        out = super().hf_config(cfg)
        if not (cfg.norm_offset and cfg.post_norm and cfg.scale_embeddings) or \
                cfg.activation not in ("geglu", "geglu_tanh"):
            raise CheckpointError(f"{cfg.family} has RMSNorm weights as offsets from one, post norms, scaled "
                                  f"embeddings and a GeGLU MLP: this model lacks one of them")
        gemma3 = self.gemma3
        if cfg.add_qkv_bias != cfg.attention_output_bias or cfg.add_bias_linear or cfg.qk_layernorm != gemma3:
            raise CheckpointError(f"{cfg.family} has one attention_bias for q, k, v and o, no MLP bias and "
                                  f"{'q/k norms' if gemma3 else 'no q/k norms'}")
        del out["hidden_act"]
        if gemma3:  # its two RoPEs per layer type; the sliding layers' unscaled
            local = cfg.local_rotary_base if cfg.local_rotary_base is not None else cfg.rotary_base
            if cfg.sliding_window is not None and cfg.local_rotary_base is None and cfg.rope_scaling:
                raise CheckpointError("gemma3 scales only its global layers' RoPE: this model scales every layer's")
            out.update(model_type="gemma3_text", rope_parameters={
                "full_attention": out["rope_parameters"],
                "sliding_attention": {"rope_type": "default", "rope_theta": local}})
            del out["rope_theta"]
        every = list(range(cfg.num_layers))
        sliding = every if cfg.sliding_window_layers is None else cfg.sliding_window_layers
        out.update(hidden_activation="gelu_pytorch_tanh" if cfg.activation == "geglu_tanh" else "gelu",
                   attention_bias=cfg.add_qkv_bias, query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.kv_channels,
                   attn_logit_softcapping=cfg.attn_logit_softcapping,
                   final_logit_softcapping=cfg.final_logit_softcapping,
                   sliding_window=cfg.sliding_window, layer_types=[
                       "sliding_attention" if cfg.sliding_window and i in sliding else "full_attention"
                       for i in every])
        return out

    def layer_names(self, cfg, i):
        # its post_attention_layernorm is the norm after attention, not before the MLP
        names = super().layer_names(cfg, i)
        a, b = f"model.layers.{i}.", f"decoder.layers.{i}."
        names.update({a + "post_attention_layernorm.weight": b + "post_attn_norm.weight",
                      a + "pre_feedforward_layernorm.weight": b + "pre_mlp_layernorm.weight",
                      a + "post_feedforward_layernorm.weight": b + "post_mlp_layernorm.weight"})
        return names


class Gemma3(Gemma2):
    name = "gemma3"
    model_types = ("gemma3_text",)
    architecture = "Gemma3ForCausalLM"
    aliases = ("gemma3",)
    specs = ()
    # the vision-language model's config.json, whose text model alone is read here
    refused_model_types = {"gemma3": "model_type 'gemma3' is Gemma 3's vision-language model: its text model "
                                     "alone (model_type gemma3_text, Gemma3ForCausalLM) is supported"}
    presets = {
        # Gemma 3's: q/k norms, five sliding layers (window 16, RoPE base 10000) to each global one
        # (base 1e6), no soft-capping
        "tiny-gemma3": dict(family="gemma3", hidden_size=128, num_layers=6, num_attention_heads=4,
                            num_query_groups=2, kv_channels=32, ffn_hidden_size=256, activation="geglu_tanh",
                            norm_epsilon=1e-6, norm_offset=True, post_norm=True, scale_embeddings=True,
                            query_pre_attn_scalar=32, qk_layernorm=True, rotary_base=1000000.0,
                            local_rotary_base=10000.0, sliding_window=16, sliding_window_layers=(0, 1, 2, 3, 4),
                            untie_embeddings_and_output_weights=False),
    }
    gemma3 = True


def _gemma3_rope(hf: dict) -> tuple[float, dict | None, float]:
    """Gemma 3's two RoPEs: (global base, global scaling, local base). transformers 5 keeps them
    per layer type in rope_parameters; older configs as rope_theta, rope_scaling and
    rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise CheckpointError(f"config.json: rope_parameters.sliding_attention.rope_type "
                                  f"{local['rope_type']!r} is not supported (default only)")
        theta, scaling = rope({**hf, "rope_parameters": params.get("full_attention") or {}, "rope_scaling": None})
        return theta, scaling, float(local.get("rope_theta", 10000.0))
    theta, scaling = rope({"rope_theta": 1000000.0, **hf})
    return theta, scaling, float(hf.get("rope_local_base_freq", 10000.0))


FAMILY = (Gemma2(), Gemma3())
