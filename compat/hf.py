"""Hugging Face model folders <-> our models (config.json + safetensors, sharded or not).

Works on numpy state dicts, so it runs the same under either framework:
``load_folder`` -> (ModelConfig, state in our names); ``save_folder`` writes a folder that
transformers loads. Supported model types: llama, mistral, qwen2, qwen3, phi3 (Phi-3 / 3.5:
fused qkv_proj and gate_up_proj, LongRoPE), gemma2 (norms as offsets from one, post norms,
scaled embeddings, soft-capping, sliding windows on alternate layers), gemma3_text (the same with
q/k norms, its layer pattern and a local RoPE base), gpt2, and the mixtures of experts mixtral,
qwen2_moe, qwen3_moe (their experts written one by one, the layout every release of
transformers reads), deepseek_v2 / deepseek_v3 (latent attention, their routers, MTP layers),
glm4_moe, minicpm3, and gpt_oss (attention sinks, biased clamped experts; MXFP4 experts read
dequantised).
"""

from __future__ import annotations

import dataclasses

import json
import os
import shutil

import numpy as np

from mindspeed_core import features, nn, tensor_files
from mindspeed_core.backends.common import check_fits_in_memory
from mindspeed_core.errors import CheckpointError
from mindspeed_core.models import registry
from mindspeed_core.models import rope as rotary
from mindspeed_core.models.config import MLAConfig, ModelConfig, MoEConfig
from mindspeed_core.models.gpt import whole_state
from mindspeed_core.models.state import merge_lora, renumber_layers

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
# each mixture of experts has the attention of a dense family
MOE_BASE = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}
# multi-head latent attention, dense layers first, then DeepSeek's MoE (models/mla.py)
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
# GLM-4.5: grouped-query attention with q/k/v biases, optional q/k norms and RoPE on part of
# each head; dense layers first, then DeepSeek-V3's router and shared experts
GLM = ("glm4_moe",)
# whose shared experts are `shared_experts` (plural, no gate), and whose folders may carry
# multi-token prediction layers after the last one (num_nextn_predict_layers)
SHARED_EXPERTS = DEEPSEEK + GLM
# MiniCPM3: DeepSeek-V2's latent attention (its rotation in halves) in a dense model with MiniCPM's
# scalings of the embeddings, the residual branches and the output
MINICPM = ("minicpm3",)
# GPT-OSS: attention sinks, sliding windows on alternate layers, YaRN, biased experts with
# the clamped SwiGLU, their gate and up columns interleaved; its released folders hold the
# experts as MXFP4 blocks, read dequantised (dequantize_mxfp4)
GPT_OSS = ("gpt_oss",)
SUPPORTED = LLAMA_LIKE + ("gpt2",) + tuple(MOE_BASE) + DEEPSEEK + GLM + MINICPM + GPT_OSS
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3": "Gemma3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM",
                  "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "glm4_moe": "Glm4MoeForCausalLM", "minicpm3": "MiniCPM3ForCausalLM",
                  "gpt_oss": "GptOssForCausalLM"}
_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# Gemma's gated MLP: its hidden_activation on the gate half
_GATED_ACTS = {"gelu_pytorch_tanh": "geglu_tanh", "gelu_new": "geglu_tanh", "gelu": "geglu"}


# ---- configs ---------------------------------------------------------------------------------

def _rope(hf: dict) -> tuple[float, dict | None]:
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling:
        if not isinstance(scaling, dict):
            raise CheckpointError(f"config.json: {key} must be an object, got {scaling!r}")
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type") in ("llama3", "yarn", "longrope"):
            # transformers' reading: a top-level original_max_position_embeddings first, else
            # the one in rope_scaling, else the model's own length
            if hf.get("original_max_position_embeddings") is not None:
                scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
            elif hf.get("max_position_embeddings") is not None:
                scaling.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
        wrong = rotary.problem(scaling)
        if wrong:
            raise CheckpointError(f"config.json: {key}.{wrong}")
    return theta, scaling or None


def _window(hf: dict, base: str) -> tuple[int | None, tuple | None]:
    """(sliding_window, sliding_window_layers) as transformers reads them: Mistral's and Phi-3's
    window in every layer; Qwen's, with use_sliding_window, in its layer_types' sliding layers
    (by default those from max_window_layers on); Llama has none."""
    window = hf.get("sliding_window")
    if not window or base not in ("mistral", "phi3", "qwen2", "qwen3"):
        return None, None
    if base in ("mistral", "phi3"):
        return window, None
    if not hf.get("use_sliding_window"):
        return None, None
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
                                      for i in range(layers)]
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (window, sliding) if sliding else (None, None)


def _refuse_unsupported(hf: dict, kind: str) -> None:
    """Settings that change the math and that our model does not implement."""
    if _partial_rotary(hf) != 1.0 and kind != "phi3":  # Phi-3's transformers rotates the first features
        raise CheckpointError(f"config.json: partial_rotary_factor {_partial_rotary(hf)!r} (RoPE on part of each "
                              f"head) is not supported for {kind}")


def _partial_rotary(hf: dict, default: float = 1.0) -> float:
    return (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", default))


# the sizes config_from_hf reads, checked before any arithmetic on them
_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_inner", "n_positions",
          "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")


def config_from_hf(hf: dict) -> ModelConfig:
    """Our config from a Hugging Face config.json; anything missing, malformed or not
    supported is a CheckpointError naming the key."""
    if not isinstance(hf, dict):
        raise CheckpointError(f"config.json is a JSON {type(hf).__name__}, not an object")
    for key in _SIZES:
        value = hf.get(key)
        if value is not None and (type(value) is not int or value <= 0):
            raise CheckpointError(f"config.json: {key} must be a positive integer, got {value!r}")
    try:
        return _config_from_hf(hf)
    except KeyError as exc:
        raise CheckpointError(f"config.json has no {exc.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise CheckpointError(f"config.json: {exc}") from None


def _config_from_hf(hf: dict) -> ModelConfig:
    cfg = _decoder_config_from_hf(hf)
    # a sequence classifier with one label (XForSequenceClassification, num_labels 1) is a
    # reward model: its `score` is our rm_head
    architectures = hf.get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        if hf.get("num_labels", len(hf.get("id2label") or {0: 0})) != 1:
            raise CheckpointError("config.json: a sequence classifier with more than one label is not a reward model")
        cfg.reward_head = True
    return cfg


def _decoder_config_from_hf(hf: dict) -> ModelConfig:
    kind = hf.get("model_type")
    if kind == "gemma3":
        raise CheckpointError("model_type 'gemma3' is Gemma 3's vision-language model: its text model alone "
                              "(model_type gemma3_text, Gemma3ForCausalLM) is supported")
    if kind not in SUPPORTED:
        raise CheckpointError(f"model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    quantized = hf.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        if not (kind in GPT_OSS and method == "mxfp4"):
            raise CheckpointError(f"config.json: quantization_config: quant_method {method!r} weights are not read "
                                  f"here (only gpt_oss's MXFP4 experts are): use a dequantised (bf16) folder")
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        return ModelConfig(
            family="gpt2", vocab_size=hf["vocab_size"], hidden_size=hf["n_embd"], num_layers=hf["n_layer"],
            num_attention_heads=hf["n_head"], ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"],
            max_position_embeddings=hf["n_positions"], normalization="layernorm",
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), activation=_ACTS.get(act, act),
            position_embedding_type="learned", add_qkv_bias=True, add_bias_linear=True,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True))
    if kind in ("gemma2", "gemma3_text"):
        return _gemma_config(hf, kind)
    if kind in DEEPSEEK:
        return _deepseek_config(hf, kind)
    if kind in GLM:
        return _glm_config(hf)
    if kind in MINICPM:
        return _minicpm3_config(hf)
    if kind in GPT_OSS:
        return _gpt_oss_config(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {hf.get('hidden_act')!r} is not supported for {kind} (silu only)")
    base = MOE_BASE.get(kind, kind)
    _refuse_unsupported(hf, base)
    theta, scaling = _rope(hf)
    heads = hf["num_attention_heads"]
    # Llama and Qwen3's attention_bias: q, k, v and o projections; mlp_bias: the MLP's three.
    # Qwen2 has q/k/v biases and no others (Qwen2-MoE: unless qkv_bias is false); Mistral's
    # attention has none (transformers ignores attention_bias there, and so do we).
    attention_bias = bool(hf.get("attention_bias")) and base in ("llama", "qwen3")
    qwen2_bias = base == "qwen2" and hf.get("qkv_bias", True)
    moe, moe_layers = _moe_from_hf(hf, kind) if kind in MOE_BASE else (None, None)
    return ModelConfig(
        family=kind, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048), norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        rotary_base=theta, rope_scaling=scaling, add_qkv_bias=bool(qwen2_bias or attention_bias),
        add_bias_linear=bool(hf.get("mlp_bias")) and kind == "llama", attention_output_bias=attention_bias,
        qk_layernorm=base == "qwen3", untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        rotary_percent=float(_partial_rotary(hf)), moe=moe, moe_layers=moe_layers,
        **dict(zip(("sliding_window", "sliding_window_layers"), _window(hf, base))))


