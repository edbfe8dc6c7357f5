"""Phi-3 / Phi-3.5 (and Phi-4-mini's partial rotary): LLaMA's decoder with fused qkv_proj (all
query rows, then the keys', then the values') and gate_up_proj, LongRoPE, a window in every layer."""

from __future__ import annotations

import numpy as np

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.families.base import LlamaLike, fuse_qkv, split_qkv


class Phi3(LlamaLike):
    name = "phi3"
    architecture = "Phi3ForCausalLM"
    aliases = ("phi3.5", "phi3")
    window = "every"
    partial_rotary = True  # transformers' Phi-3 rotates the first features
    presets = {
        # Phi-3.5's shape in small: LongRoPE with its short factors up to 64 positions, long ones past them
        "tiny-phi3": dict(family="phi3", hidden_size=128, num_layers=4, num_attention_heads=4, ffn_hidden_size=352,
                          max_position_embeddings=256, rope_scaling={
                              "rope_type": "longrope", "original_max_position_embeddings": 64,
                              "short_factor": [1.0 + 0.01 * i for i in range(16)],
                              "long_factor": [1.0 + 0.25 * i for i in range(16)]}),
    }

    def hf_config(self, cfg):
        out = super().hf_config(cfg)
        if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size or cfg.add_qkv_bias or cfg.add_bias_linear:
            raise CheckpointError("phi3 has heads of hidden_size / num_attention_heads and no biases")
        if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") != "longrope":
            raise CheckpointError(f"phi3's RoPE scaling is longrope only, not {cfg.rope_scaling.get('rope_type')}")
        del out["head_dim"]
        # transformers' defaults name token 32000 as padding and end, which a smaller vocabulary lacks
        out.update(pad_token_id=None, bos_token_id=None, eos_token_id=None,
                   original_max_position_embeddings=(cfg.rope_scaling or {}).get(
                       "original_max_position_embeddings", cfg.max_position_embeddings))
        return out

    def layer_from_hf(self, cfg, i, hf, take, out):
        a = f"model.layers.{i}."
        out[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = fuse_qkv(
            cfg, *_qkv(cfg, take(a + "self_attn.qkv_proj.weight")))
        out[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = take(a + "mlp.gate_up_proj.weight")
        for hf_n, ours in self.layer_names(cfg, i).items():
            if hf_n in hf:
                out[ours] = take(hf_n)

    def layer_to_hf(self, cfg, i, ours, out):
        a = f"model.layers.{i}."
        out[a + "self_attn.qkv_proj.weight"] = np.concatenate(
            split_qkv(cfg, ours[f"decoder.layers.{i}.self_attention.linear_qkv.weight"]))
        out[a + "mlp.gate_up_proj.weight"] = ours[f"decoder.layers.{i}.mlp.linear_fc1.weight"]
        for hf_n, mine in self.layer_names(cfg, i).items():
            if mine in ours:
                out[hf_n] = ours[mine]


def _qkv(cfg, qkv):
    """Phi-3's fused qkv_proj -> q, k, v."""
    q_rows, kv_rows = cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
    if qkv.shape[0] != q_rows + 2 * kv_rows:
        raise CheckpointError(f"qkv_proj has {qkv.shape[0]} rows; the config gives {q_rows} + 2 x {kv_rows}")
    return qkv[:q_rows], qkv[q_rows:q_rows + kv_rows], qkv[q_rows + kv_rows:]


FAMILY = Phi3()
