"""Phi-3.5-MoE (transformers' phimoe): separate q/k/v projections with biases on them and on o,
LayerNorm with biases, an output layer with a bias, LongRoPE with explicit short and long
mscales, and in every layer sixteen Mixtral-style experts (w1, w3, w2) routed by SparseMixer
(models/router.py sparsemixer: top-2, each weight its own thresholded softmax, no balancing loss).

Past original_max_position_embeddings we take the long factors, as LongRoPE, the Phi-3.5-MoE
release's own modelling code and MindSpeed-LLM do; transformers 5's PhimoeRotaryEmbedding keeps
the short factors there (it switches only the mscale), so its logits differ from ours past that
length, and the tests compare within it."""

from __future__ import annotations

import dataclasses

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import MoEConfig
from mindspeed_core.models.families.base import LlamaLike
from mindspeed_core.models.families.mixtral import moe_sizes_of


class PhiMoE(LlamaLike):
    name = "phimoe"
    architecture = "PhimoeForCausalLM"
    aliases = ("phi3.5-moe",)
    also_named = ("phi3.5",)  # MindSpeed-LLM's Phi-3.5-MoE pretraining line: --model-type-hf phi3.5
    specs = ("phi35_moe_spec",)
    builds, experts = "moe", True
    window = "every"
    one_attention_bias = True
    peft_export = False
    presets = {
        "tiny-phimoe": dict(family="phimoe", hidden_size=128, num_layers=4, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=256, normalization="layernorm", add_qkv_bias=True,
                            attention_output_bias=True, output_layer_bias=True,
                            untie_embeddings_and_output_weights=True,
                            moe=dict(num_experts=8, topk=2, load_balancing_type="sparsemixer_topk",
                                     norm_topk_prob=False)),
    }

    def config_from_hf(self, hf: dict):
        cfg = super().config_from_hf(hf)
        return dataclasses.replace(cfg, normalization="layernorm", norm_epsilon=hf.get("rms_norm_eps", 1e-5),
                                   output_layer_bias=bool(hf.get("lm_head_bias")))

    def moe_from_hf(self, hf: dict) -> tuple:
        topk, experts = moe_sizes_of(hf)
        if topk != 2:
            raise CheckpointError(f"config.json: num_experts_per_tok {topk}: SparseMixer routes each token to 2 "
                                  f"experts")
        return MoEConfig(num_experts=experts, topk=2, ffn_hidden_size=hf["intermediate_size"], norm_topk_prob=False,
                         load_balancing_type="sparsemixer_topk",
                         sparsemixer_eps=float(hf.get("router_jitter_noise", 0.01)),
                         # the released folders' 0.01: training's noise (transformers applies it only then)
                         input_jitter_eps=float(hf.get("input_jitter_noise") or 0.0)), None

    def hf_config(self, cfg):
        out = super().hf_config(cfg)
        moe = cfg.moe
        if (cfg.normalization != "layernorm" or moe is None or not moe.sparsemixer or cfg.moe_layers is not None
                or moe.shared_expert_size or moe.capacity_factor is not None):
            raise CheckpointError("phimoe has LayerNorm, and in every layer experts routed by SparseMixer without a "
                                  "shared expert or capacity")
        if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") != "longrope":
            raise CheckpointError(f"phimoe's RoPE scaling is longrope only, not {cfg.rope_scaling.get('rope_type')}")
        if cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size:  # the default width: as its folders
            del out["head_dim"]
        out.update(num_local_experts=moe.num_experts, num_experts_per_tok=2, intermediate_size=moe.ffn_hidden_size
                   or cfg.ffn_hidden_size, router_jitter_noise=moe.sparsemixer_eps,
                   input_jitter_noise=moe.input_jitter_eps,
                   lm_head_bias=cfg.output_layer_bias, output_router_logits=False,
                   # transformers' defaults name ids past a small vocabulary
                   pad_token_id=None, bos_token_id=None, eos_token_id=None)
        if cfg.rope_scaling:
            out["original_max_position_embeddings"] = cfg.rope_scaling.get("original_max_position_embeddings",
                                                                           cfg.max_position_embeddings)
        return out

    def moe_names(self, cfg, i):
        return f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")

    def layer_names(self, cfg, i):
        a, b = f"model.layers.{i}.", f"decoder.layers.{i}."
        return {**super().layer_names(cfg, i), a + "input_layernorm.bias": b + "input_layernorm.bias",
                a + "post_attention_layernorm.bias": b + "pre_mlp_layernorm.bias"}

    def body_from_hf(self, cfg, hf, take, out):
        super().body_from_hf(cfg, hf, take, out)
        out["decoder.final_layernorm.bias"] = take("model.norm.bias")

    def body_to_hf(self, cfg, ours, out):
        super().body_to_hf(cfg, ours, out)
        out["model.norm.bias"] = ours["decoder.final_layernorm.bias"]


FAMILY = PhiMoE()