def _mla_from_hf(hf: dict, kind: str, interleave: bool) -> MLAConfig:
    """A latent attention's sizes (DeepSeek's keys, which MiniCPM3 shares); ``interleave``: its
    rotated features are pairs (DeepSeek-V2), not halves."""
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {hf.get('hidden_act')!r} is not supported for {kind} (silu only)")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"config.json: mlp_bias is not supported for {kind}")
    return MLAConfig(kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                     qk_rope_head_dim=hf["qk_rope_head_dim"],
                     v_head_dim=hf.get("v_head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                     q_lora_rank=hf.get("q_lora_rank"), rope_interleave=interleave)


def _minicpm3_config(hf: dict) -> ModelConfig:
    mla = _mla_from_hf(hf, "minicpm3", interleave=False)
    theta, scaling = _rope(hf)
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


def _deepseek_config(hf: dict, kind: str) -> ModelConfig:
    mla = _mla_from_hf(hf, kind, interleave=kind == "deepseek_v2" or hf.get("rope_interleave", True))
    theta, scaling = _rope(hf)
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    dense = hf.get("first_k_dense_replace", 3 if kind == "deepseek_v3" else 0)
    moe_layers = tuple(range(min(dense, layers), layers)) if hf.get("n_routed_experts") else ()
    moe = _deepseek_moe(hf, kind) if moe_layers else None
    return ModelConfig(
        family=kind, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=layers,
        num_attention_heads=heads, ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048), norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        rotary_base=theta, rope_scaling=scaling, attention_output_bias=bool(hf.get("attention_bias")),
        qk_layernorm=True, mla=mla, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        moe=moe, moe_layers=moe_layers or None)


def _glm_config(hf: dict) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {hf.get('hidden_act')!r} is not supported for glm4_moe (silu only)")
    theta, scaling = _rope(hf)
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    dense = hf.get("first_k_dense_replace", 1)
    moe_layers = tuple(range(min(dense, layers), layers)) if hf.get("n_routed_experts") else ()
    return ModelConfig(
        family="glm4_moe", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=layers,
        num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048), norm_epsilon=hf.get("rms_norm_eps", 1e-5),
        rotary_base=theta, rope_scaling=scaling, add_qkv_bias=bool(hf.get("attention_bias")),
        qk_layernorm=bool(hf.get("use_qk_norm")), rotary_percent=float(_partial_rotary(hf, default=0.5)),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        moe=_deepseek_moe(hf, "glm4_moe") if moe_layers else None, moe_layers=moe_layers or None)


# the sigmoid gain of transformers' GPT-OSS experts, which our quick_geglu has built in
_QUICK_GELU_ALPHA = 1.702


def _gpt_oss_config(hf: dict) -> ModelConfig:
    alpha = hf.get("swiglu_alpha", _QUICK_GELU_ALPHA)
    if alpha != _QUICK_GELU_ALPHA:
        raise CheckpointError(f"config.json: swiglu_alpha {alpha!r} is not supported for gpt_oss (1.702 only, "
                              f"megatron-core's quick GELU)")
    theta, scaling = _rope(hf)
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = hf.get("sliding_window") if sliding else None
    topk = hf["num_experts_per_tok"]
    # transformers' aux loss counts all k choices: k times Megatron's (see _moe_from_hf)
    aux = hf.get("router_aux_loss_coef", 0.0) * topk if hf.get("output_router_logits") else 0.0
    bias = bool(hf.get("attention_bias", True))
    return ModelConfig(
        family="gpt_oss", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=layers,
        num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 131072), norm_epsilon=hf.get("rms_norm_eps", 1e-5),
        rotary_base=theta, rope_scaling=scaling, add_qkv_bias=bias, attention_output_bias=bias,
        add_bias_linear=True, activation="quick_geglu", glu_linear_offset=1.0,
        activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)), attention_sinks=True,
        sliding_window=window, sliding_window_layers=sliding if window else None,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        moe=MoEConfig(num_experts=hf["num_local_experts"], topk=topk, ffn_hidden_size=hf["intermediate_size"],
                      norm_topk_prob=True, aux_loss_coeff=aux))


