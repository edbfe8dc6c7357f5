"""Qwen3.5 (text): Qwen3-Next's hybrid (gated DeltaNet in three layers of four, gated attention
in the fourth, norms held as offsets from one), dense (``qwen3_5_text``) or with Qwen3-Next's
experts in every layer, renormalised, beside a gated shared expert (``qwen3_5_moe_text``).

Its linear layers' projections are separate and ungrouped (``in_proj_qkv``: q, k, v over all
heads; ``in_proj_z``, ``in_proj_b``, ``in_proj_a``): ``in_proj`` is them one after another. Its
rotary embedding is Qwen3-VL's multimodal one, which for text (every axis at the token's
position) is RoPE on the first quarter of each head.
"""

from __future__ import annotations

import numpy as np

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.families.qwen3_next import Qwen3Next


# a qwen3_5 / qwen3_5_moe folder (Qwen3_5ForConditionalGeneration: the released Qwen3.5 models) is
# a vision tower around the text model: its text_config and model.language_model.* tensors are the
# text model; the tower (model.visual.*) is set aside (images are not read here)
TEXT, TOWER = "model.language_model.", "model.visual."


class Qwen35(Qwen3Next):
    name = "qwen3_5"
    model_types = ("qwen3_5_text", "qwen3_5")
    architecture = "Qwen3_5ForCausalLM"
    aliases = ("qwen3.5",)  # ours: MindSpeed-LLM's examples have no Qwen3.5 yet
    specs = ()
    builds = "gpt"
    presets = {
        "tiny-qwen3.5": dict(
            family="qwen3_5", hidden_size=128, num_layers=4, num_attention_heads=4, num_query_groups=2,
            kv_channels=32, ffn_hidden_size=256, qk_layernorm=True, norm_epsilon=1e-6, norm_offset=True,
            rotary_percent=0.25, attention_output_gate=True, linear_layers=(0, 1, 2),
            linear_attention=dict(key_heads=2, value_heads=4, key_dim=32, value_dim=32)),
    }

    def moe_from_hf(self, hf: dict) -> tuple:
        return None, None

    def config_from_hf(self, hf: dict):
        return super().config_from_hf(text_config(hf))

    def tensors_in(self, cfg, hf: dict) -> dict:
        if not any(k.startswith(TEXT) for k in hf):
            return hf
        return {"model." + k[len(TEXT):] if k.startswith(TEXT) else k: v for k, v in hf.items()
                if not k.startswith(TOWER)}

    def hf_config(self, cfg):
        if cfg.moe is not None:
            raise CheckpointError("qwen3_5_text is dense: a model with experts is a qwen3_5_moe_text folder")
        out = super().hf_config(cfg)
        out["model_type"] = self.model_types[0]
        for key in ("num_experts", "mlp_only_layers"):  # not keys of Qwen3.5's dense config
            out.pop(key, None)
        return out

    def attention_from_hf(self, cfg, i, hf, take, out):
        if not cfg.is_linear_layer(i):
            return super().attention_from_hf(cfg, i, hf, take, out)
        a = f"model.layers.{i}.linear_attn."
        out[f"decoder.layers.{i}.self_attention.in_proj.weight"] = np.concatenate(
            [take(a + f"in_proj_{x}.weight") for x in ("qkv", "z", "b", "a")])

    def attention_to_hf(self, cfg, i, ours, out):
        if not cfg.is_linear_layer(i):
            return super().attention_to_hf(cfg, i, ours, out)
        la = cfg.linear_attention
        qkv = 2 * la.key_heads * la.key_dim + la.value_heads * la.value_dim
        parts = np.split(ours[f"decoder.layers.{i}.self_attention.in_proj.weight"],
                         np.cumsum([qkv, la.value_heads * la.value_dim, la.value_heads]))
        for x, t in zip(("qkv", "z", "b", "a"), parts):
            out[f"model.layers.{i}.linear_attn.in_proj_{x}.weight"] = t


class Qwen35Moe(Qwen35):
    name = "qwen3_5_moe"
    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
    architecture = "Qwen3_5MoeForCausalLM"
    aliases = ("qwen3.5-moe",)  # ours, as Qwen35's
    builds = "moe"
    presets = {
        "tiny-qwen3.5-moe": dict(
            Qwen35.presets["tiny-qwen3.5"], family="qwen3_5_moe", ffn_hidden_size=64,  # no dense MLP: the experts
            moe=dict(num_experts=8, topk=2, ffn_hidden_size=64, norm_topk_prob=True, shared_expert_size=64,
                     shared_expert_gate=True)),
    }

    def config_from_hf(self, hf: dict):
        # no dense MLP and no choice of sparse layers: experts everywhere, renormalised
        hf = text_config(hf)
        hf = {**hf, "intermediate_size": hf.get("moe_intermediate_size"), "norm_topk_prob": True,
              "decoder_sparse_step": 1, "mlp_only_layers": []}
        return super().config_from_hf(hf)

    def moe_from_hf(self, hf: dict) -> tuple:
        return Qwen3Next.moe_from_hf(self, hf)

    def hf_config(self, cfg):
        if cfg.moe is None or cfg.moe_layers is not None or not cfg.moe.norm_topk_prob:
            raise CheckpointError("qwen3_5_moe_text has experts in every layer with renormalised top-k weights")
        out = Qwen3Next.hf_config(self, cfg)
        out["model_type"] = self.model_types[0]
        for key in ("intermediate_size", "decoder_sparse_step", "norm_topk_prob", "mlp_only_layers"):
            out.pop(key, None)
        return out


def text_config(hf: dict) -> dict:
    """The text model's config.json of a folder: a wrapper's text_config (its top-level
    tie_word_embeddings the text model's), or the folder's own."""
    if "text_config" not in hf:
        return hf
    text = hf["text_config"]
    if not isinstance(text, dict) or text.get("model_type") not in ("qwen3_5_text", "qwen3_5_moe_text"):
        raise CheckpointError(f"config.json: a {hf.get('model_type')} folder's text_config must be a qwen3_5_text or "
                              f"qwen3_5_moe_text config")
    return {**text, "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}


FAMILY = (Qwen35(), Qwen35Moe())
