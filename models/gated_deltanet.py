"""Gated DeltaNet: linear attention with a gated delta-rule state (Yang, Kautz and Hatamizadeh,
2024), the linear layers of Qwen3-Next, Qwen3.5 and MindSpeed-LLM's gated-DeltaNet models,
written against the facade.

Each value head keeps a state S [dk, dv] that the queries read and every token corrects:

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,     o_t = S_t^T q_t / sqrt(dk)

with q, k L2-normalised, a_t = exp(g_t) in (0, 1] the decay (g = -exp(A_log) softplus(alpha +
dt_bias)) and beta_t = sigmoid(b_t) in (0, 1) how strongly the token overwrites what the state
predicted for its key. ``chunk_rule`` computes it for training: inside a chunk of C tokens the
corrections are one unit-lower-triangular solve (the WY / UT representation), across chunks the
state is carried (one step per chunk). ``recurrent_rule`` computes it a token at a time, for
decoding. The two give the same values (tests/test_gated_deltanet.py, on both frameworks).

The layer around it (megatron-core's GatedDeltaNet, its parameter names): ``in_proj`` makes
q, k, v (all heads), then the output gate z, then b and alpha per value head; q, k, v go
through a short causal depthwise convolution ``conv1d`` with SiLU; the output is RMS-normed
per head (``out_norm``), times SiLU(z), and projected back by ``out_proj``.
"""

from __future__ import annotations

import math

import numpy as np

from mindspeed_core import features, nn, ops
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.memory import recompute
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.layers import Linear, RMSNorm, _param, repeat_heads

L2_EPS = 1e-6  # inside the square root of q's and k's norms (as the FLA kernels and transformers)


def l2_normalized(x):
    """x / sqrt(sum(x^2) + eps) over the last dimension."""
    return x * ops.rsqrt(ops.sum(x * x, dim=-1, keepdim=True) + L2_EPS)


def softplus(x):
    """log(1 + e^x), without overflow for large x."""
    return ops.relu(x) + ops.log(1.0 + ops.exp(-ops.abs(x)))


def _heads_first(*xs):
    """[b, s, h, ...] -> [b, h, s, ...] in float32."""
    return [ops.cast(ops.transpose(x, 1, 2), "float32") for x in xs]


def recurrent_rule(q, k, v, g, beta, state=None):
    """The delta rule a token at a time. q, k [b, s, h, dk] (normalised), v [b, s, h, dv], g, beta
    [b, s, h]; ``state`` [b, h, dk, dv] or None (zeros). Returns (o [b, s, h, dv] float32, the
    final state)."""
    features.note_used("gated-deltanet")
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    b, h, s, dk = k.shape
    q = q * (1.0 / math.sqrt(dk))
    if state is None:
        state = ops.zeros((b, h, dk, v.shape[-1]))
    outs = []
    for t in range(s):
        state = state * ops.unsqueeze(ops.unsqueeze(ops.exp(g[:, :, t]), -1), -1)
        k_t = ops.unsqueeze(k[:, :, t], -1)  # [b, h, dk, 1]
        predicted = ops.sum(state * k_t, dim=-2)  # S^T k: [b, h, dv]
        delta = (v[:, :, t] - predicted) * ops.unsqueeze(beta[:, :, t], -1)
        state = state + k_t * ops.unsqueeze(delta, -2)
        outs.append(ops.sum(state * ops.unsqueeze(q[:, :, t], -1), dim=-2))
    return ops.transpose(ops.stack(outs, dim=2), 1, 2), state