def _gpt_oss_hf_config(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    if (moe is None or cfg.moe_layers is not None or not cfg.attention_sinks or cfg.activation != "quick_geglu"
            or cfg.glu_linear_offset != 1.0 or cfg.activation_func_clamp_value is None or not cfg.add_bias_linear
            or cfg.add_qkv_bias != cfg.attention_output_bias or cfg.qk_layernorm or cfg.mla is not None
            or cfg.rotary_percent != 1.0 or moe.score_function != "softmax" or not moe.norm_topk_prob
            or moe.num_groups or moe.scaling_factor != 1.0 or moe.enable_expert_bias or moe.shared_expert_size
            or moe.capacity_factor is not None or (moe.ffn_hidden_size or cfg.ffn_hidden_size) != cfg.ffn_hidden_size):
        raise CheckpointError("gpt_oss is attention with sinks and one bias switch, and in every layer an MoE MLP of "
                              "biased quick-GEGLU experts (offset 1, clamped) routed by softmax top-k: this model "
                              "differs, and cannot be written as a gpt_oss folder")
    every = range(cfg.num_layers)
    sliding = every if cfg.sliding_window_layers is None else cfg.sliding_window_layers
    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    rope.update(cfg.rope_scaling or {})
    return {"model_type": "gpt_oss", "architectures": [_ARCHITECTURES["gpt_oss"]], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels,
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon,
            "rope_theta": cfg.rotary_base, "rope_parameters": rope, "attention_bias": cfg.add_qkv_bias,
            "sliding_window": cfg.sliding_window, "layer_types": [
                "sliding_attention" if cfg.sliding_window and i in sliding else "full_attention" for i in every],
            "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
            "swiglu_alpha": _QUICK_GELU_ALPHA, "swiglu_limit": cfg.activation_func_clamp_value,
            "output_router_logits": moe.aux_loss_coeff > 0, "router_aux_loss_coef": moe.aux_loss_coeff / moe.topk,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights, "hidden_act": "silu"}


def _deepseek_moe(hf: dict, kind: str) -> MoEConfig:
    """DeepSeek-V2's softmax top-k (greedy), or DeepSeek-V3's (and GLM-4.5's) sigmoid scores
    steered by each router's e_score_correction_bias (our expert bias: aux-loss-free
    balancing) with top-k among the best groups (a group scored by its two best experts)."""
    groups, topk_group = hf.get("n_group"), hf.get("topk_group")
    if kind == "deepseek_v2":
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy") or (method == "group_limited_greedy" and groups != 1):
            raise CheckpointError(f"config.json: topk_method {method!r} with {groups} groups is not supported for "
                                  f"deepseek_v2 (greedy top-k only: its groups score by their best expert)")
        groups = topk_group = None
    else:
        if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise CheckpointError(f"config.json: topk_method {hf.get('topk_method')!r} with scoring_func "
                                  f"{hf.get('scoring_func')!r} is not supported for {kind} (noaux_tc, sigmoid)")
        if groups and hf["n_routed_experts"] % groups:
            raise CheckpointError(f"config.json: {hf['n_routed_experts']} routed experts do not split into "
                                  f"n_group {groups} groups")
        groups, topk_group = (groups, topk_group) if groups and groups > 1 else (None, None)
    shared = hf.get("n_shared_experts") or 0
    v3 = kind != "deepseek_v2"
    return MoEConfig(num_experts=hf["n_routed_experts"], topk=hf["num_experts_per_tok"],
                     ffn_hidden_size=hf["moe_intermediate_size"], score_function="sigmoid" if v3 else "softmax",
                     norm_topk_prob=bool(hf.get("norm_topk_prob", v3)), num_groups=groups, group_topk=topk_group,
                     scaling_factor=float(hf.get("routed_scaling_factor", 1.0)), enable_expert_bias=v3,
                     shared_expert_size=hf["moe_intermediate_size"] * shared if shared else None)


def _glm_hf_config(cfg: ModelConfig, out: dict) -> None:
    if cfg.attention_output_bias or cfg.add_bias_linear or cfg.mla is not None:
        raise CheckpointError("glm4_moe has grouped-query attention with biases on q, k and v only (attention_bias): "
                              "this model has another attention or other biases")
    out.update(attention_bias=cfg.add_qkv_bias, use_qk_norm=cfg.qk_layernorm, first_k_dense_replace=cfg.num_layers,
               num_nextn_predict_layers=cfg.mtp_num_layers)
    _shared_experts_hf_config(cfg, out)


def _minicpm3_hf_config(cfg: ModelConfig, out: dict) -> None:
    mla = cfg.mla
    if mla is None or mla.rope_interleave or not cfg.qk_layernorm or cfg.add_qkv_bias or cfg.add_bias_linear:
        raise CheckpointError("minicpm3 has multi-latent attention (rotated in halves) with its latents' norms, and "
                              "no q/k/v or MLP biases: this model lacks one of them or has more")
    del out["head_dim"]
    out.update(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
               qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
               num_key_value_heads=cfg.num_attention_heads, attention_bias=cfg.attention_output_bias,
               scale_emb=cfg.scale_emb if cfg.scale_emb is not None else 1.0, scale_depth=cfg.scale_depth,
               dim_model_base=None if cfg.dim_model_base is None else int(cfg.dim_model_base))  # an int there
    if cfg.dim_model_base is not None and cfg.dim_model_base != int(cfg.dim_model_base):
        raise CheckpointError(f"minicpm3's dim_model_base is a whole number, this model's is {cfg.dim_model_base}")


def _deepseek_hf_config(cfg: ModelConfig, out: dict) -> None:
    mla = cfg.mla
    if mla is None or not cfg.qk_layernorm or cfg.add_qkv_bias or cfg.add_bias_linear:
        raise CheckpointError(f"{cfg.family} has multi-latent attention with its latents' norms, and no q/k/v or "
                              f"MLP biases: this model lacks one of them or has more")
    if cfg.family == "deepseek_v2" and not mla.rope_interleave:
        raise CheckpointError("deepseek_v2 stores its rotated features interleaved; this model does not")
    for key in ("num_key_value_heads", "head_dim"):
        del out[key]
    out.update(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
               qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
               attention_bias=cfg.attention_output_bias, first_k_dense_replace=cfg.num_layers)
    if cfg.family == "deepseek_v3":
        out.update(rope_interleave=mla.rope_interleave, num_nextn_predict_layers=cfg.mtp_num_layers)
    _shared_experts_hf_config(cfg, out)


def _shared_experts_hf_config(cfg: ModelConfig, out: dict) -> None:
    """DeepSeek's and GLM-4.5's MoE fields: dense layers first, then routed and shared experts."""
    moe = cfg.moe
    if moe is None:
        return
    dense = min(cfg.moe_layers or (0,))
    v3 = cfg.family != "deepseek_v2"
    if cfg.moe_layers not in (None, tuple(range(dense, cfg.num_layers))):
        raise CheckpointError(f"{cfg.family} has dense layers first, then an MoE MLP in every layer")
    router = ((moe.score_function, bool(moe.enable_expert_bias)) == (("sigmoid", True) if v3 else ("softmax", False))
              and (v3 or not moe.num_groups))
    if (not router or moe.shared_expert_gate or moe.capacity_factor is not None
            or (moe.shared_expert_size or 0) % (moe.ffn_hidden_size or 1)):
        raise CheckpointError(f"{cfg.family} routes by " + ("sigmoid scores with an expert bias (aux-loss-free)"
                              if v3 else "softmax top-k") + ", with shared experts a whole number of experts wide: "
                              "this model's router has no equivalent there")
    expert = moe.ffn_hidden_size or cfg.ffn_hidden_size
    out.update(first_k_dense_replace=dense, n_routed_experts=moe.num_experts, num_experts_per_tok=moe.topk,
               moe_intermediate_size=expert, n_shared_experts=(moe.shared_expert_size or 0) // expert,
               norm_topk_prob=moe.norm_topk_prob, routed_scaling_factor=moe.scaling_factor,
               topk_method="noaux_tc" if v3 else "greedy", n_group=moe.num_groups or 1, topk_group=moe.group_topk or 1)
    if cfg.family == "deepseek_v3":
        out["scoring_func"] = "sigmoid"
    if cfg.family in GLM:  # its router has no method or scoring keys
        del out["topk_method"]


def _gemma3_rope(hf: dict) -> tuple[float, dict | None, float]:
    """Gemma 3's two RoPEs: (global base, global scaling, local base). transformers 5 keeps them
    per layer type in rope_parameters; older configs as rope_theta, rope_scaling and
    rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise CheckpointError(f"config.json: rope_parameters.sliding_attention.rope_type {local['rope_type']!r} "
                                  f"is not supported (default only)")
        theta, scaling = _rope({**hf, "rope_parameters": params.get("full_attention") or {}, "rope_scaling": None})
        return theta, scaling, float(local.get("rope_theta", 10000.0))
    theta, scaling = _rope({"rope_theta": 1000000.0, **hf})
    return theta, scaling, float(hf.get("rope_local_base_freq", 10000.0))


def _gemma_config(hf: dict, kind: str) -> ModelConfig:
    """Gemma 2 (gemma2) and Gemma 3's text model (gemma3_text -> our gemma3)."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GATED_ACTS:
        raise CheckpointError(f"config.json: hidden_activation {act!r} is not supported for {kind} "
                              f"({', '.join(_GATED_ACTS)})")
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError("config.json: use_bidirectional_attention (an encoder's attention) is not supported")
    _refuse_unsupported(hf, kind)
    gemma3 = kind == "gemma3_text"
    if gemma3:
        theta, scaling, local = _gemma3_rope(hf)
    else:
        (theta, scaling), local = _rope(hf), None
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    every = hf.get("sliding_window_pattern", 6) if gemma3 else 2  # each every-th layer attends globally
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                      for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise CheckpointError(f"config.json: layer_types must name sliding_attention or full_attention for each of "
                              f"the {layers} layers")
    window = hf.get("sliding_window", 4096)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    bias = bool(hf.get("attention_bias"))
    return ModelConfig(
        family="gemma3" if gemma3 else "gemma2", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=layers, num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 131072 if gemma3 else 8192),
        norm_epsilon=hf.get("rms_norm_eps", 1e-6), activation=_GATED_ACTS[act], rotary_base=theta,
        rope_scaling=scaling, add_qkv_bias=bias, attention_output_bias=bias, qk_layernorm=gemma3, norm_offset=True,
        post_norm=True, scale_embeddings=True, query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        attn_logit_softcapping=hf.get("attn_logit_softcapping", None if gemma3 else 50.0),
        final_logit_softcapping=hf.get("final_logit_softcapping", None if gemma3 else 30.0),
        sliding_window=window if window and sliding else None,
        sliding_window_layers=sliding if window and sliding else None,
        local_rotary_base=local if window and sliding else None,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True))


# what ModelConfig fields beyond the LLaMA decoder only the gemma2 layout can express
_GEMMA_FIELDS = ("norm_offset", "post_norm", "scale_embeddings", "query_pre_attn_scalar", "attn_logit_softcapping",
                 "final_logit_softcapping", "sliding_window", "local_rotary_base")
