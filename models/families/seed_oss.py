"""Seed-OSS (ByteDance): LLaMA's decoder with its biases switched apart (attention_bias on q, k
and v; attention_out_bias on o; mlp_bias on the MLP), heads of their own width (head_dim), and
dropout after attention and after the MLP (residual_dropout: Megatron's hidden dropout)."""

from __future__ import annotations

import dataclasses

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.families.base import LlamaLike


class SeedOss(LlamaLike):
    name = "seed_oss"
    architecture = "SeedOssForCausalLM"
    aliases = ("seed-oss",)
    presets = {
        "tiny-seed-oss": dict(family="seed_oss", hidden_size=128, num_layers=4, num_attention_heads=4,
                              num_query_groups=2, kv_channels=48, ffn_hidden_size=352, add_qkv_bias=True,
                              attention_output_bias=False, untie_embeddings_and_output_weights=True),
    }

    def config_from_hf(self, hf: dict):
        cfg = super().config_from_hf(hf)
        return dataclasses.replace(cfg, attention_dropout=float(hf.get("attention_dropout", 0.0)),
                                   hidden_dropout=float(hf.get("residual_dropout", 0.0)))

    def qkv_bias_from_hf(self, hf: dict) -> bool:
        return bool(hf.get("attention_bias"))

    def output_bias_from_hf(self, hf: dict) -> bool:
        return bool(hf.get("attention_out_bias"))

    def mlp_bias_from_hf(self, hf: dict) -> bool:
        return bool(hf.get("mlp_bias"))

    def hf_config(self, cfg):
        out = super().hf_config(cfg)
        if cfg.moe is not None:
            raise CheckpointError("seed_oss is a dense model: this one has experts")
        out.update(attention_bias=cfg.add_qkv_bias, attention_out_bias=cfg.attention_output_bias,
                   mlp_bias=cfg.add_bias_linear, attention_dropout=cfg.attention_dropout,
                   residual_dropout=cfg.hidden_dropout,
                   # transformers' defaults name ids past a small vocabulary
                   pad_token_id=None, bos_token_id=None, eos_token_id=None)
        return out


FAMILY = SeedOss()
