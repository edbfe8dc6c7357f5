"""GPT-OSS: attention sinks, sliding windows on alternate layers, YaRN, and in every layer an MoE
of biased experts with the clamped SwiGLU (megatron-core's quick GELU, offset 1), their gate and
up columns interleaved; its released folders hold the experts as MXFP4 blocks, read dequantised."""

from __future__ import annotations

import numpy as np

from mindspeed_core import features
from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import ModelConfig, MoEConfig
from mindspeed_core.models.families.base import Family, rope, transformers_aux_loss

# the sigmoid gain of transformers' GPT-OSS experts, which our quick_geglu has built in
_QUICK_GELU_ALPHA = 1.702


class GPTOSS(Family):
    name = "gpt_oss"
    architecture = "GptOssForCausalLM"
    aliases = ("gpt-oss",)
    builds, experts = "moe", True
    quantizations = ("mxfp4",)
    presets = {
        # GPT-OSS's: attention sinks, biases on q/k/v/o, windows of 16 on every other layer, YaRN,
        # every layer an MoE of biased quick-GEGLU experts (offset 1, clamped at 7) with a biased router
        "tiny-gpt-oss": dict(family="gpt_oss", hidden_size=128, num_layers=4, num_attention_heads=4,
                             num_query_groups=2, kv_channels=32, ffn_hidden_size=96, add_qkv_bias=True,
                             add_bias_linear=True, activation="quick_geglu", glu_linear_offset=1.0,
                             activation_func_clamp_value=7.0, attention_sinks=True, sliding_window=16,
                             sliding_window_layers=(0, 2), rotary_base=150000.0,
                             rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                               truncate=False, original_max_position_embeddings=64),
                             moe=dict(num_experts=8, topk=2, aux_loss_coeff=0.01)),
    }

    def config_from_hf(self, hf: dict) -> ModelConfig:
        alpha = hf.get("swiglu_alpha", _QUICK_GELU_ALPHA)
        if alpha != _QUICK_GELU_ALPHA:
            raise CheckpointError(f"config.json: swiglu_alpha {alpha!r} is not supported for gpt_oss (1.702 only, "
                                  f"megatron-core's quick GELU)")
        theta, scaling = rope(hf)
        layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
        types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(layers)]
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        window = hf.get("sliding_window") if sliding else None
        topk = hf["num_experts_per_tok"]
        bias = bool(hf.get("attention_bias", True))
        return ModelConfig(
            family="gpt_oss", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=layers,
            num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
            kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_hidden_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 131072),
            norm_epsilon=hf.get("rms_norm_eps", 1e-5), rotary_base=theta, rope_scaling=scaling, add_qkv_bias=bias,
            attention_output_bias=bias, add_bias_linear=True, activation="quick_geglu", glu_linear_offset=1.0,
            activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)), attention_sinks=True,
            sliding_window=window, sliding_window_layers=sliding if window else None,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            moe=MoEConfig(num_experts=hf["num_local_experts"], topk=topk, ffn_hidden_size=hf["intermediate_size"],
                          norm_topk_prob=True, aux_loss_coeff=transformers_aux_loss(hf, topk)))

    def hf_config(self, cfg: ModelConfig) -> dict:
        moe = cfg.moe
        if (moe is None or cfg.moe_layers is not None or not cfg.attention_sinks or cfg.activation != "quick_geglu"
                or cfg.glu_linear_offset != 1.0 or cfg.activation_func_clamp_value is None or not cfg.add_bias_linear
                or cfg.add_qkv_bias != cfg.attention_output_bias or cfg.qk_layernorm or cfg.mla is not None
                or cfg.rotary_percent != 1.0 or moe.score_function != "softmax" or not moe.norm_topk_prob
                or moe.num_groups or moe.scaling_factor != 1.0 or moe.enable_expert_bias or moe.shared_expert_size
                or moe.capacity_factor is not None
                or (moe.ffn_hidden_size or cfg.ffn_hidden_size) != cfg.ffn_hidden_size):
            raise CheckpointError("gpt_oss is attention with sinks and one bias switch, and in every layer an MoE MLP "
                                  "of biased quick-GEGLU experts (offset 1, clamped) routed by softmax top-k: this "
                                  "model differs, and cannot be written as a gpt_oss folder")
        every = range(cfg.num_layers)
        sliding = every if cfg.sliding_window_layers is None else cfg.sliding_window_layers
        rope_parameters = {"rope_type": "default", "rope_theta": cfg.rotary_base}
        rope_parameters.update(cfg.rope_scaling or {})
        return {"model_type": "gpt_oss", "architectures": [self.architecture], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
                "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
                "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels,
                "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon,
                "rope_theta": cfg.rotary_base, "rope_parameters": rope_parameters,
                "attention_bias": cfg.add_qkv_bias, "sliding_window": cfg.sliding_window, "layer_types": [
                    "sliding_attention" if cfg.sliding_window and i in sliding else "full_attention" for i in every],
                "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
                "swiglu_alpha": _QUICK_GELU_ALPHA, "swiglu_limit": cfg.activation_func_clamp_value,
                "output_router_logits": moe.aux_loss_coeff > 0, "router_aux_loss_coef": moe.aux_loss_coeff / moe.topk,
                "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights, "hidden_act": "silu"}

    def experts_from_hf(self, cfg, i, hf, take):
        """Layer i's router and experts: gate_up_proj [E, h, 2f] with gate and up columns
        interleaved (ours: gate columns, then up), down_proj [E, f, h] as ours; dequantised from
        MXFP4 where the folder holds them so."""
        features.note_used("hf-gpt-oss")
        a, b = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."

        def weight(name):
            if a + f"experts.{name}_blocks" in hf:
                return dequantize_mxfp4(take(a + f"experts.{name}_blocks"), take(a + f"experts.{name}_scales"))
            return take(a + f"experts.{name}")

        gate_up, gate_up_bias = weight("gate_up_proj"), take(a + "experts.gate_up_proj_bias")
        return {b + "router.weight": take(a + "router.weight"), b + "router.bias": take(a + "router.bias"),
                b + "experts.weight1": np.concatenate([gate_up[..., 0::2], gate_up[..., 1::2]], axis=-1),
                b + "experts.bias1": np.concatenate([gate_up_bias[..., 0::2], gate_up_bias[..., 1::2]], axis=-1),
                b + "experts.weight2": weight("down_proj"), b + "experts.bias2": take(a + "experts.down_proj_bias")}

    def experts_to_hf(self, cfg, i, ours):
        features.note_used("hf-gpt-oss")
        a, b = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        return {a + "router.weight": ours[b + "router.weight"], a + "router.bias": ours[b + "router.bias"],
                a + "experts.gate_up_proj": _interleave(ours[b + "experts.weight1"]),
                a + "experts.gate_up_proj_bias": _interleave(ours[b + "experts.bias1"]),
                a + "experts.down_proj": ours[b + "experts.weight2"],
                a + "experts.down_proj_bias": ours[b + "experts.bias2"]}


# MXFP4 (OCP microscaling): 4-bit e2m1 values, two to a byte (low nibble first), in blocks
# of 32 sharing one power-of-two scale stored as its exponent + 127
_FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                     np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GPT-OSS's stored experts: ``blocks`` uint8 [E, rows, G, 16] and ``scales`` uint8
    [E, rows, G] -> float32 [E, G x 32, rows] (the weight as transformers holds it, inputs
    first). Exact: every value is a small float times a power of two."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape or blocks.ndim != 4:
        raise CheckpointError(f"MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales "
                              f"{scales.dtype}{list(scales.shape)}: expected uint8 [E, rows, G, B] and [E, rows, G]")
    values = np.stack([_FP4_E2M1[blocks & 0x0F], _FP4_E2M1[blocks >> 4]], axis=-1)  # [E, rows, G, B, 2]
    values = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None, None])
    e, rows = blocks.shape[:2]
    return np.ascontiguousarray(values.reshape(e, rows, -1).swapaxes(1, 2))


def _interleave(gate_then_up: np.ndarray) -> np.ndarray:
    """[..., 2f] gate columns then up columns -> GPT-OSS's alternating gate, up, gate, ..."""
    gate, up = np.split(gate_then_up, 2, axis=-1)
    return np.ascontiguousarray(np.stack([gate, up], axis=-1).reshape(gate_then_up.shape))


FAMILY = GPTOSS()