GEMMA = ("gemma2", "gemma3")
# and those only minicpm3's can
_MINICPM_FIELDS = ("scale_emb", "scale_depth", "dim_model_base")


def _gemma_hf_config(cfg: ModelConfig, out: dict) -> None:
    if not (cfg.norm_offset and cfg.post_norm and cfg.scale_embeddings) or cfg.activation not in ("geglu", "geglu_tanh"):
        raise CheckpointError(f"{cfg.family} has RMSNorm weights as offsets from one, post norms, scaled embeddings "
                              f"and a GeGLU MLP: this model lacks one of them")
    gemma3 = cfg.family == "gemma3"
    if cfg.add_qkv_bias != cfg.attention_output_bias or cfg.add_bias_linear or cfg.qk_layernorm != gemma3:
        raise CheckpointError(f"{cfg.family} has one attention_bias for q, k, v and o, no MLP bias and "
                              f"{'q/k norms' if gemma3 else 'no q/k norms'}")
    del out["hidden_act"]
    if gemma3:  # its two RoPEs per layer type; the sliding layers' unscaled
        local = cfg.local_rotary_base if cfg.local_rotary_base is not None else cfg.rotary_base
        if cfg.sliding_window is not None and cfg.local_rotary_base is None and cfg.rope_scaling:
            raise CheckpointError("gemma3 scales only its global layers' RoPE: this model scales every layer's")
        out.update(model_type="gemma3_text", rope_parameters={
            "full_attention": out["rope_parameters"], "sliding_attention": {"rope_type": "default", "rope_theta": local}})
        del out["rope_theta"]
    every = list(range(cfg.num_layers))
    sliding = every if cfg.sliding_window_layers is None else cfg.sliding_window_layers
    out.update(hidden_activation="gelu_pytorch_tanh" if cfg.activation == "geglu_tanh" else "gelu",
               attention_bias=cfg.add_qkv_bias, query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.kv_channels,
               attn_logit_softcapping=cfg.attn_logit_softcapping,
               final_logit_softcapping=cfg.final_logit_softcapping,
               sliding_window=cfg.sliding_window, layer_types=[
                   "sliding_attention" if cfg.sliding_window and i in sliding else "full_attention" for i in every])


def _moe_from_hf(hf: dict, kind: str) -> tuple[MoEConfig, tuple | None]:
    if hf.get("router_jitter_noise"):
        raise CheckpointError(f"config.json: router_jitter_noise {hf['router_jitter_noise']!r} is not supported "
                              f"(set it to 0)")
    topk = hf["num_experts_per_tok"]
    # Mixtral's num_local_experts, Qwen's num_experts (transformers 5 writes either for both)
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if experts is None:
        raise CheckpointError("config.json has no 'num_experts' (or 'num_local_experts')")
    # transformers' aux loss is E * sum_e f_e P_e with f_e counting all k choices: k times
    # Megatron's, whose coefficient ours is; it is only added with output_router_logits
    aux = hf.get("router_aux_loss_coef", 0.0) * topk if hf.get("output_router_logits") else 0.0
    if kind == "mixtral":
        return MoEConfig(num_experts=experts, topk=topk, ffn_hidden_size=hf["intermediate_size"],
                         norm_topk_prob=True, aux_loss_coeff=aux), None
    shared = hf.get("shared_expert_intermediate_size") if kind == "qwen2_moe" else None
    if kind == "qwen2_moe" and not shared:
        raise CheckpointError("config.json: qwen2_moe needs a positive shared_expert_intermediate_size")
    moe = MoEConfig(num_experts=experts, topk=topk, ffn_hidden_size=hf["moe_intermediate_size"],
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)), aux_loss_coeff=aux,
                    shared_expert_size=shared, shared_expert_gate=kind == "qwen2_moe")
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return moe, None if len(layers) == hf["num_hidden_layers"] else layers


