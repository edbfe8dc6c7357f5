"""GPT-2: learned positions, LayerNorm with biases, a GELU MLP, Conv1D weights stored [in, out],
one c_attn for q, k and v."""

from __future__ import annotations

import numpy as np

from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.families.base import Family, fuse_qkv, split_qkv

_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# Hugging Face -> our names of each layer's norms and Conv1D projections
_NORMS = (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm"))
_CONV1D = (("attn.c_proj", "self_attention.linear_proj"), ("mlp.c_fc", "mlp.linear_fc1"),
           ("mlp.c_proj", "mlp.linear_fc2"))


class GPT2(Family):
    name = "gpt2"
    architecture = "GPT2LMHeadModel"
    aliases = ("gpt2",)
    presets = {
        "tiny-gpt2": dict(family="gpt2", hidden_size=128, num_layers=4, num_attention_heads=4,
                          normalization="layernorm", activation="gelu_tanh", position_embedding_type="learned",
                          add_qkv_bias=True, add_bias_linear=True, untie_embeddings_and_output_weights=False),
    }

    def config_from_hf(self, hf: dict) -> ModelConfig:
        act = hf.get("activation_function", "gelu_new")
        return ModelConfig(
            family="gpt2", vocab_size=hf["vocab_size"], hidden_size=hf["n_embd"], num_layers=hf["n_layer"],
            num_attention_heads=hf["n_head"], ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"],
            max_position_embeddings=hf["n_positions"], normalization="layernorm",
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), activation=_ACTS.get(act, act),
            position_embedding_type="learned", add_qkv_bias=True, add_bias_linear=True,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True))

    def hf_config(self, cfg: ModelConfig) -> dict:
        return {"model_type": "gpt2", "architectures": [self.architecture], "vocab_size": cfg.vocab_size,
                "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_attention_heads,
                "n_inner": cfg.ffn_hidden_size, "n_positions": cfg.max_position_embeddings,
                "layer_norm_epsilon": cfg.norm_epsilon,
                "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
                "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}

    def body_from_hf(self, cfg, hf, take, out):
        p = "transformer." if any(k.startswith("transformer.") for k in hf) else ""
        out["embedding.word_embeddings.weight"] = take(p + "wte.weight")
        out["embedding.position_embeddings.weight"] = take(p + "wpe.weight")
        for i in range(cfg.num_layers):
            a, b = f"{p}h.{i}.", f"decoder.layers.{i}."
            for hf_n, ours in _NORMS:
                for kind in (".weight", ".bias"):
                    out[b + ours + kind] = take(a + hf_n + kind)
            w, bias = take(a + "attn.c_attn.weight").T, take(a + "attn.c_attn.bias")
            out[b + "self_attention.linear_qkv.weight"] = fuse_qkv(cfg, *np.split(w, 3, axis=0))
            out[b + "self_attention.linear_qkv.bias"] = fuse_qkv(cfg, *np.split(bias, 3, axis=0))
            for hf_n, ours in _CONV1D:
                out[b + ours + ".weight"] = take(a + hf_n + ".weight").T  # GPT-2's Conv1D stores [in, out]
                out[b + ours + ".bias"] = take(a + hf_n + ".bias")
        out["decoder.final_layernorm.weight"] = take(p + "ln_f.weight")
        out["decoder.final_layernorm.bias"] = take(p + "ln_f.bias")

    def body_to_hf(self, cfg, ours, out):
        p = "transformer."
        out[p + "wte.weight"] = ours["embedding.word_embeddings.weight"]
        out[p + "wpe.weight"] = ours["embedding.position_embeddings.weight"]
        for i in range(cfg.num_layers):
            a, b = f"{p}h.{i}.", f"decoder.layers.{i}."
            for hf_n, mine in _NORMS:
                for kind in (".weight", ".bias"):
                    out[a + hf_n + kind] = ours[b + mine + kind]
            q, k, v = split_qkv(cfg, ours[b + "self_attention.linear_qkv.weight"])
            out[a + "attn.c_attn.weight"] = np.ascontiguousarray(np.concatenate([q, k, v]).T)
            out[a + "attn.c_attn.bias"] = np.concatenate(split_qkv(cfg, ours[b + "self_attention.linear_qkv.bias"]))
            for hf_n, mine in _CONV1D:
                out[a + hf_n + ".weight"] = np.ascontiguousarray(ours[b + mine + ".weight"].T)
                out[a + hf_n + ".bias"] = ours[b + mine + ".bias"]
        out[p + "ln_f.weight"] = ours["decoder.final_layernorm.weight"]
        out[p + "ln_f.bias"] = ours["decoder.final_layernorm.bias"]


FAMILY = GPT2()