def chunk_rule(q, k, v, g, beta, chunk_size: int = 64, state=None, final_state: bool = True):
    """The delta rule by chunks of ``chunk_size`` tokens (recurrent_rule's arguments and
    results; without ``final_state`` the state after the last chunk is not computed: None). The
    sequence is padded to whole chunks with tokens that change nothing (k = v = 0, no decay) and
    the padding's outputs dropped."""
    features.note_used("gated-deltanet")
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    b, h, s, dk = k.shape
    dv, c = v.shape[-1], chunk_size
    q = q * (1.0 / math.sqrt(dk))
    pad = -s % c
    if pad:
        def padded(x):
            return ops.cat([x, ops.zeros((*x.shape[:2], pad, *x.shape[3:]))], dim=2)

        q, k, v, g, beta = (padded(x) for x in (q, k, v, g, beta))
    n = (s + pad) // c

    def chunked(x):
        return ops.reshape(x, (b, h, n, c, *x.shape[3:]))

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    decay = ops.cumsum(g, dim=-1)  # log of the decay from the chunk's start to each token
    future = ops.tensor(np.triu(np.ones((c, c), dtype=bool), 1))
    # exp(decay_i - decay_j) for j <= i: the decay between token j and token i of a chunk
    between = ops.exp(ops.masked_fill(ops.unsqueeze(decay, -1) - ops.unsqueeze(decay, -2), future, -math.inf))
    k_beta, v_beta = k * ops.unsqueeze(beta, -1), v * ops.unsqueeze(beta, -1)
    kt = ops.transpose(k, -1, -2)
    # the corrections inside a chunk: (I + strictly_lower(beta_i k_i.k_j a_ij)) [u w] = [beta v, beta k e^decay]:
    # u what each token writes before the carried state's share, w what it reads of it (one solve
    # for both; the solve reads only the strictly lower part)
    solved = ops.solve_unit_lower(ops.matmul(k_beta, kt) * between,
                                  ops.cat([v_beta, k_beta * ops.unsqueeze(ops.exp(decay), -1)], dim=-1))
    u, w = ops.split(solved, [dv, dk], dim=-1)
    inside = ops.matmul(q, kt) * between  # causal, decayed q.k inside the chunk
    q_decayed = q * ops.unsqueeze(ops.exp(decay), -1)
    last = decay[..., -1:]  # [b, h, n, 1]
    k_to_end = k * ops.unsqueeze(ops.exp(last - decay), -1)
    if state is None:
        state = ops.zeros((b, h, dk, dv))
    outs = []
    for i in range(n):
        written = u[:, :, i] - ops.matmul(w[:, :, i], state)
        outs.append(ops.matmul(q_decayed[:, :, i], state) + ops.matmul(inside[:, :, i], written))
        if i == n - 1 and not final_state:  # nothing reads it: not even saved for backward
            state = None
            break
        state = state * ops.unsqueeze(ops.exp(last[:, :, i]), -1) + \
            ops.matmul(ops.transpose(k_to_end[:, :, i], -1, -2), written)
    o = ops.reshape(ops.stack(outs, dim=2), (b, h, n * c, dv))
    if pad:
        o = o[:, :, :s]
    return ops.transpose(o, 1, 2), state


def causal_conv(x, weight, history=None):
    """Depthwise causal convolution over the sequence: x [b, s, channels], weight [channels, 1,
    K] (torch's Conv1d layout, as megatron-core and transformers store it); each output sees its
    own and the K - 1 earlier inputs (``history`` [b, K - 1, channels] before the first, default
    zeros). Returns (the output [b, s, channels], the last K - 1 inputs: the next call's history)."""
    b, s, channels = x.shape
    width = weight.shape[-1]
    if history is None:
        history = ops.zeros((b, width - 1, channels), dtype=ops.dtype_of(x))
    extended = ops.cat([history, x], dim=1)
    out = None
    for j in range(width):
        term = extended[:, j:j + s] * weight[:, 0, j]
        out = term if out is None else out + term
    return out, extended[:, s:]


def _one_document_a_row(documents) -> None:
    """The state runs along the whole row: a row may hold one document and padding after it
    (a fine-tuning sample: causal layers leave the document's outputs as they are), not several."""
    documents = np.asarray(documents)
    kept = np.where(documents >= 0, documents, documents.max(initial=0))
    if (kept.min(axis=1) != kept.max(axis=1)).any():
        raise MindSpeedError("gated DeltaNet layers carry their state along the whole row: rows packing several "
                             "documents (--reset-attention-mask, packed fine-tuning data) are not built for them; "
                             "use one document a row")


