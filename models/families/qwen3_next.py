"""Qwen3-Next: a linear-attention hybrid. Three layers in four (layer_types, or every
full_attention_interval-th attending) run gated DeltaNet (models/gated_deltanet.py), the others
gated attention (each query head's output times sigmoid of its own gate, q/k norms, RoPE on a
quarter of each head); every norm holds its weight as an offset from one; the MLPs are Qwen2-MoE's
(softmax-routed experts beside a shared expert with a sigmoid gate).

Its Hugging Face tensors differ from megatron-core's layout in two places, both reordered here:
the query projection holds each head's queries then its gate (``q_proj`` [heads x 2 x head_dim]),
which linear_qkv holds per query group as its heads' queries, their gates, the key, the value;
and the linear layers' ``in_proj_qkvz`` / ``in_proj_ba`` group q, k, v, z and b, a by key head,
which ``in_proj`` holds as q, k, v, z, b, a each over all heads.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mindspeed_core.errors import CheckpointError
from mindspeed_core.models.config import LinearAttentionConfig, ModelConfig
from mindspeed_core.models.families.qwen3 import Qwen3
from mindspeed_core.models.families.qwen3_moe import QwenMoE

LINEAR, FULL = "linear_attention", "full_attention"


class Qwen3Next(QwenMoE, Qwen3):
    name = "qwen3_next"
    architecture = "Qwen3NextForCausalLM"
    aliases = ("qwen3-next",)
    specs = ("qwen3_next_spec",)
    spec_fields = {"attention_output_gate": True}  # its spec's attention is gated (no flag of its own)
    builds = "gpt"  # MindSpeed-LLM's dense gated-DeltaNet models use its spec too; --num-experts builds MoE
    dense = None
    shared_expert = True
    window = None  # layer_types name the token mixers here, not windows
    partial_rotary = True
    expresses = ("hybrid", "norm_offset")
    presets = {
        "tiny-qwen3-next": dict(
            family="qwen3_next", hidden_size=128, num_layers=4, num_attention_heads=4, num_query_groups=2,
            kv_channels=32, ffn_hidden_size=256, qk_layernorm=True, norm_epsilon=1e-6, norm_offset=True,
            rotary_percent=0.25, attention_output_gate=True, linear_layers=(0, 1, 2),
            linear_attention=dict(key_heads=2, value_heads=4, key_dim=32, value_dim=32),
            moe=dict(num_experts=8, topk=2, ffn_hidden_size=64, norm_topk_prob=True, shared_expert_size=64,
                     shared_expert_gate=True)),
        # MindSpeed-LLM's dense gated-DeltaNet models (its qwen3_next spec without experts), shrunk:
        # --full-attention-interval 3, as its 340M script
        "tiny-gated-deltanet": dict(
            family="qwen3_next", hidden_size=128, num_layers=6, num_attention_heads=4, num_query_groups=2,
            kv_channels=32, ffn_hidden_size=352, qk_layernorm=True, norm_epsilon=1e-6, norm_offset=True,
            rotary_percent=0.25, attention_output_gate=True, linear_layers=(0, 1, 3, 4),
            linear_attention=dict(key_heads=2, value_heads=2, key_dim=64, value_dim=64)),
    }

    def moe_from_hf(self, hf: dict) -> tuple:
        if not hf.get("num_experts", 512):  # transformers' default is the 80B's 512 experts
            return None, None  # a dense hybrid (MindSpeed-LLM's gated-DeltaNet models)
        return super().moe_from_hf(hf)

    def config_from_hf(self, hf: dict) -> ModelConfig:
        cfg = super().config_from_hf(hf)
        layers = hf["num_hidden_layers"]
        types = hf.get("layer_types") or [FULL if (i + 1) % hf.get("full_attention_interval", 4) == 0 else LINEAR
                                          for i in range(layers)]
        unknown = sorted(set(types) - {LINEAR, FULL})
        if unknown or len(types) != layers:
            raise CheckpointError(f"config.json: layer_types must name {layers} layers, each {LINEAR} or {FULL}; "
                                  f"got {types}")
        if hf.get("linear_conv_kernel_dim", 4) < 1:
            raise CheckpointError("config.json: linear_conv_kernel_dim must be positive")
        try:
            linear = LinearAttentionConfig(
                key_heads=hf.get("linear_num_key_heads", 16), value_heads=hf.get("linear_num_value_heads", 32),
                key_dim=hf.get("linear_key_head_dim", 128), value_dim=hf.get("linear_value_head_dim", 128),
                conv_kernel=hf.get("linear_conv_kernel_dim", 4))
        except ValueError as exc:
            raise CheckpointError(f"config.json: {exc}") from None
        return dataclasses.replace(cfg, norm_offset=True, attention_output_gate=True, linear_attention=linear,
                                   linear_layers=tuple(i for i, t in enumerate(types) if t == LINEAR))

    def hf_config(self, cfg: ModelConfig) -> dict:
        if not (cfg.norm_offset and cfg.attention_output_gate and cfg.linear_attention is not None):
            raise CheckpointError("qwen3_next's norms hold offsets from one, its attention is gated and it has "
                                  "linear-attention layers: this model lacks one of them")
        if cfg.moe is None:  # dense: Qwen3's writer, no experts
            out = Qwen3.hf_config(self, cfg)
            out.update(num_experts=0, mlp_only_layers=list(range(cfg.num_layers)))
        else:
            out = super().hf_config(cfg)
            out["shared_expert_intermediate_size"] = cfg.moe.shared_expert_size
        la = cfg.linear_attention
        out.update(linear_num_key_heads=la.key_heads, linear_num_value_heads=la.value_heads,
                   linear_key_head_dim=la.key_dim, linear_value_head_dim=la.value_dim,
                   linear_conv_kernel_dim=la.conv_kernel,
                   layer_types=[LINEAR if cfg.is_linear_layer(i) else FULL for i in range(cfg.num_layers)])
        out["partial_rotary_factor"] = cfg.rotary_percent
        return out

    # ---- tensors ----
    def attention_from_hf(self, cfg, i, hf, take, out):
        a, b = f"model.layers.{i}.", f"decoder.layers.{i}.self_attention."
        if cfg.is_linear_layer(i):
            out[b + "in_proj.weight"] = _in_proj(cfg, take(a + "linear_attn.in_proj_qkvz.weight"),
                                                 take(a + "linear_attn.in_proj_ba.weight"))
            return
        g, per, d = _groups(cfg)
        q = take(a + "self_attn.q_proj.weight").reshape(g, per, 2, d, -1)  # per head: its queries, its gate
        k, v = (take(a + f"self_attn.{x}_proj.weight").reshape(g, 1, d, -1) for x in "kv")
        out[b + "linear_qkv.weight"] = np.concatenate([q[:, :, 0], q[:, :, 1], k, v], axis=1).reshape(
            -1, cfg.hidden_size)

    def attention_to_hf(self, cfg, i, ours, out):
        a, b = f"model.layers.{i}.", f"decoder.layers.{i}.self_attention."
        if cfg.is_linear_layer(i):
            qkvz, ba = _hf_in_proj(cfg, ours[b + "in_proj.weight"])
            out[a + "linear_attn.in_proj_qkvz.weight"], out[a + "linear_attn.in_proj_ba.weight"] = qkvz, ba
            return
        g, per, d = _groups(cfg)
        qkv = ours[b + "linear_qkv.weight"].reshape(g, 2 * per + 2, d, -1)
        q = np.stack([qkv[:, :per], qkv[:, per:2 * per]], axis=2)  # [g, per, 2, d, hidden]
        out[a + "self_attn.q_proj.weight"] = q.reshape(-1, cfg.hidden_size)
        out[a + "self_attn.k_proj.weight"] = qkv[:, 2 * per].reshape(-1, cfg.hidden_size)
        out[a + "self_attn.v_proj.weight"] = qkv[:, 2 * per + 1].reshape(-1, cfg.hidden_size)

    def layer_names(self, cfg, i):
        names = super().layer_names(cfg, i)
        if cfg.is_linear_layer(i):
            a, b = f"model.layers.{i}.linear_attn.", f"decoder.layers.{i}.self_attention."
            names.update({a + "conv1d.weight": b + "conv1d.weight", a + "dt_bias": b + "dt_bias",
                          a + "A_log": b + "A_log", a + "norm.weight": b + "out_norm.weight",
                          a + "out_proj.weight": b + "out_proj.weight"})
        return names


def _groups(cfg: ModelConfig) -> tuple[int, int, int]:
    g = cfg.num_query_groups
    return g, cfg.num_attention_heads // g, cfg.kv_channels


def _in_proj(cfg: ModelConfig, qkvz: np.ndarray, ba: np.ndarray) -> np.ndarray:
    """Hugging Face's in_proj_qkvz and in_proj_ba (grouped by key head: q, k, v, z; b, a) as
    in_proj's rows: q, k, v, z, b, a, each over all heads."""
    la, h = cfg.linear_attention, cfg.hidden_size
    r = la.value_heads // la.key_heads
    qkvz = qkvz.reshape(la.key_heads, 2 * la.key_dim + 2 * r * la.value_dim, h)
    q, k, v, z = np.split(qkvz, np.cumsum([la.key_dim, la.key_dim, r * la.value_dim]), axis=1)
    b, a = np.split(ba.reshape(la.key_heads, 2 * r, h), 2, axis=1)
    return np.concatenate([t.reshape(-1, h) for t in (q, k, v, z, b, a)])


def _hf_in_proj(cfg: ModelConfig, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    la, h = cfg.linear_attention, cfg.hidden_size
    r, n = la.value_heads // la.key_heads, la.key_heads
    qk, v = n * la.key_dim, la.value_heads * la.value_dim
    q, k, vv, z, b, a = np.split(rows, np.cumsum([qk, qk, v, v, la.value_heads]))
    qkvz = np.concatenate([q.reshape(n, la.key_dim, h), k.reshape(n, la.key_dim, h),
                           vv.reshape(n, r * la.value_dim, h), z.reshape(n, r * la.value_dim, h)], axis=1)
    ba = np.concatenate([b.reshape(n, r, h), a.reshape(n, r, h)], axis=1)
    return qkvz.reshape(-1, h), ba.reshape(-1, h)


FAMILY = Qwen3Next()
