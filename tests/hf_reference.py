"""Builds tiny random Hugging Face models with transformers (PyTorch) and records their logits.

Run as a separate process (``python hf_reference.py OUT_DIR``) so that a test bound to
MindSpore never imports torch: for each architecture it writes OUT_DIR/<name>/ (a model
folder, saved by transformers) and OUT_DIR/<name>.npz (input ids and logits, float64; the logits
of the same weights with each of WITHOUT's mechanisms taken away; for the GENERATED ones also
transformers' greedy continuation of a batch padded on the left).
``python hf_reference.py --check FOLDER IDS.npy OUT.npy [FOLDER IDS.npy OUT.npy ...]`` loads
each folder with transformers and writes its logits: the check that our exported folders load in
transformers (several in one process: importing transformers is most of its time); for a
sequence classifier (a reward model) its score of each row, [rows, 1], each row run alone. A
folder that also holds a PEFT adapter (adapter_config.json) is run with peft's LoRA on top.
"""

from __future__ import annotations

import copy
import os
import sys

import numpy as np
import torch
import transformers as T

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, rms_norm_eps=1e-6)
MODELS = {
    "llama": (T.LlamaConfig, dict(COMMON, num_key_value_heads=2)),
    "llama3-rope": (T.LlamaConfig, dict(COMMON, num_key_value_heads=2, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama-linear-rope-tied": (T.LlamaConfig, dict(COMMON, num_key_value_heads=4, tie_word_embeddings=True,
                                                   rope_parameters={"rope_type": "linear", "rope_theta": 500.0,
                                                                    "factor": 2.0})),
    # YaRN: a ramp over half the dimensions (betas set so that it falls inside these 16), the
    # default attention temperature; and DeepSeek's mscale ratio on a Qwen2
    "llama-yarn": (T.LlamaConfig, dict(COMMON, num_key_value_heads=2, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 2.0, "beta_slow": 0.25})),
    "qwen2-yarn-mscale": (T.Qwen2Config, dict(COMMON, num_key_value_heads=2, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 0.5})),
    # dynamic NTK: the 12 tokens go past max_position_embeddings 8, so the base grows
    "llama-dynamic-rope": (T.LlamaConfig, dict(COMMON, num_key_value_heads=2, max_position_embeddings=8,
                                               rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                "factor": 2.0})),
    # q, k, v and o biases without MLP biases
    "llama-attention-bias": (T.LlamaConfig, dict(COMMON, num_key_value_heads=2, attention_bias=True)),
    "mistral": (T.MistralConfig, dict(COMMON, num_key_value_heads=1, sliding_window=None, head_dim=16)),
    "qwen2": (T.Qwen2Config, dict(COMMON, num_key_value_heads=2, tie_word_embeddings=True)),
    # sliding windows of 5 tokens: Mistral's in every layer, Qwen2's from layer max_window_layers on
    "mistral-sliding": (T.MistralConfig, dict(COMMON, num_key_value_heads=1, sliding_window=5, head_dim=16)),
    "qwen2-sliding": (T.Qwen2Config, dict(COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
                                          max_window_layers=1)),
    "qwen3": (T.Qwen3Config, dict(COMMON, num_key_value_heads=2, head_dim=32)),
    # Phi-3.5: fused qkv_proj / gate_up_proj, LongRoPE switching from the short to the long
    # factors past 16 positions (the 12 prompt tokens use the short ones, generation crosses over)
    "phi3-longrope": (T.Phi3Config, dict(COMMON, num_key_value_heads=2, pad_token_id=0, original_max_position_embeddings=16,
                                         rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                          "short_factor": [1.0 + 0.05 * i for i in range(8)],
                                                          "long_factor": [1.0 + 0.5 * i for i in range(8)]})),
    # Phi-4-mini's partial rotary: RoPE on the first half of each head's features
    "phi3-partial-rotary": (T.Phi3Config, dict(COMMON, num_key_value_heads=2, pad_token_id=0, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # Gemma 2: the first layer attends to a 5-token window (the 12 prompt tokens and the 8
    # generated cross it), caps small enough to bend the scores and the logits
    "gemma2": (T.Gemma2Config, dict(COMMON, num_key_value_heads=2, head_dim=16, sliding_window=5,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=0.5,
                                    final_logit_softcapping=1.5, pad_token_id=0)),
    # Gemma 3's text model: q/k norms, two sliding layers (window 5, RoPE base 100) to each global
    # one (base 10000, linear scaling), no soft-capping
    "gemma3": (T.Gemma3TextConfig, dict(COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                        sliding_window=5, sliding_window_pattern=3, query_pre_attn_scalar=24,
                                        pad_token_id=0, rope_parameters={
                                            "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 10000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    "gpt2": (T.GPT2Config, dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    # mixtures of experts: top-2 of 4, renormalised (Mixtral); a dense first layer, raw top-k
    # weights and a gated shared expert (Qwen2-MoE); q/k norms, renormalised (Qwen3-MoE)
    # Phi-3.5-MoE: SparseMixer's top-2 (each weight its own thresholded softmax), LayerNorm with
    # biases, q/k/v/o and lm_head biases, LongRoPE's explicit mscale (within its original 32
    # positions: transformers 5 keeps the short factors past them, which models/families/phimoe.py
    # explains)
    "phimoe": (T.PhimoeConfig, dict(COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                    attention_bias=True, lm_head_bias=True, rms_norm_eps=1e-5, pad_token_id=0,
                                    input_jitter_noise=0.01,  # the release's: training's noise only
                                    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                     "short_factor": [1.0 + 0.05 * i for i in range(8)],
                                                     "long_factor": [1.0 + 0.5 * i for i in range(8)],
                                                     "short_mscale": 1.2, "long_mscale": 1.3,
                                                     "original_max_position_embeddings": 32})),
    # Seed-OSS: q/k/v biases, an o bias and MLP biases switched apart, heads wider than hidden / heads
    "seed-oss": (T.SeedOssConfig, dict(COMMON, num_key_value_heads=2, head_dim=24, attention_bias=True,
                                       attention_out_bias=True, mlp_bias=True, attention_dropout=0.0,
                                       residual_dropout=0.0, pad_token_id=0, bos_token_id=None, eos_token_id=None)),
    "mixtral": (T.MixtralConfig, dict(COMMON, num_key_value_heads=2, sliding_window=None, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "qwen2-moe": (T.Qwen2MoeConfig, dict(COMMON, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                         norm_topk_prob=False, mlp_only_layers=[0])),
    "qwen3-moe": (T.Qwen3MoeConfig, dict(COMMON, num_key_value_heads=2, head_dim=32, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)),
    # multi-head latent attention: DeepSeek-V2-Lite's shape (no query latent, YaRN with its
    # mscale on cos/sin and the softmax scale) with a dense first layer, then top-2 of 4 softmax
    # experts (raw weights, scaled) beside a shared one; DeepSeek-V3's with a query latent,
    # attention biases and its features rotated in halves (rope_interleave false), a dense first
    # layer, then sigmoid top-3 of 8 experts within the best 2 of 4 groups, steered by the
    # router's e_score_correction_bias (set at random below), normalised and scaled
    "deepseek-v2": (T.DeepseekV2Config, dict(COMMON, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                                             qk_rope_head_dim=4, v_head_dim=12, first_k_dense_replace=1,
                                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                             n_shared_experts=1, routed_scaling_factor=1.5, topk_method="greedy",
                                             norm_topk_prob=False, pad_token_id=0, rope_parameters={
                                                 "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})),
    # PLM: DeepSeek-V2-Lite's latent attention (no query latent, RoPE on consecutive pairs), dense
    # layers of PLM's squared-ReLU MLP (PATCHED; every layer dense: first_k_dense_replace 2), tied embeddings
    "plm-as-deepseek-v2": (T.DeepseekV2Config, dict(COMMON, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                                                    qk_rope_head_dim=4, v_head_dim=12, first_k_dense_replace=2,
                                                    n_routed_experts=4, tie_word_embeddings=True, pad_token_id=0,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "deepseek-v3": (T.DeepseekV3Config, dict(COMMON, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                                             qk_rope_head_dim=4, v_head_dim=12, first_k_dense_replace=1,
                                             n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                             moe_intermediate_size=24, n_shared_experts=1, routed_scaling_factor=2.5,
                                             norm_topk_prob=True, attention_bias=True, rope_interleave=False,
                                             pad_token_id=0)),
    # GLM-4.5: q/k/v biases, per-head q/k norms, RoPE on the first half of each head (the
    # config's default), a dense first layer, then DeepSeek-V3's router (top-2 of 8 in the best
    # 2 of 4 groups, its bias set at random below) beside a shared expert
    "glm4-moe": (T.Glm4MoeConfig, dict(COMMON, num_key_value_heads=2, head_dim=24, attention_bias=True,
                                       use_qk_norm=True, first_k_dense_replace=1, n_routed_experts=8,
                                       num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=24,
                                       n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                       pad_token_id=0)),
    # MiniMax-M2: q/k norms over all heads at once, RoPE on half of each head, sigmoid-routed
    # experts steered by the block's e_score_correction_bias
    "minimax-m2": (T.MiniMaxM2Config, dict(COMMON, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                                           num_experts_per_tok=2, pad_token_id=0, bos_token_id=None,
                                           eos_token_id=None, rope_parameters={
                                               "rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.5})),
    # DeepSeek-V3.2: DeepSeek-V3 with sparse attention in both layers: each query keeps its 6 best keys
    # by the indexer's scores (the 24 tokens: 18 positions choose), its features rotated in halves;
    # 16 indexer heads, so that no key's score is exactly zero (every head's ReLU zero) at the 6th
    # place, where two implementations' top-k may break the tie differently
    "deepseek-v32": (T.DeepseekV32Config, dict(COMMON, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                                               qk_rope_head_dim=4, v_head_dim=12, first_k_dense_replace=1,
                                               n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                               moe_intermediate_size=24, n_shared_experts=1,
                                               routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=6,
                                               index_n_heads=16, index_head_dim=16, pad_token_id=0)),
    # GLM-5: the same with the indexer's features rotated in pairs and four layers, the third
    # reusing the second's choice (index_topk_freq 2 from layer 2: full, full, shared, full)
    "glm5": (T.GlmMoeDsaConfig, dict(COMMON, num_hidden_layers=4, kv_lora_rank=16, q_lora_rank=24,
                                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, first_k_dense_replace=1,
                                     n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                                     moe_intermediate_size=24, n_shared_experts=1, routed_scaling_factor=2.5,
                                     index_topk=6, index_n_heads=16, index_head_dim=16, index_topk_freq=2,
                                     index_skip_topk_offset=2, pad_token_id=0)),
    # LongCat-Flash: two layers of two latent attentions (both latents scaled by sqrt(hidden / rank)) and
    # two dense MLPs with a shortcut MoE: softmax over 4 experts and 2 zero-computation ones, top-3 by
    # score plus the expert bias (set at random below), weights times 6
    "longcat-flash": (T.LongcatFlashConfig, dict({k: v for k, v in COMMON.items()
                                                  if k not in ("num_hidden_layers", "intermediate_size")},
                                                 num_layers=2, ffn_hidden_size=96, q_lora_rank=24, kv_lora_rank=16,
                                                 qk_nope_head_dim=8, qk_rope_head_dim=4, head_dim=4, v_head_dim=12,
                                                 moe_topk=3, n_routed_experts=4, zero_expert_num=2,
                                                 expert_ffn_hidden_size=24, routed_scaling_factor=6.0,
                                                 pad_token_id=0)),
    # Hunyuan-V3: Qwen3's attention with q/k/v/o biases, a dense first layer, then sigmoid-routed
    # experts steered by the expert bias, renormalised and scaled by 2.826, beside a shared expert
    "hy-v3": (T.HYV3Config, dict(COMMON, num_key_value_heads=2, head_dim=32, attention_bias=True, num_experts=4,
                                 num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=24,
                                 router_scaling_factor=2.826, mlp_layer_types=["dense", "sparse"], pad_token_id=0)),
    # MiniCPM3: DeepSeek-V2's latent attention with a query latent, rotated in halves, tied
    # embeddings scaled by 12, residual branches by 1.4 / sqrt(2), the output by 256 / 64
    "minicpm3": (T.MiniCPM3Config, dict(COMMON, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
                                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, scale_emb=12,
                                        scale_depth=1.4, dim_model_base=256, tie_word_embeddings=True,
                                        pad_token_id=0)),
    # GPT-OSS: attention sinks, q/k/v/o biases, a 5-token window on every other layer, YaRN
    # (truncate false), top-2 of 4 experts with biases, the clamped quick-GEGLU with a limit low
    # enough to clip (0.5); "gpt-oss-mxfp4" the same with its experts stored as MXFP4 blocks
    "gpt-oss": (T.GptOssConfig, dict(COMMON, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.5, pad_token_id=0,
                                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                      "original_max_position_embeddings": 16})),
    # linear-attention hybrid: layers 0-2 gated DeltaNet (grouped value heads), 3 gated attention on a
    # quarter of each head; MoE with a gated shared expert except in layer 1
    "qwen3-next": (T.Qwen3NextConfig, dict(COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                           max_position_embeddings=128, linear_num_key_heads=2,
                                           linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    # Qwen3.5's text models: the same layers with separate, ungrouped linear-attention projections
    "qwen3.5": (T.Qwen3_5TextConfig, dict(COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=128, linear_num_key_heads=2, linear_num_value_heads=4,
                                          linear_key_head_dim=8, linear_value_head_dim=8)),
    # a released Qwen3.5 folder's shape: the text model inside Qwen3_5ForConditionalGeneration, with a
    # (tiny) vision tower we set aside
    "qwen3.5-vl": (T.Qwen3_5Config, dict(
        text_config=dict(COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=8),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=1, num_position_embeddings=16))),
    "qwen3.5-moe": (T.Qwen3_5MoeTextConfig, dict({k: v for k, v in COMMON.items() if k != "intermediate_size"},
                                                 num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                                 max_position_embeddings=128, linear_num_key_heads=2,
                                                 linear_num_value_heads=4, linear_key_head_dim=8,
                                                 linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, shared_expert_intermediate_size=48)),
}
MODELS["gpt-oss-mxfp4"] = MODELS["gpt-oss"]
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def to_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' expert weight [E, in, out] -> (blocks uint8 [E, out, in / 32, 16], scales
    uint8 [E, out, in / 32]): each block of 32 inputs scaled by a power of two so its largest
    value fits 6, each value rounded to the nearest e2m1 number, two to a byte, low nibble first."""
    rows = np.swapaxes(weight, 1, 2)
    blocks = rows.reshape(rows.shape[:-1] + (-1, 32))
    exponent = np.floor(np.log2(np.maximum(np.abs(blocks).max(-1), 1e-30))) - 2
    scaled = blocks / np.exp2(exponent)[..., None]
    nibbles = np.abs(scaled[..., None] - FP4_E2M1).argmin(-1).astype(np.uint8)
    packed = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    # contiguous: safetensors' numpy writer copies the memory as it lies, whatever the strides
    return np.ascontiguousarray(packed), np.ascontiguousarray((exponent + 127).astype(np.uint8))


def store_experts_as_mxfp4(model, folder: str) -> None:
    """Round the experts to MXFP4 (the model then holds what transformers dequantises from the
    blocks) and write the folder as the released GPT-OSS checkpoints are: blocks and scales in
    place of the expert weights, with a quantization_config."""
    import json

    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = to_mxfp4(p.double().numpy())
                p.copy_(convert_moe_packed_tensors(torch.as_tensor(blocks), torch.as_tensor(scales),
                                                   dtype=torch.float32))
                stored[name] = (blocks, scales)
    model.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    for name, (blocks, scales) in stored.items():
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as fh:
        config = json.load(fh)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(config, fh)


# greedy generate() with the cache: 8 tokens after the first PROMPT ids, the second row's first
# 3 ids padding
GENERATED = ("llama", "qwen3", "gpt2", "llama-dynamic-rope", "phi3-longrope", "phimoe", "gemma2", "gemma3",
             "mistral-sliding", "seed-oss", "deepseek-v2", "deepseek-v3", "glm4-moe", "minicpm3", "gpt-oss", "qwen3-next", "qwen3.5",
             "minimax-m2", "hy-v3", "deepseek-v32", "glm5", "longcat-flash")
PAD, PROMPT = 3, 12
BEAMS = ("llama", "qwen3", "deepseek-v2")  # transformers' beam search, for test_hf's
# the logits are of 24 tokens: past every original context above (8 or 16), so that dynamic
# NTK's base grows and LongRoPE takes its long factors; weights of spread 0.2 (transformers'
# default initialisation gives logits of ~0.4, where a 10% change of a softmax scale hides
# inside 1e-4), so logits of O(1) to O(10)
SEQUENCE, SPREAD = 24, 0.2
# past one 64-token chunk of the delta rule's training form: the carried state between chunks acts
LENGTHS = {"qwen3-next": 80, "qwen3.5": 80, "qwen3.5-moe": 80, "qwen3.5-vl": 80}


def _rope(name: str, **changes) -> dict:
    """MODELS[name]'s rope_parameters with ``changes`` (a key set to None is dropped)."""
    rope = {**MODELS[name][1]["rope_parameters"], **changes}
    return {k: v for k, v in rope.items() if v is not None}


# Each mechanism taken away from the same weights: the test asserts that these logits are far
# from the model's, so a tolerance that hid the mechanism would fail there. (name -> {label:
# config changes, or a function changing the loaded model})
WITHOUT = {
    "llama3-rope": {"llama3 scaling": {"rope_parameters": _rope("llama3-rope", rope_type="default", factor=None,
                                                                   low_freq_factor=None, high_freq_factor=None,
                                                                   original_max_position_embeddings=None)}},
    "llama-linear-rope-tied": {"linear scaling": {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}},
    "llama-yarn": {"YaRN": {"rope_parameters": {"rope_type": "default", "rope_theta": 10.0}}},
    "qwen2-yarn-mscale": {"mscale ratio": {"rope_parameters": _rope("qwen2-yarn-mscale", mscale=None,
                                                                     mscale_all_dim=None)}},
    "llama-dynamic-rope": {"dynamic NTK": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}},
    "phi3-longrope": {"long factors": {"rope_parameters": _rope("phi3-longrope",
                                                                long_factor=[1.0 + 0.05 * i for i in range(8)])}},
    "phi3-partial-rotary": {"partial rotary": {"rope_parameters": _rope("phi3-partial-rotary",
                                                                        partial_rotary_factor=None)}},
    "gemma2": {"soft-capping": {"attn_logit_softcapping": None, "final_logit_softcapping": None},
               "window": {"sliding_window": 64}},
    "gemma3": {"window": {"sliding_window": 64}},
    "mistral-sliding": {"window": {"sliding_window": None}},
    "qwen2-sliding": {"window": {"use_sliding_window": False}},
    # DeepSeek's mscale of the softmax (squared) and of cos/sin
    "deepseek-v2": {"mscale": {"rope_parameters": _rope("deepseek-v2", mscale=None, mscale_all_dim=None)}},
    # each head's rotated features taken in halves, not as interleaved pairs
    "deepseek-v3": {"rotation in halves": {"rope_interleave": True}},
    "minicpm3": {"MiniCPM scalings": {"scale_emb": 1, "scale_depth": 1.0, "dim_model_base": 64}},
    # the delta rule's decay (A -> 0: a state that never forgets) and the short convolution (the
    # identity: each channel its own input)
    "qwen3-next": {"decay": lambda model: [m.A_log.fill_(-30.0) for m in model.modules() if hasattr(m, "A_log")],
                   "convolution": lambda model: [_identity_conv(m.conv1d.weight) for m in model.modules()
                                                 if hasattr(m, "A_log")]},
    # SparseMixer's thresholds (a jitter epsilon that masks nothing: each weight the softmax over
    # every expert), and the explicit mscale
    "phimoe": {"thresholds": lambda model: [setattr(m, "router_jitter_noise", 10.0) for m in model.modules()
                                            if hasattr(m, "router_jitter_noise")],
               "mscale": {"rope_parameters": _rope("phimoe", short_mscale=1.0)}},
    # MiniMax-M2's norms per head instead of over all heads (the same weights), its RoPE on every
    # feature, and its routers without the expert bias
    "minimax-m2": {"norms over all heads": lambda model: _norms_per_head(model),
                   "partial rotary": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                   "expert bias": lambda model: [m.e_score_correction_bias.zero_() for m in model.modules()
                                                 if hasattr(m, "e_score_correction_bias")]},
    # Hunyuan-V3's routed weights unscaled, its routers without the expert bias, its shared expert silent
    "hy-v3": {"routed scaling": {"router_scaling_factor": 1.0},
              "expert bias": lambda model: [m.e_score_correction_bias.zero_() for m in model.modules()
                                            if hasattr(m, "e_score_correction_bias")],
              "shared expert": lambda model: [m.shared_experts.down_proj.weight.zero_() for m in model.modules()
                                              if hasattr(m, "shared_experts")]},
    # sparse attention: every key attended (a top-k past the sequence), the indexer's rotation in the
    # other convention, the shared layer attending densely instead of reusing the choice before it
    "deepseek-v32": {"top-k": {"index_topk": 64},
                     "indexer rotation in pairs": lambda model: _indexer_rotation(model, "glm_moe_dsa")},
    "glm5": {"top-k": {"index_topk": 64},
             "indexer rotation in halves": lambda model: _indexer_rotation(model, "deepseek_v32"),
             "shared choice": lambda model: _dense_shared_layers(model)},
    # LongCat-Flash's zero-computation experts returning nothing instead of their token, its latents
    # unscaled, its routers without the expert bias
    "longcat-flash": {"zero experts": lambda model: [setattr(m, "identity_expert", _Nothing())
                                                     for m in model.modules() if hasattr(m, "identity_expert")],
                      "latent scaling": lambda model: [(setattr(m, "mla_scale_q_lora", 1.0),
                                                        setattr(m, "mla_scale_kv_lora", 1.0))
                                                       for m in model.modules() if hasattr(m, "mla_scale_q_lora")],
                      "expert bias": lambda model: [m.e_score_correction_bias.zero_() for m in model.modules()
                                                    if hasattr(m, "e_score_correction_bias")]},
    "gpt-oss": {"sinks": lambda model: [m.sinks.fill_(-1e4) for m in model.modules() if hasattr(m, "sinks")],
                "window": {"sliding_window": 64}},
}


class _PerHeadNorm(torch.nn.Module):
    """An RMSNorm over all heads' features (MiniMax-M2's) computed per head instead, same weight."""

    def __init__(self, norm, head_dim: int):
        super().__init__()
        self.weight, self.eps, self.head_dim = norm.weight, norm.variance_epsilon, head_dim

    def forward(self, x):
        heads = x.float().reshape(*x.shape[:-1], -1, self.head_dim)
        heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * heads.reshape(x.shape).to(x.dtype)


def _norms_per_head(model) -> None:
    for m in model.modules():
        if hasattr(m, "q_norm") and hasattr(m, "head_dim"):
            m.q_norm, m.k_norm = _PerHeadNorm(m.q_norm, m.head_dim), _PerHeadNorm(m.k_norm, m.head_dim)


class _Nothing(torch.nn.Module):
    """A zero-computation expert that returns zeros instead of its token."""

    def forward(self, x):
        return x * 0.0


def _indexer_rotation(model, family: str) -> None:
    """Each indexer computed by ``family``'s indexer's forward (the other RoPE convention), same weights."""
    import importlib
    import types

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = module.GlmMoeDsaIndexer if family == "glm_moe_dsa" else module.DeepseekV32Indexer
    for m in model.modules():
        if hasattr(m, "weights_proj") and hasattr(m, "wq_b"):
            m.forward = types.MethodType(cls.forward, m)


def _dense_shared_layers(model) -> None:
    """GLM-5's shared layers given every key as their choice instead of the last full layer's."""
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.indexer is None:
            def forward(*args, _run=attn.forward, prev_topk_indices=None, **kwargs):
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                b, s = hidden.shape[:2]
                every = torch.arange(s, dtype=torch.int32).expand(b, s, s)
                return _run(*args, prev_topk_indices=every, **kwargs)

            attn.forward = forward


def _squared_relu_mlps(model) -> None:
    """PLM's MLP, down(relu(up(x))^2) without a gate, on DeepSeek-V2's dense layers: transformers
    has no PLM class (its pull request's and the Hub's modelling code is DeepSeek-V2-Lite's with
    this MLP); the gate's weights stay in the folder, unused."""
    for layer in model.model.layers:
        layer.mlp.forward = lambda x, mlp=layer.mlp: mlp.down_proj(torch.relu(mlp.up_proj(x)) ** 2)


# what a reference's model runs instead of its class's own (a family transformers does not have)
PATCHED = {"plm-as-deepseek-v2": _squared_relu_mlps}


def _identity_conv(weight) -> None:
    weight.zero_()
    weight[:, :, -1] = 1.0


def _model(cls, kwargs: dict, name: str | None = None):
    if cls is T.Qwen3_5Config:  # multimodal: its text-only forward is what the logits compare with
        return T.Qwen3_5ForConditionalGeneration(cls(**kwargs)).float().eval()
    model = T.AutoModelForCausalLM.from_config(cls(**kwargs)).float().eval()
    if name in PATCHED:
        PATCHED[name](model)
    return model


SAMPLED_EPS = 0.3  # SparseMixer's epsilon in the training reference (the release's 0.01 leaves one candidate here)


def sparsemixer_training(model, ids) -> dict:
    """Phi-3.5-MoE in training mode: each router samples its two experts (Gumbel noise from the
    exponential draws, Heun's choice from the uniform ones), the draws taken from arrays recorded
    here in the order the layers make them, the input jitter off (tested on its own; transformers
    also jitters the experts' input, megatron-core only the router's). Records the draws, the
    logits and the gradients of sum(logits x probe) at the routers' and the embedding's weights;
    and the routers' gradients with Heun's estimator replaced by plain autograd of the scaled
    weight (what a model without the estimator would train on)."""
    from transformers.models.phimoe import modeling_phimoe
    train = copy.deepcopy(model).train()
    for m in train.modules():
        if hasattr(m, "input_jitter_noise"):
            m.input_jitter_noise = 0.0
        if hasattr(m, "router_jitter_noise"):  # wide thresholds: 2 to 4 candidates a choice, so the draws pick
            m.router_jitter_noise = SAMPLED_EPS
    cfg = train.config
    rng = np.random.default_rng(2)
    tokens, layers = ids.size, cfg.num_hidden_layers
    exponential = rng.exponential(size=(layers, 2, tokens, cfg.num_local_experts)).astype(np.float32)
    uniform = rng.random((layers, 2, tokens)).astype(np.float32)
    probe = rng.standard_normal((*ids.shape, VOCAB)) / np.sqrt(ids.size)
    routers = [n for n, _ in train.named_parameters() if n.endswith("router.weight")]

    def run(estimator: bool):
        exps = iter(e for layer in exponential for e in layer)
        unis = iter(u for layer in uniform for u in layer)
        saved = torch.Tensor.exponential_, torch.rand_like, torch.Tensor.uniform_, modeling_phimoe.PhimoeMultiplier.apply
        torch.Tensor.exponential_ = lambda self, *a, **k: self.copy_(torch.from_numpy(next(exps)).view_as(self))
        torch.rand_like = lambda t, *a, **k: torch.from_numpy(next(unis).copy()).view_as(t)
        torch.Tensor.uniform_ = lambda self, *a, **k: self  # the second choice's rand_like(...).uniform_()
        if not estimator:
            modeling_phimoe.PhimoeMultiplier.apply = lambda scores, multiplier, chosen, gates, mask: multiplier * mask
        try:
            train.zero_grad()
            logits = train(torch.as_tensor(ids)).logits
            (logits.double() * torch.from_numpy(probe)).sum().backward()
        finally:
            (torch.Tensor.exponential_, torch.rand_like, torch.Tensor.uniform_,
             modeling_phimoe.PhimoeMultiplier.apply) = saved
        grads = dict(train.named_parameters())
        return logits.detach().double().numpy(), [grads[n].grad.double().numpy() for n in routers], \
            grads["model.embed_tokens.weight"].grad.double().numpy()

    logits, router_grads, embedding_grad = run(True)
    _, plain_router_grads, _ = run(False)
    return {"train_eps": np.array(SAMPLED_EPS), "train_exponential": exponential, "train_uniform": uniform, "train_probe": probe,
            "train_logits": logits, "train_router_grads": np.stack(router_grads),
            "train_embedding_grad": embedding_grad, "train_router_grads_without_estimator": np.stack(plain_router_grads)}


def build(name: str, out_dir: str) -> None:
    cls, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = _model(cls, kwargs, name)
    with torch.no_grad():  # random everything, biases and norms included, so no mapping hides
        for pname, p in model.named_parameters():
            p.normal_(0.0, SPREAD)
            if p.dim() == 1 and pname.endswith("weight") and ("norm" in pname or ".ln_" in pname):
                p.add_(1.0)  # a norm's gains about 1: centred at 0 they would shrink the logits 5-fold
            if pname.endswith("A_log"):  # decays of about 0.95 a token: the state outlives a 64-token chunk
                p.add_(-3.0)
        for buffer_name, b in model.named_buffers():  # DeepSeek-V3's routers' bias is a buffer
            if buffer_name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    folder = os.path.join(out_dir, name)
    if name.endswith("-mxfp4"):
        store_experts_as_mxfp4(model, folder)
    else:  # one model saved sharded, to cover the index file
        model.save_pretrained(folder, max_shard_size="100KB" if name == "qwen3" else "1GB")
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(2, LENGTHS.get(name, SEQUENCE)))

    def logits_of(m, rows):
        with torch.no_grad():
            return m(torch.as_tensor(rows)).logits.double().numpy()

    extra = {}
    if name == "phi3-longrope":  # within the original 16 positions: the short factors
        extra["short_ids"], extra["short_logits"] = ids[:, :PROMPT], logits_of(model, ids[:, :PROMPT])
    for label, change in WITHOUT.get(name, {}).items():
        other = _model(cls, kwargs if callable(change) else {**kwargs, **change}, name)
        other.load_state_dict(model.state_dict())
        if callable(change):
            with torch.no_grad():
                change(other)
        extra[f"without {label}"] = logits_of(other, ids)
    if name == "phimoe":
        extra.update(sparsemixer_training(model, ids))
    if name in GENERATED:
        model.generation_config.eos_token_id = None  # never stop early: 8 tokens each
        model.generation_config.pad_token_id = 0
        prompts = ids[:, :PROMPT]
        mask = np.ones_like(prompts)
        mask[1, :PAD] = 0
        with torch.no_grad():
            out = model.generate(torch.as_tensor(prompts * mask), attention_mask=torch.as_tensor(mask),
                                 max_new_tokens=8, do_sample=False)
        extra["generated"] = out[:, PROMPT:].numpy()
    if name in BEAMS:
        # beam search on the first prompt: beams end at the greedy run's third token (so some end
        # early), scored per token (length penalty 1) and by probability alone (0)
        eos = int(extra["generated"][0, 2])
        extra["beam_eos"] = np.array(eos)
        for penalty in (1.0, 0.0):
            with torch.no_grad():
                out = model.generate(torch.as_tensor(ids[:1, :PROMPT]), max_new_tokens=8, do_sample=False,
                                     num_beams=3, length_penalty=penalty, early_stopping=False, eos_token_id=eos,
                                     pad_token_id=0)
            extra[f"beam_{penalty:g}"] = out[0, PROMPT:].numpy()
    np.savez(os.path.join(out_dir, f"{name}.npz"), ids=ids, logits=logits_of(model, ids), **extra)


def check(folder: str, ids_path: str, out_path: str) -> None:
    config = T.AutoConfig.from_pretrained(folder)
    ids = np.load(ids_path)
    if any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
        # without a pad token transformers scores a row at its last token: one row at a time
        model = T.AutoModelForSequenceClassification.from_pretrained(folder).float().eval()
        with torch.no_grad():
            np.save(out_path, np.concatenate([model(torch.as_tensor(row[None])).logits.double().numpy()
                                              for row in ids]))
        return
    model = T.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    if os.path.exists(os.path.join(folder, "adapter_config.json")):
        import peft

        model = peft.PeftModel.from_pretrained(model, folder).eval()
    with torch.no_grad():
        np.save(out_path, model(torch.as_tensor(ids)).logits.double().numpy())


if __name__ == "__main__":
    T.logging.set_verbosity_error()
    if sys.argv[1] == "--check":
        triples = sys.argv[2:]
        for i in range(0, len(triples), 3):
            check(*triples[i:i + 3])
    else:
        for model_name in MODELS:
            build(model_name, sys.argv[1])