class CausalConv1d(nn.Module):
    """The depthwise convolution's weight [channels, 1, K] (megatron-core's conv1d.weight)."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = _param((channels, 1, width), std=1.0 / math.sqrt(width))


class GatedDeltaNet(nn.Module):
    """A gated DeltaNet layer in place of self-attention (megatron-core's names). Decoding with a
    cache keeps each layer's convolution history and delta-rule state in it."""

    layer_number = 0  # the layer's global number (its slot in a cache); set by Decoder
    # what to recompute in backward (GPTModel.use_memory): selective recomputes the delta rule, as it
    # does attention's core
    recompute_policy = recompute.NONE
    tp_shards = 1  # tensor parallelism: this rank holds 1/tp_shards of the heads (parallel/layers.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        la = cfg.linear_attention
        self.cfg, self.la = cfg, la
        self.qk_dim, self.v_dim = la.key_heads * la.key_dim, la.value_heads * la.value_dim
        self.conv_dim = 2 * self.qk_dim + self.v_dim
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.in_proj = Linear(cfg.hidden_size, self.conv_dim + self.v_dim + 2 * la.value_heads, False,
                              cfg.init_method_std)
        self.conv1d = CausalConv1d(self.conv_dim, la.conv_kernel)
        self.dt_bias = _param((la.value_heads,), value=1.0)
        # decay rates A from 1 to 16 (megatron-core draws them in that range)
        self.A_log = nn.Parameter(np.log(np.linspace(1.0, 16.0, la.value_heads)).astype(np.float32))
        self.out_norm = RMSNorm(la.value_dim, cfg.norm_epsilon, "rms_norm" in cfg.fused)
        self.out_proj = Linear(self.v_dim, cfg.hidden_size, False, out_std)

    def forward(self, x, cos=None, sin=None, seams=None, tokens=None):
        """x [b, s, hidden] -> [b, s, hidden]. Positions come from the order of the tokens (no
        RoPE); packed sequences are refused by the trainer's configuration. With a generation
        cache (``tokens.cache``) the state continues from the cache's and is written back;
        padding on the left (``tokens.documents`` 0) is zeroed first, so it changes no state."""
        features.note_used("gated-deltanet")
        if "gated_delta_rule" in self.cfg.fused:  # --use-triton-gdn: its kernels are not bound, the same rule runs
            features.note_used("triton-gdn")
        la, t = self.la, self.tp_shards
        key_heads, value_heads = la.key_heads // t, la.value_heads // t  # this rank's
        qk_dim, v_dim = key_heads * la.key_dim, value_heads * la.value_dim
        cache = None if tokens is None else tokens.cache
        if cache is None and tokens is not None and tokens.documents is not None:
            _one_document_a_row(tokens.documents)
        if cache is not None and tokens.documents is not None:
            x = x * ops.unsqueeze(ops.cast(ops.tensor(np.asarray(tokens.documents)[:, -x.shape[1]:] != 0),
                                           ops.dtype_of(x)), -1)
        history, state = (None, None) if cache is None else cache.linear_state(self.layer_number)
        projected = self.in_proj(x)
        b, s = projected.shape[0], projected.shape[1]  # the whole sequence, also under sequence parallelism
        qkv, z, beta, alpha = ops.split(projected, [2 * qk_dim + v_dim, v_dim, value_heads, value_heads], dim=-1)
        qkv, history = causal_conv(qkv, self.conv1d.weight, history)
        qkv = ops.silu(qkv)
        q, k, v = ops.split(qkv, [qk_dim, qk_dim, v_dim], dim=-1)
        q = l2_normalized(ops.cast(ops.reshape(q, (b, s, key_heads, la.key_dim)), "float32"))
        k = l2_normalized(ops.cast(ops.reshape(k, (b, s, key_heads, la.key_dim)), "float32"))
        v = ops.reshape(v, (b, s, value_heads, la.value_dim))
        per_key = la.value_heads // la.key_heads
        q, k = repeat_heads(q, per_key), repeat_heads(k, per_key)  # each serves per_key consecutive value heads
        g = ops.neg(ops.exp(ops.cast(self.A_log, "float32"))) * softplus(ops.cast(alpha, "float32")
                                                                          + ops.cast(self.dt_bias, "float32"))
        beta = ops.sigmoid(ops.cast(beta, "float32"))
        if cache is None:  # training, scoring: the outputs only
            out = self.recompute_policy.attention(lambda *a: chunk_rule(*a, la.chunk_size, final_state=False)[0],
                                                  q, k, v, g, beta)
        elif s == 1 and state is not None:
            out, state = recurrent_rule(q, k, v, g, beta, state)
        else:
            out, state = chunk_rule(q, k, v, g, beta, la.chunk_size, state)
        if cache is not None:
            cache.keep_linear_state(self.layer_number, history, state)
        out = ops.reshape(out, (b * s * value_heads, la.value_dim))
        gate = ops.reshape(ops.cast(z, "float32"), (b * s * value_heads, la.value_dim))
        normed = self.out_norm(ops.cast(out, ops.dtype_of(self.out_norm.weight)))
        out = ops.cast(ops.cast(normed, "float32") * ops.silu(gate), ops.dtype_of(x))
        return self.out_proj(ops.reshape(out, (b, s, v_dim)))

