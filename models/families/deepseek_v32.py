"""DeepSeek-V3.2 (transformers' deepseek_v32; MindSpeed-LLM's deepseek32 scripts): DeepSeek-V3 with
sparse attention (models/dsa.py) in every layer: a lightning indexer beside the latent attention
(which always has a query latent), its rotated features in halves, while the attention's are in
pairs. Its MoE, dense first layers and multi-token prediction are DeepSeek-V3's."""

from __future__ import annotations

import dataclasses

from mindspeed_core import features
from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import DSAConfig, ModelConfig
from mindspeed_core.models.families.deepseek import DeepSeekV3

INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


class DeepSeekV32(DeepSeekV3):
    name = "deepseek_v32"
    architecture = "DeepseekV32ForCausalLM"
    aliases = ("deepseek32",)
    specs = ()  # MindSpeed-LLM builds it with deepseek_spec and --enable-dsa-indexer (configuration.py)
    spec_also = ()
    sparse_attention = True
    feature = "family-deepseek-v32"  # the matrix's row, noted where its tensors are named
    indexer_rope_interleave = False
    refused_model_types = {"deepseek_v4": "model_type 'deepseek_v4' (DeepSeek-V4, a preview upstream) is not read: its "
                                          "manifold-constrained hyper-connections, compressed sparse attention and hash "
                                          "routing are not built (the matrix's deepseek-v4-* rows, planned); DeepSeek-V3.2 "
                                          "(deepseek_v32) is"}  # the indexer's rotated features: halves (DeepSeek-V3.2), pairs (GLM-5)
    presets = {
        "tiny-deepseek-v32": dict(family="deepseek_v32", hidden_size=128, num_layers=3, num_attention_heads=4,
                                  ffn_hidden_size=256, qk_layernorm=True, norm_epsilon=1e-6, moe_layers=(1, 2),
                                  mla=dict(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                           q_lora_rank=48),
                                  dsa=dict(topk=16, n_heads=4, head_dim=32, loss_coeff=1.0),
                                  moe=dict(num_experts=8, topk=2, ffn_hidden_size=64, score_function="sigmoid",
                                           enable_expert_bias=True, scaling_factor=2.5, load_balancing_type="none",
                                           shared_expert_size=64)),
    }

    def config_from_hf(self, hf: dict) -> ModelConfig:
        if not hf.get("q_lora_rank"):
            raise CheckpointError(f"config.json: {self.name}'s indexer reads the query latent: q_lora_rank must be set")
        types = hf.get("mlp_layer_types")
        if types is not None:  # dense layers first, as first_k_dense_replace says
            dense = next((i for i, t in enumerate(types) if t != "dense"), len(types))
            if any(t != "sparse" for t in types[dense:]):
                raise CheckpointError(f"config.json: mlp_layer_types {types}: dense layers first, then MoE ones")
            hf = {**hf, "first_k_dense_replace": dense}
        cfg = super().config_from_hf(hf)
        try:
            dsa = DSAConfig(topk=hf.get("index_topk", 2048), n_heads=hf.get("index_n_heads", 64),
                            head_dim=hf.get("index_head_dim", 128), rope_interleave=self.indexer_rope_interleave,
                            layer_types=self.indexer_types(hf))
            return dataclasses.replace(cfg, family=self.name, dsa=dsa)
        except ValueError as exc:
            raise CheckpointError(f"config.json: {exc}") from None

    def indexer_types(self, hf: dict) -> tuple | None:
        """Which layers run their own indexer (None: every one)."""
        return None

    def hf_config(self, cfg: ModelConfig) -> dict:
        dsa = cfg.dsa
        if dsa is None or cfg.mla.q_lora_rank is None:
            raise CheckpointError(f"{self.name} has sparse attention's indexer on latent attention with a query "
                                  f"latent: this model lacks it")
        if dsa.rope_interleave != self.indexer_rope_interleave:
            raise CheckpointError(f"{self.name}'s indexer rotates its features in "
                                  f"{'pairs' if self.indexer_rope_interleave else 'halves'}; this model's does not")
        out = super().hf_config(cfg)
        out.pop("rope_interleave", None)  # always pairs in the attention (transformers has no such key here)
        out.update(index_topk=dsa.topk, index_n_heads=dsa.n_heads, index_head_dim=dsa.head_dim)
        return out

    def layer_names(self, cfg: ModelConfig, i: int) -> dict:
        features.note_used(self.feature)
        names = super().layer_names(cfg, i)
        if cfg.dsa.runs_indexer(i):
            a, b = f"model.layers.{i}.self_attn.indexer.", f"decoder.layers.{i}.self_attention.dsa_indexer."
            names.update((a + n, b + n) for n in INDEXER)
        return names


FAMILY = DeepSeekV32()