def hf_config(cfg: ModelConfig) -> dict:
    if cfg.moe is not None and cfg.family not in (*MOE_BASE, *SHARED_EXPERTS, *GPT_OSS):
        raise CheckpointError(f"a {cfg.family} model with MoE layers has no Hugging Face architecture: export MoE "
                              f"models as {', '.join(MOE_BASE)} (their attention is mistral's, qwen2's, qwen3's)")
    out = _decoder_hf_config(cfg)
    if cfg.reward_head:  # transformers' sequence classifier with one label: the reward
        out["architectures"] = [out["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
                                .replace("LMHeadModel", "ForSequenceClassification")]
        out["num_labels"] = 1
    return out


def _decoder_hf_config(cfg: ModelConfig) -> dict:
    if cfg.family == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.vocab_size,
                "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_attention_heads,
                "n_inner": cfg.ffn_hidden_size, "n_positions": cfg.max_position_embeddings,
                "layer_norm_epsilon": cfg.norm_epsilon,
                "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
                "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    if cfg.family in GPT_OSS:
        return _gpt_oss_hf_config(cfg)
    if cfg.attention_sinks or cfg.glu_linear_offset or cfg.activation_func_clamp_value is not None:
        raise CheckpointError(f"{cfg.family} has no attention sinks or clamped experts in transformers (gpt_oss "
                              f"has): this model cannot be written as a {cfg.family} folder")
    arch = _ARCHITECTURES[cfg.family]
    base = MOE_BASE.get(cfg.family, cfg.family)
    windowed = base in ("mistral", "phi3", "qwen2", "qwen3")  # families whose transformers model has sliding windows
    foreign = [f for f in _GEMMA_FIELDS if getattr(cfg, f) and not (windowed and f == "sliding_window")]
    foreign += ["activation"] if cfg.activation != "swiglu" else []
    if cfg.rotary_percent != 1.0 and cfg.family not in ("phi3", *GLM):
        foreign.append("partial_rotary_factor")
    minicpm = [f for f in _MINICPM_FIELDS if getattr(cfg, f) is not None]
    if (cfg.family not in GEMMA and foreign) or (cfg.family not in MINICPM and minicpm):
        raise CheckpointError(f"{cfg.family} has no {(foreign or minicpm)[0]} setting in transformers: this model "
                              f"cannot be written as a {cfg.family} folder")
    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling:
        rope.update(cfg.rope_scaling)
    if cfg.rotary_percent != 1.0:
        rope["partial_rotary_factor"] = cfg.rotary_percent
    out = {"model_type": cfg.family, "architectures": [arch], "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels,
           "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon,
           "hidden_act": "silu", "rope_theta": cfg.rotary_base, "rope_parameters": rope,
           "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights}
    if base in ("llama", "qwen3", *GEMMA):
        if cfg.add_qkv_bias != cfg.attention_output_bias:
            raise CheckpointError(f"{cfg.family} has one attention_bias for q, k, v and o: this model has "
                                  f"q/k/v biases {cfg.add_qkv_bias} but an output bias {cfg.attention_output_bias}")
        out["attention_bias"] = cfg.add_qkv_bias
    if cfg.family == "llama":
        out["mlp_bias"] = cfg.add_bias_linear
    every = list(range(cfg.num_layers))
    if base in ("mistral", "phi3"):
        if cfg.sliding_window_layers not in (None, tuple(every)):
            raise CheckpointError(f"{cfg.family} slides its window in every layer or none: this model slides it in "
                                  f"layers {list(cfg.sliding_window_layers)}")
        out["sliding_window"] = cfg.sliding_window
    if base in ("qwen2", "qwen3"):
        sliding = every if cfg.sliding_window_layers is None else cfg.sliding_window_layers
        out.update(sliding_window=cfg.sliding_window, use_sliding_window=cfg.sliding_window is not None,
                   max_window_layers=min(sliding, default=cfg.num_layers), layer_types=[
                       "sliding_attention" if cfg.sliding_window and i in sliding else "full_attention" for i in every])
    if cfg.family == "phi3":
        if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size or cfg.add_qkv_bias or cfg.add_bias_linear:
            raise CheckpointError("phi3 has heads of hidden_size / num_attention_heads and no biases")
        if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") != "longrope":
            raise CheckpointError(f"phi3's RoPE scaling is longrope only, not {cfg.rope_scaling.get('rope_type')}")
        del out["head_dim"]
        # transformers' defaults name token 32000 as padding and end, which a smaller vocabulary lacks
        out.update(pad_token_id=None, bos_token_id=None, eos_token_id=None,
                   original_max_position_embeddings=(cfg.rope_scaling or {}).get(
                       "original_max_position_embeddings", cfg.max_position_embeddings))
    if cfg.family in GEMMA:
        _gemma_hf_config(cfg, out)
    if cfg.family in DEEPSEEK:
        _deepseek_hf_config(cfg, out)
    elif cfg.family in MINICPM:
        _minicpm3_hf_config(cfg, out)
    elif cfg.family in GLM:
        _glm_hf_config(cfg, out)
    elif cfg.mla is not None:
        raise CheckpointError(f"{cfg.family} has no multi-latent attention: export it as deepseek_v2 or deepseek_v3")
    if cfg.family in MOE_BASE:
        out.update(_moe_to_hf(cfg))
    return out


def _moe_to_hf(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    if moe is None:
        raise CheckpointError(f"a {cfg.family} model needs its mixture-of-experts settings")
    topk = moe.topk
    # what transformers' MoE blocks compute: softmax scores, no groups, bias, scaling or capacity
    if (moe.score_function != "softmax" or moe.num_groups or moe.scaling_factor != 1.0 or moe.enable_expert_bias
            or moe.capacity_factor is not None):
        raise CheckpointError(f"{cfg.family} routes by softmax top-k only: this model's router (score function "
                              f"{moe.score_function}, groups {moe.num_groups}, scaling {moe.scaling_factor}, expert "
                              f"bias {moe.enable_expert_bias}, capacity {moe.capacity_factor}) has no equivalent there")
    out = {"num_experts_per_tok": topk, "output_router_logits": moe.aux_loss_coeff > 0,
           "router_aux_loss_coef": moe.aux_loss_coeff / topk}
    expert = moe.ffn_hidden_size or cfg.ffn_hidden_size
    if cfg.family == "mixtral":
        if cfg.moe_layers is not None or not moe.norm_topk_prob or moe.shared_expert_size:
            raise CheckpointError("mixtral has an MoE MLP in every layer, renormalised top-k weights and no shared "
                                  "expert")
        out.update(num_local_experts=moe.num_experts, intermediate_size=expert)
        return out
    if (cfg.family == "qwen2_moe") != bool(moe.shared_expert_size and moe.shared_expert_gate):
        raise CheckpointError(f"{cfg.family}: " + ("qwen2_moe needs a gated shared expert" if cfg.family == "qwen2_moe"
                                                   else "qwen3_moe has no shared expert"))
    out.update(num_experts=moe.num_experts, moe_intermediate_size=expert, norm_topk_prob=moe.norm_topk_prob,
               decoder_sparse_step=1,
               mlp_only_layers=[i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)])
    if cfg.family == "qwen2_moe":
        out.update(shared_expert_intermediate_size=moe.shared_expert_size, qkv_bias=cfg.add_qkv_bias)
    return out


# ---- weights ---------------------------------------------------------------------------------

def _fuse_qkv(cfg: ModelConfig, q, k, v):
    """Per query group: its query heads, its key head, its value head (mcore layout)."""
    g, d = cfg.num_query_groups, cfg.kv_channels
    per = cfg.num_attention_heads // g
    tail = q.shape[1:]
    parts = [q.reshape((g, per, d) + tail), k.reshape((g, 1, d) + tail), v.reshape((g, 1, d) + tail)]
    return np.concatenate(parts, axis=1).reshape((-1,) + tail)


def split_qkv(cfg: ModelConfig, qkv):
    g, d = cfg.num_query_groups, cfg.kv_channels
    per = cfg.num_attention_heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape((g, per + 2, d) + tail)
    q = grouped[:, :per].reshape((-1,) + tail)
    return q, grouped[:, per].reshape((-1,) + tail), grouped[:, per + 1].reshape((-1,) + tail)


def _phi3_qkv(cfg: ModelConfig, qkv):
    """Phi-3's fused qkv_proj: the query heads' rows, then the key heads', then the value heads'."""
    q_rows, kv_rows = cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
    if qkv.shape[0] != q_rows + 2 * kv_rows:
        raise CheckpointError(f"qkv_proj has {qkv.shape[0]} rows; the config gives {q_rows} + 2 x {kv_rows}")
    return qkv[:q_rows], qkv[q_rows:q_rows + kv_rows], qkv[q_rows + kv_rows:]


def _layer_names_llama(i):
    a, b = f"model.layers.{i}.", f"decoder.layers.{i}."
    return {a + "input_layernorm.weight": b + "input_layernorm.weight",
            a + "post_attention_layernorm.weight": b + "pre_mlp_layernorm.weight",
            a + "self_attn.o_proj.weight": b + "self_attention.linear_proj.weight",
            a + "self_attn.o_proj.bias": b + "self_attention.linear_proj.bias",
            a + "self_attn.q_norm.weight": b + "self_attention.q_layernorm.weight",
            a + "self_attn.k_norm.weight": b + "self_attention.k_layernorm.weight",
            a + "mlp.down_proj.weight": b + "mlp.linear_fc2.weight",
            a + "mlp.down_proj.bias": b + "mlp.linear_fc2.bias"}


def _layer_names(cfg: ModelConfig, i):
    """Hugging Face -> our names of layer i's tensors besides q/k/v and the MLP's fc1."""
    names = _layer_names_llama(i)
    if cfg.mla is not None:  # its q_layernorm is the query latent's (_mla_names)
        names = {k: v for k, v in names.items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    if cfg.family in GEMMA:  # its post_attention_layernorm is the norm after attention, not before the MLP
        a, b = f"model.layers.{i}.", f"decoder.layers.{i}."
        names.update({a + "post_attention_layernorm.weight": b + "post_attn_norm.weight",
                      a + "pre_feedforward_layernorm.weight": b + "pre_mlp_layernorm.weight",
                      a + "post_feedforward_layernorm.weight": b + "post_mlp_layernorm.weight"})
    return names


def _mla_names(cfg: ModelConfig, i: int) -> dict:
    """Hugging Face -> our names of layer i's multi-latent attention tensors (o_proj aside)."""
    a, b, mla = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention.", cfg.mla
    pairs = [("q_proj", "linear_q_proj", False)] if mla.q_lora_rank is None else [
        ("q_a_proj", "linear_q_down_proj", cfg.attention_output_bias), ("q_b_proj", "linear_q_up_proj", False)]
    pairs += [("kv_a_proj_with_mqa", "linear_kv_down_proj", cfg.attention_output_bias),
              ("kv_b_proj", "linear_kv_up_proj", False)]
    if cfg.qk_layernorm:
        pairs += [("kv_a_layernorm", "kv_layernorm", False)]
        pairs += [("q_a_layernorm", "q_layernorm", False)] if mla.q_lora_rank is not None else []
    names = {}
    for theirs, ours, bias in pairs:
        for kind in ("weight", "bias") if bias else ("weight",):
            names[f"{a}{theirs}.{kind}"] = f"{b}{ours}.{kind}"
    return names


def _moe_names(cfg: ModelConfig, i: int) -> tuple[str, tuple]:
    """(MoE block prefix, (gate, up, down) names of an expert's projections); the router is
    the block's gate.weight in every family."""
    if cfg.family == "mixtral":
        return f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")
    return f"model.layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj")


def _moe_from_hf_state(cfg: ModelConfig, i: int, take) -> dict:
    """Layer i's router, experts (stacked: [E, h, 2f] gate then up columns, [E, f, h]) and
    shared expert, from the experts written one by one."""
    a, (g, u, d) = _moe_names(cfg, i)
    b = f"decoder.layers.{i}.mlp."
    out = {b + "router.weight": take(a + "gate.weight")}
    if cfg.moe.enable_expert_bias:  # DeepSeek-V3's and GLM-4.5's steering of the choice
        if cfg.family == "deepseek_v3":
            features.note_used("hf-deepseek-v3-moe")
        out[b + "router.expert_bias"] = take(a + "gate.e_score_correction_bias").astype(np.float32)
    w1, w2 = [], []
    for e in range(cfg.moe.num_experts):
        gate, up = take(f"{a}experts.{e}.{g}.weight"), take(f"{a}experts.{e}.{u}.weight")
        w1.append(np.concatenate([gate, up]).T)
        w2.append(take(f"{a}experts.{e}.{d}.weight").T)
    out[b + "experts.weight1"], out[b + "experts.weight2"] = np.stack(w1), np.stack(w2)
    if cfg.moe.shared_expert_size:
        s = a + ("shared_experts." if cfg.family in SHARED_EXPERTS else "shared_expert.")
        out[b + "shared_experts.linear_fc1.weight"] = np.concatenate([take(s + "gate_proj.weight"),
                                                                      take(s + "up_proj.weight")])
        out[b + "shared_experts.linear_fc2.weight"] = take(s + "down_proj.weight")
        if cfg.moe.shared_expert_gate:
            out[b + "shared_experts.gate_weight"] = take(a + "shared_expert_gate.weight")
    return out


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


def _gpt_oss_experts_from_hf(cfg: ModelConfig, i: int, hf: dict, take) -> dict:
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


def _interleave(gate_then_up: np.ndarray) -> np.ndarray:
    """[..., 2f] gate columns then up columns -> GPT-OSS's alternating gate, up, gate, ..."""
    gate, up = np.split(gate_then_up, 2, axis=-1)
    return np.ascontiguousarray(np.stack([gate, up], axis=-1).reshape(gate_then_up.shape))


def _gpt_oss_experts_to_hf(i: int, ours: dict) -> dict:
    features.note_used("hf-gpt-oss")
    a, b = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
    return {a + "router.weight": ours[b + "router.weight"], a + "router.bias": ours[b + "router.bias"],
            a + "experts.gate_up_proj": _interleave(ours[b + "experts.weight1"]),
            a + "experts.gate_up_proj_bias": _interleave(ours[b + "experts.bias1"]),
            a + "experts.down_proj": ours[b + "experts.weight2"], a + "experts.down_proj_bias": ours[b + "experts.bias2"]}


def _moe_to_hf_state(cfg: ModelConfig, i: int, ours: dict) -> dict:
    a, (g, u, d) = _moe_names(cfg, i)
    b = f"decoder.layers.{i}.mlp."
    out = {a + "gate.weight": ours[b + "router.weight"]}
    if cfg.moe.enable_expert_bias:
        if cfg.family == "deepseek_v3":
            features.note_used("hf-deepseek-v3-moe")
        out[a + "gate.e_score_correction_bias"] = ours[b + "router.expert_bias"]
    for e in range(cfg.moe.num_experts):
        gate, up = np.split(ours[b + "experts.weight1"][e].T, 2)
        out[f"{a}experts.{e}.{g}.weight"] = np.ascontiguousarray(gate)
        out[f"{a}experts.{e}.{u}.weight"] = np.ascontiguousarray(up)
        out[f"{a}experts.{e}.{d}.weight"] = np.ascontiguousarray(ours[b + "experts.weight2"][e].T)
    if cfg.moe.shared_expert_size:
        s = a + ("shared_experts." if cfg.family in SHARED_EXPERTS else "shared_expert.")
        out[s + "gate_proj.weight"], out[s + "up_proj.weight"] = np.split(ours[b + "shared_experts.linear_fc1.weight"],
                                                                          2)
        out[s + "down_proj.weight"] = ours[b + "shared_experts.linear_fc2.weight"]
        if cfg.moe.shared_expert_gate:
            out[a + "shared_expert_gate.weight"] = ours[b + "shared_experts.gate_weight"]
    return out


# buffers some Hugging Face checkpoints carry that are no weights of the model
_NOT_WEIGHTS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def from_hf_state(cfg: ModelConfig, hf: dict) -> dict:
    """Hugging Face names/layouts -> ours. Raises CheckpointError for missing tensors, and for
    tensors its config.json does not describe (a layer count edited down would drop weights)."""
    return _from_hf_state(cfg, dict(hf))


def _from_hf_state(cfg: ModelConfig, hf: dict) -> dict:
    out = {}
    left = hf  # what take() has not consumed, checked at the end

    def take(name):
        try:
            return hf.pop(name)
        except KeyError:
            raise CheckpointError(f"the Hugging Face checkpoint has no tensor {name!r}") from None

    if cfg.family == "gpt2":
        p = "transformer." if any(k.startswith("transformer.") for k in hf) else ""
        out["embedding.word_embeddings.weight"] = take(p + "wte.weight")
        out["embedding.position_embeddings.weight"] = take(p + "wpe.weight")
        for i in range(cfg.num_layers):
            a, b = f"{p}h.{i}.", f"decoder.layers.{i}."
            for hf_n, ours in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                out[b + ours + ".weight"], out[b + ours + ".bias"] = take(a + hf_n + ".weight"), take(a + hf_n + ".bias")
            w, bias = take(a + "attn.c_attn.weight").T, take(a + "attn.c_attn.bias")
            out[b + "self_attention.linear_qkv.weight"] = _fuse_qkv(cfg, *np.split(w, 3, axis=0))
            out[b + "self_attention.linear_qkv.bias"] = _fuse_qkv(cfg, *np.split(bias, 3, axis=0))
            for hf_n, ours in (("attn.c_proj", "self_attention.linear_proj"), ("mlp.c_fc", "mlp.linear_fc1"),
                               ("mlp.c_proj", "mlp.linear_fc2")):
                out[b + ours + ".weight"] = take(a + hf_n + ".weight").T  # GPT-2's Conv1D stores [in, out]
                out[b + ours + ".bias"] = take(a + hf_n + ".bias")
        out["decoder.final_layernorm.weight"], out["decoder.final_layernorm.bias"] = take(p + "ln_f.weight"), take(p + "ln_f.bias")
        _head_from_hf(cfg, out, take)
        return _all_taken(cfg, out, left)
    out["embedding.word_embeddings.weight"] = take("model.embed_tokens.weight")
    for i in range(cfg.num_layers):
        _layer_from_hf(cfg, i, hf, take, out)
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    _head_from_hf(cfg, out, take)
    _mtp_from_hf(cfg, hf, take, out)
    return _all_taken(cfg, out, left)


def _layer_from_hf(cfg: ModelConfig, i: int, hf: dict, take, out: dict) -> None:
    """Hugging Face layer ``i`` into ``out`` as decoder.layers.<i>."""
    a, b = f"model.layers.{i}.", f"decoder.layers.{i}.self_attention.linear_qkv."
    if cfg.family == "phi3":  # fused: all query rows, then the keys', then the values'; gate then up
        out[b + "weight"] = _fuse_qkv(cfg, *_phi3_qkv(cfg, take(a + "self_attn.qkv_proj.weight")))
        out[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = take(a + "mlp.gate_up_proj.weight")
        for hf_n, ours in _layer_names(cfg, i).items():
            if hf_n in hf:
                out[ours] = take(hf_n)
        return
    if cfg.mla is not None:
        out.update((ours, take(theirs)) for theirs, ours in _mla_names(cfg, i).items())
    else:
        out[b + "weight"] = _fuse_qkv(cfg, *(take(a + f"self_attn.{x}_proj.weight") for x in "qkv"))
    if cfg.add_qkv_bias:
        out[b + "bias"] = _fuse_qkv(cfg, *(take(a + f"self_attn.{x}_proj.bias") for x in "qkv"))
    if cfg.attention_sinks:
        out[f"decoder.layers.{i}.self_attention.core_attention.softmax_offset"] = take(a + "self_attn.sinks")
    if cfg.family in GPT_OSS:
        out.update(_gpt_oss_experts_from_hf(cfg, i, hf, take))
    elif cfg.is_moe_layer(i):
        out.update(_moe_from_hf_state(cfg, i, take))
    else:
        gate, up = take(a + "mlp.gate_proj.weight"), take(a + "mlp.up_proj.weight")
        out[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = np.concatenate([gate, up])
        if cfg.add_bias_linear:
            out[f"decoder.layers.{i}.mlp.linear_fc1.bias"] = np.concatenate([take(a + "mlp.gate_proj.bias"),
                                                                             take(a + "mlp.up_proj.bias")])
    for hf_n, ours in _layer_names(cfg, i).items():
        if hf_n in hf:
            out[ours] = take(hf_n)


# a multi-token prediction module in a Hugging Face folder (DeepSeek-V3, GLM-4.5): layer
# num_hidden_layers + k holds a whole layer and these, by our names; it also saves copies of
# the embedding and the output layer, which are the model's own
_MTP_NAMES = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
_MTP_COPIES = {"embed_tokens.weight": "embedding.word_embeddings.weight", "shared_head.head.weight": "output_layer.weight"}


def _mtp_layer_names(cfg: ModelConfig, k: int) -> tuple[str, str, str]:
    """(Hugging Face prefix, our layer's prefix as numbered in the decoder, our module's prefix)."""
    n = cfg.num_layers + k
    return f"model.layers.{n}.", f"decoder.layers.{n}.", f"mtp.layers.{k}."


def _check_mtp_family(cfg: ModelConfig) -> None:
    if cfg.mtp_num_layers and cfg.family not in ("deepseek_v3",) + GLM:
        raise CheckpointError(f"{cfg.family} folders hold no multi-token prediction layers (deepseek_v3 and "
                              f"glm4_moe do): leave --mtp-num-layers out")


def _mtp_from_hf(cfg: ModelConfig, hf: dict, take, out: dict) -> None:
    _check_mtp_family(cfg)
    if cfg.mtp_num_layers:
        features.note_used("multi-token-prediction")
    for k in range(cfg.mtp_num_layers):
        theirs, as_layer, mine = _mtp_layer_names(cfg, k)
        if theirs + "eh_proj.weight" not in hf:
            raise CheckpointError(f"the Hugging Face checkpoint has no multi-token prediction layer {k} "
                                  f"({theirs}eh_proj.weight) for --mtp-num-layers {cfg.mtp_num_layers}")
        out.update((mine + name, take(theirs + name)) for name in _MTP_NAMES)
        out[f"mtp.final_layernorms.{k}.weight"] = take(theirs + "shared_head.norm.weight")
        for name, model_name in _MTP_COPIES.items():
            if theirs + name in hf:
                copy, own = take(theirs + name), out.get(model_name, out["embedding.word_embeddings.weight"])
                if not np.array_equal(copy, own):
                    raise CheckpointError(f"{theirs}{name} differs from the model's own {model_name}: a module with "
                                          f"an embedding or output layer of its own is not supported")
        layer = {}
        _layer_from_hf(cfg, cfg.num_layers + k, hf, take, layer)
        out.update((mine + "transformer_layer." + name[len(as_layer):], value) for name, value in layer.items())


def _all_taken(cfg: ModelConfig, out: dict, left: dict) -> dict:
    # a tied output layer may be saved beside the embedding it shares (a copy, not a weight)
    tied_copy = ("lm_head.weight",) if cfg.tied_output else ()
    # the multi-token prediction layers after the last one, which transformers does not read either
    mtp = tuple(f"model.layers.{cfg.num_layers + k}." for k in range(8)) if cfg.family in SHARED_EXPERTS else ()
    extra = sorted(k for k in left if not k.endswith(_NOT_WEIGHTS) and k not in tied_copy and not k.startswith(mtp))
    if extra:
        raise CheckpointError(f"the Hugging Face checkpoint holds {len(extra)} tensors its config.json does not "
                              f"describe ({extra[0]}, ...): the configuration does not belong to these weights")
    return out


def _head_from_hf(cfg: ModelConfig, out: dict, take) -> None:
    if cfg.reward_head:
        out["rm_head.weight"] = take("score.weight")
    elif cfg.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = take("lm_head.weight")


def _head_to_hf(cfg: ModelConfig, out: dict, ours: dict) -> None:
    if cfg.reward_head:
        out["score.weight"] = ours["rm_head.weight"]
    elif cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = ours["output_layer.weight"]


def to_hf_state(cfg: ModelConfig, ours: dict) -> dict:
    ours = dict(ours)
    out = {}
    if cfg.family == "gpt2":
        p = "transformer."
        out[p + "wte.weight"] = ours["embedding.word_embeddings.weight"]
        out[p + "wpe.weight"] = ours["embedding.position_embeddings.weight"]
        for i in range(cfg.num_layers):
            a, b = f"{p}h.{i}.", f"decoder.layers.{i}."
            for hf_n, mine in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                out[a + hf_n + ".weight"], out[a + hf_n + ".bias"] = ours[b + mine + ".weight"], ours[b + mine + ".bias"]
            q, k, v = split_qkv(cfg, ours[b + "self_attention.linear_qkv.weight"])
            out[a + "attn.c_attn.weight"] = np.ascontiguousarray(np.concatenate([q, k, v]).T)
            out[a + "attn.c_attn.bias"] = np.concatenate(split_qkv(cfg, ours[b + "self_attention.linear_qkv.bias"]))
            for hf_n, mine in (("attn.c_proj", "self_attention.linear_proj"), ("mlp.c_fc", "mlp.linear_fc1"),
                               ("mlp.c_proj", "mlp.linear_fc2")):
                out[a + hf_n + ".weight"] = np.ascontiguousarray(ours[b + mine + ".weight"].T)
                out[a + hf_n + ".bias"] = ours[b + mine + ".bias"]
        out[p + "ln_f.weight"], out[p + "ln_f.bias"] = ours["decoder.final_layernorm.weight"], ours["decoder.final_layernorm.bias"]
        _head_to_hf(cfg, out, ours)
        return out
    out["model.embed_tokens.weight"] = ours["embedding.word_embeddings.weight"]
    for i in range(cfg.num_layers):
        _layer_to_hf(cfg, i, ours, out)
    out["model.norm.weight"] = ours["decoder.final_layernorm.weight"]
    _head_to_hf(cfg, out, ours)
    _mtp_to_hf(cfg, ours, out)
    return out


def _layer_to_hf(cfg: ModelConfig, i: int, ours: dict, out: dict) -> None:
    """Our decoder.layers.<i> into ``out`` as Hugging Face layer ``i``."""
    a, b = f"model.layers.{i}.", f"decoder.layers.{i}.self_attention.linear_qkv."
    if cfg.family == "phi3":
        out[a + "self_attn.qkv_proj.weight"] = np.concatenate(split_qkv(cfg, ours[b + "weight"]))
        out[a + "mlp.gate_up_proj.weight"] = ours[f"decoder.layers.{i}.mlp.linear_fc1.weight"]
        for hf_n, mine in _layer_names(cfg, i).items():
            if mine in ours:
                out[hf_n] = ours[mine]
        return
    if cfg.mla is not None:
        out.update((theirs, ours[mine]) for theirs, mine in _mla_names(cfg, i).items())
    else:
        for x, t in zip("qkv", split_qkv(cfg, ours[b + "weight"])):
            out[a + f"self_attn.{x}_proj.weight"] = t
    if cfg.add_qkv_bias:
        for x, t in zip("qkv", split_qkv(cfg, ours[b + "bias"])):
            out[a + f"self_attn.{x}_proj.bias"] = t
    if cfg.attention_sinks:
        out[a + "self_attn.sinks"] = ours[f"decoder.layers.{i}.self_attention.core_attention.softmax_offset"]
    if cfg.family in GPT_OSS:
        out.update(_gpt_oss_experts_to_hf(i, ours))
    elif cfg.is_moe_layer(i):
        out.update(_moe_to_hf_state(cfg, i, ours))
    else:
        gate, up = np.split(ours[f"decoder.layers.{i}.mlp.linear_fc1.weight"], 2)
        out[a + "mlp.gate_proj.weight"], out[a + "mlp.up_proj.weight"] = gate, up
        if cfg.add_bias_linear:
            gate_b, up_b = np.split(ours[f"decoder.layers.{i}.mlp.linear_fc1.bias"], 2)
            out[a + "mlp.gate_proj.bias"], out[a + "mlp.up_proj.bias"] = gate_b, up_b
    for hf_n, mine in _layer_names(cfg, i).items():
        if mine in ours:
            out[hf_n] = ours[mine]


def _mtp_to_hf(cfg: ModelConfig, ours: dict, out: dict) -> None:
    """The multi-token prediction modules as layers num_hidden_layers + k, with the copies of
    the embedding and output layer DeepSeek-V3's folders carry."""
    _check_mtp_family(cfg)
    if cfg.mtp_num_layers:
        features.note_used("multi-token-prediction")
    for k in range(cfg.mtp_num_layers):
        theirs, as_layer, mine = _mtp_layer_names(cfg, k)
        out.update((theirs + name, ours[mine + name]) for name in _MTP_NAMES)
        out[theirs + "shared_head.norm.weight"] = ours[f"mtp.final_layernorms.{k}.weight"]
        for name, model_name in _MTP_COPIES.items():
            out[theirs + name] = ours.get(model_name, ours["embedding.word_embeddings.weight"])
        inner = mine + "transformer_layer."
        _layer_to_hf(cfg, cfg.num_layers + k,
                     {as_layer + n[len(inner):]: v for n, v in ours.items() if n.startswith(inner)}, out)


# ---- folders ---------------------------------------------------------------------------------

def _read_tensors(folder: str) -> dict:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index} is not a valid index (a JSON object with a weight_map of file names)") from None
    elif os.path.exists(os.path.join(folder, "model.safetensors")):
        shards = ["model.safetensors"]
    else:
        raise CheckpointError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    state = {}
    for shard in shards:
        tensors, _ = tensor_files.load(_inside(folder, shard))
        for name, t in tensors.items():
            state[name] = t.float32() if t.dtype == "bfloat16" else t.array
    return state


def _inside(folder: str, name) -> str:
    """A shard named by the index, refused unless it is a plain file name inside the folder
    (an absolute path or ../ in a downloaded index must not read elsewhere)."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or os.path.normpath(name).startswith(".."):
        raise CheckpointError(f"the index of {folder} names {name!r}, which is not a file inside that folder")
    path = os.path.join(folder, name)
    if os.path.commonpath([os.path.realpath(folder), os.path.realpath(path)]) != os.path.realpath(folder):
        raise CheckpointError(f"the index of {folder} names {name!r}, which leads outside that folder")
    return path


def load_config(folder: str) -> ModelConfig:
    """Only the config of a Hugging Face model folder (reads no weights)."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as fh:
            hf = json.load(fh)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise CheckpointError(f"{path} is not valid JSON") from None
    return config_from_hf(hf)


# MindSpeed-LLM's --model-type-hf names -> our model family
MODEL_TYPES = {"llama2": "llama", "llama3": "llama", "qwen2": "qwen2", "qwen25": "qwen2", "qwen3": "qwen3",
               "phi3.5": "phi3", "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3",
               "mistral": "mistral", "gpt2": "gpt2", "mixtral": "mixtral", "qwen2-moe": "qwen2_moe",
               "qwen3-moe": "qwen3_moe", "deepseek2-lite": "deepseek_v2", "deepseek3": "deepseek_v3",
               "glm45": "glm4_moe", "glm45-air": "glm4_moe", "minicpm3": "minicpm3", "gpt-oss": "gpt_oss"}
# what a Hugging Face folder holds besides the model: copied along by --hf-cfg-dir
COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
              "generation_config.json", "vocab.json", "merges.txt", "chat_template.jinja")


def check_same_model(folder: str, cfg: ModelConfig) -> None:
    """``folder``'s config.json must describe the model ``cfg`` (the same shapes and family)."""
    theirs = load_config(folder)
    keys = ("family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
            "kv_channels", "vocab_size")
    differ = [k for k in keys if getattr(theirs, k) != getattr(cfg, k)]
    if differ:
        k = differ[0]
        raise CheckpointError(f"--hf-cfg-dir {folder}: its config.json has {k} {getattr(theirs, k)!r} but the "
                              f"converted model {getattr(cfg, k)!r}: it describes another model")


def copy_companions(source: str, target: str) -> None:
    """The tokenizer and generation files of ``source`` into the written folder ``target``."""
    for name in COMPANIONS:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(target, name))


def load_folder(folder: str, mtp_num_layers: int = 0) -> tuple[ModelConfig, dict]:
    """A Hugging Face model folder -> (our config, our numpy state dict, float32). A config
    too large for this machine is refused before any weight is read. ``mtp_num_layers``: the
    multi-token prediction modules to read too (transformers reads none)."""
    cfg = load_config(folder)
    if mtp_num_layers:
        cfg = dataclasses.replace(cfg, mtp_num_layers=mtp_num_layers)
    check_fits_in_memory(4 * cfg.num_parameters(), f"the model in {folder} ({cfg.num_parameters():,} parameters)")
    try:
        state = from_hf_state(cfg, _read_tensors(folder))
    except ValueError as exc:  # a tensor whose shape its config.json does not describe
        raise CheckpointError(f"the weights in {folder} do not fit its config.json ({exc})") from None
    return cfg, {k: np.asarray(v, dtype=np.float32) for k, v in state.items()}


def without_noop_layers(cfg: ModelConfig, state: dict) -> tuple[ModelConfig, dict]:
    """A Hugging Face model has no no-op layers: number the real ones 0, 1, ... (as
    MindSpeed-LLM's converter drops them)."""
    if not cfg.noop_layers:
        return cfg, state
    real = [i for i in range(cfg.num_layers) if i not in cfg.noop_layers]
    index = {layer: j for j, layer in enumerate(real)}
    renamed = renumber_layers(state, index.__getitem__)
    return cfg.renumbered(index, len(real), ()), renamed


def with_noop_layers(cfg: ModelConfig, state: dict | None, noop: tuple) -> tuple[ModelConfig, dict | None]:
    """The inverse: a Hugging Face model with no-op layers at ``noop`` (MindSpeed's
    --noop-layers, numbered among all the layers), the real ones keeping their order."""
    total = cfg.num_layers + len(noop)
    if any(not 0 <= i < total for i in noop) or len(set(noop)) != len(noop) or len(noop) >= total:
        raise CheckpointError(f"--noop-layers {','.join(map(str, noop))}: layer numbers must be distinct, within the "
                              f"{total} layers the model then has, and leave some real")
    real = [i for i in range(total) if i not in noop]
    renamed = None if state is None else renumber_layers(state, real.__getitem__)
    return cfg.renumbered(dict(enumerate(real)), total, tuple(sorted(noop))), renamed


def save_folder(folder: str, cfg: ModelConfig, state: dict, max_shard_bytes: int | None = None) -> None:
    """Write config.json and safetensors (sharded with an index past max_shard_bytes) from a
    whole model's state in our names (LoRA adapters merged into their base weights)."""
    cfg, state = without_noop_layers(*merge_lora(cfg, state))
    # both can refuse the model: before the folder exists, so that a refusal leaves nothing
    config = {**hf_config(cfg), "torch_dtype": "float32"}
    hf = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in to_hf_state(cfg, state).items()}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    shards, current, size = [], {}, 0
    for name in sorted(hf):
        if current and max_shard_bytes and size + hf[name].nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = hf[name]
        size += hf[name].nbytes
    shards.append(current)
    raw = {"format": "pt"}
    if len(shards) == 1:
        tensor_files.save(os.path.join(folder, "model.safetensors"),
                          {k: tensor_files.HostTensor(v) for k, v in shards[0].items()}, raw_metadata=raw)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensor_files.save(os.path.join(folder, fname), {k: tensor_files.HostTensor(v) for k, v in shard.items()},
                          raw_metadata=raw)
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": int(sum(v.nbytes for v in hf.values()))}, "weight_map": weight_map},
                  fh, indent=2)


def load_model(folder: str):
    """Build our model (the family's, models/registry.py) from a Hugging Face folder on the
    bound framework."""
    cfg, state = load_folder(folder)
    model = registry.for_config(cfg).build(cfg)
    nn.load_state_dict(model, state)
    return model


def save_model(model, folder: str, max_shard_bytes: int | None = None) -> None:
    save_folder(folder, model.cfg, whole_state(model), max_shard_bytes)
