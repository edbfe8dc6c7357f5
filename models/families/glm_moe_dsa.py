"""GLM-5 (transformers' glm_moe_dsa; MindSpeed-LLM's glm5 and glm52 scripts): DeepSeek-V3.2's sparse
attention with its indexer's rotated features in pairs, and only some layers running an indexer:
the others reuse the top-k of the last layer that did (config.json's indexer_types, or its
index_topk_freq / index_skip_topk_offset / index_topk_pattern; MindSpeed-LLM's flags of those
names)."""

from __future__ import annotations

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import ModelConfig, indexer_layer_types
from mindspeed_core.models.families.deepseek_v32 import DeepSeekV32


class GlmMoeDsa(DeepSeekV32):
    name = "glm_moe_dsa"
    architecture = "GlmMoeDsaForCausalLM"
    aliases = ("glm5",)
    feature = "family-glm5"
    indexer_rope_interleave = True
    presets = {
        "tiny-glm5": dict(DeepSeekV32.presets["tiny-deepseek-v32"], family="glm_moe_dsa", num_layers=4,
                          moe_layers=(1, 2, 3),
                          dsa=dict(topk=16, n_heads=4, head_dim=32, loss_coeff=1.0, rope_interleave=True,
                                   layer_types=("full", "full", "shared", "full"))),
    }

    def indexer_types(self, hf: dict) -> tuple | None:
        layers = hf["num_hidden_layers"]
        types = hf.get("indexer_types")
        if types is None and hf.get("index_topk_pattern") is not None:
            pattern = hf["index_topk_pattern"]
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        if types is None:
            freq, offset = hf.get("index_topk_freq", 1), hf.get("index_skip_topk_offset", 2)
            return indexer_layer_types(layers, max(freq, 1), offset) if freq > 1 else None
        if len(types) != layers:
            raise CheckpointError(f"config.json: indexer_types has {len(types)} entries for {layers} layers")
        return tuple(types) if "shared" in types else None

    def hf_config(self, cfg: ModelConfig) -> dict:
        out = super().hf_config(cfg)
        out["indexer_types"] = list(cfg.dsa.layer_types or ["full"] * cfg.num_layers)
        return out


FAMILY = GlmMoeDsa()
