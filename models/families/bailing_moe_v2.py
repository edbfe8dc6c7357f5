"""Ling-V2 (inclusionAI's BailingMoeV2: Ling-mini/flash-2.0, Ring; MindSpeed-LLM's bailing_mini).
Its modelling code lives outside transformers, in the folders themselves; read from it (the
Ling-V2 repository's modeling_bailing_moe_v2.py), the model is GLM-4.5's under other names:

- grouped-query attention whose q, k and v come from one ``attention.query_key_value`` (all
  query heads, then all key heads, then all value heads), biased with ``use_qkv_bias``; the
  output ``attention.dense``, biased with ``use_bias``; RMSNorms per head on q and k before
  RoPE (``query_layernorm`` / ``key_layernorm``, ``use_qk_norm``); RoPE in halves on the first
  ``partial_rotary_factor`` of each head's features (all of them when the key is absent);
- the first ``first_k_dense_replace`` layers dense, then ``num_experts`` experts chosen by
  float32 sigmoid scores steered by ``mlp.gate.expert_bias``, within the best ``topk_group``
  of ``n_group`` groups (a group scored by its two best), weights renormalised (the code always
  does, over more than one expert) and times ``routed_scaling_factor``, beside
  ``num_shared_experts`` ungated shared experts;
- ``model.word_embeddings``; multi-token prediction layers after the last one
  (``num_nextn_predict_layers``: ``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm``).

So this family reads a Ling-V2 folder as a GLM-4.5 one (models/families/glm4_moe.py): its
config.json keys and tensor names are translated, the rest is GLM-4.5's reader and writer.
``model_type`` is ``bailing_moe``, which Ling-V1's folders (BailingMoeForCausalLM, another
architecture) share: those are refused.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from mindspeed_core import features
from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.families.glm4_moe import GLM4MoE

# config.json: Ling-V2's key -> GLM-4.5's
CONFIG_KEYS = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts",
               "use_qkv_bias": "attention_bias"}
CONFIG_KEYS_BACK = {glm: ling for ling, glm in CONFIG_KEYS.items()}
# tensors inside a layer: Ling-V2's name -> GLM-4.5's (q/k/v fused apart: _unpack / _pack)
LAYER_NAMES = {"attention.dense.": "self_attn.o_proj.", "attention.query_layernorm.": "self_attn.q_norm.",
               "attention.key_layernorm.": "self_attn.k_norm.", "mlp.gate.expert_bias": "mlp.gate.e_score_correction_bias",
               "final_layernorm.": "shared_head.norm."}
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


class LingV2(GLM4MoE):
    name = "bailing_moe_v2"
    model_types = ("bailing_moe",)
    architecture = "BailingMoeV2ForCausalLM"
    aliases = ("bailing_mini",)
    specs = ()  # MindSpeed-LLM's bailing_spec is Qwen3's layer (qwen3_moe.py), which reads these folders too
    presets = {
        # Ling-mini-2.0's layer, scaled: q/k norms, RoPE on half of each head, a dense first layer,
        # then top-2 of 8 experts in the best 2 of 4 groups by sigmoid with the expert bias,
        # renormalised and scaled, beside a shared expert
        "tiny-ling-v2": dict(family="bailing_moe_v2", hidden_size=128, num_layers=3, num_attention_heads=4,
                             num_query_groups=2, kv_channels=32, ffn_hidden_size=352, qk_layernorm=True,
                             rotary_percent=0.5, rotary_base=600000.0, moe_layers=(1, 2),
                             moe=dict(num_experts=8, topk=2, ffn_hidden_size=96, score_function="sigmoid",
                                      scaling_factor=2.5, enable_expert_bias=True, load_balancing_type="none",
                                      num_groups=4, group_topk=2, aux_loss_coeff=0.0, shared_expert_size=96)),
    }

    def config_from_hf(self, hf: dict) -> ModelConfig:
        if "BailingMoeV2ForCausalLM" not in (hf.get("architectures") or ["BailingMoeV2ForCausalLM"]):
            raise CheckpointError(f"config.json: model_type bailing_moe with architectures {hf.get('architectures')}: "
                                  f"Ling-V2's folders (BailingMoeV2ForCausalLM) are read, Ling-V1's are not")
        if hf.get("use_bias"):
            raise CheckpointError("config.json: use_bias (a bias on Ling-V2's attention output) is not supported")
        glm = {CONFIG_KEYS.get(k, k): v for k, v in hf.items()}
        # its code: every rotary feature without the key, q/k norms on by default, the top-k
        # renormalised whenever it is more than one, an expert bias always
        glm["partial_rotary_factor"] = hf.get("partial_rotary_factor", 1.0)
        glm["use_qk_norm"] = hf.get("use_qk_norm", True)
        glm["norm_topk_prob"] = hf.get("num_experts_per_tok", 8) > 1
        glm["first_k_dense_replace"] = hf.get("first_k_dense_replace", 1)
        glm["n_group"], glm["topk_group"] = hf.get("n_group") or None, hf.get("topk_group") or None
        glm.pop("topk_method", None), glm.pop("scoring_func", None)
        if hf.get("score_function", "sigmoid") != "sigmoid":
            raise CheckpointError(f"config.json: score_function {hf['score_function']!r}: Ling-V2's router scores by "
                                  f"sigmoid")
        return dataclasses.replace(super().config_from_hf(glm), family=self.name)

    def hf_config(self, cfg: ModelConfig) -> dict:
        glm = super().hf_config(cfg)
        moe = cfg.moe
        if moe is not None and (moe.norm_topk_prob != (moe.topk > 1)):
            raise CheckpointError("Ling-V2 renormalises the chosen experts' weights whenever there is more than one: "
                                  "this model does not")
        out = {CONFIG_KEYS_BACK.get(k, k): v for k, v in glm.items()}
        out.update(model_type="bailing_moe", partial_rotary_factor=cfg.rotary_percent, use_bias=False,
                   rope_scaling=cfg.rope_scaling or None, use_rmsnorm=True, score_function="sigmoid",
                   moe_router_enable_expert_bias=moe is not None)
        out.pop("rope_parameters", None)
        if moe is not None:  # Ling-V2 writes 0 for no groups
            out["n_group"], out["topk_group"] = moe.num_groups or 0, moe.group_topk or 0
        return out

    # ---- tensors: GLM-4.5's reader and writer on translated names ----
    def tensors_in(self, cfg: ModelConfig, hf: dict) -> dict:
        """A Ling-V2 folder's tensors by GLM-4.5's names: attention.query_key_value (all q heads,
        then k, then v) as q/k/v projections, the other names translated."""
        features.note_used("family-ling-v2")
        d, heads, groups = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
        out = {}
        for name, value in hf.items():
            match = LAYER.match(name)
            if not match:
                out[name.replace("model.word_embeddings.", "model.embed_tokens.")] = value
                continue
            layer, rest = f"model.layers.{match.group(1)}.", match.group(2)
            if rest.startswith("attention.query_key_value."):
                if value.shape[0] != (heads + 2 * groups) * d:
                    raise CheckpointError(f"{name} has {value.shape[0]} rows; {heads} query and {groups} key/value "
                                          f"heads of {d} features need {(heads + 2 * groups) * d}")
                kind = rest.rsplit(".", 1)[1]
                for x, t in zip("qkv", np.split(value, [heads * d, (heads + groups) * d])):
                    out[f"{layer}self_attn.{x}_proj.{kind}"] = t
                continue
            out[layer + _renamed(rest, LAYER_NAMES)] = value
        return out

    def tensors_out(self, cfg: ModelConfig, out: dict) -> dict:
        """GLM-4.5's names written back as Ling-V2's (q/k/v fused again; its multi-token
        prediction layers carry no copies of the embedding and the output layer)."""
        features.note_used("family-ling-v2")
        back, packed = {glm: theirs for theirs, glm in LAYER_NAMES.items()}, {}
        for name, value in out.items():
            match = LAYER.match(name)
            if not match:
                packed[name.replace("model.embed_tokens.", "model.word_embeddings.")] = value
                continue
            layer, rest = f"model.layers.{match.group(1)}.", match.group(2)
            if rest in ("embed_tokens.weight", "shared_head.head.weight") or rest.startswith(("self_attn.k_proj.",
                                                                                              "self_attn.v_proj.")):
                continue
            if rest.startswith("self_attn.q_proj."):
                kind = rest.rsplit(".", 1)[1]
                packed[f"{layer}attention.query_key_value.{kind}"] = np.concatenate(
                    [out[f"{layer}self_attn.{x}_proj.{kind}"] for x in "qkv"])
                continue
            packed[layer + _renamed(rest, back)] = value
        return packed


def _renamed(rest: str, names: dict) -> str:
    """A layer's tensor name with the first of ``names``' prefixes it starts with replaced."""
    for old, new in names.items():
        if rest.startswith(old):
            return new + rest[len(old):]
    return rest


FAMILY = LingV2()
