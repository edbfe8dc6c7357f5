"""Basic layers written against the facade: the same code runs on PyTorch and MindSpore.

Parameter names follow Megatron-core (``weight``/``bias`` under mcore module names), so
checkpoints map onto mcore layouts without renaming tables inside the model.
"""

from __future__ import annotations

import functools

import numpy as np

from mindspeed_core import composite, features, nn, ops
from mindspeed_core.models.config import GATED_ACTIVATIONS


def _param(shape, std=None, value=None):
    p = nn.Parameter(np.zeros(shape, np.float32))
    if std is not None:
        nn.init.normal_(p, std=std)
    elif value is not None:
        nn.init.constant_(p, value)
    return p


class Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int, bias: bool, std: float):
        super().__init__()
        self.weight = _param((n_out, n_in), std=std)
        self.bias = _param((n_out,), value=0.0) if bias else None

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, std: float):
        super().__init__()
        self.weight = _param((num, dim), std=std)

    def forward(self, ids):
        return ops.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """With ``offset`` (Gemma) the weight is held as an offset from one, starts at zero, and
    the norm is computed and scaled in float32 before the cast back, as Gemma does."""

    def __init__(self, dim: int, eps: float, fused: bool = False, offset: bool = False, weight_float32: bool = False):
        """``weight_float32`` (--rmsnorm-weight-in-fp32): the normed input times the weight in
        float32, cast to the input's dtype after (as the offset form always is)."""
        super().__init__()
        self.eps, self.fused, self.offset, self.weight_float32 = eps, fused, offset, weight_float32
        self.weight = _param((dim,), value=0.0 if offset else 1.0)

    def forward(self, x):
        # a float32 weight (--init-norm-weight-in-fp32) on a 16-bit input computes as --rmsnorm-weight-in-fp32
        if (self.weight_float32 or ops.dtype_of(self.weight) != ops.dtype_of(x)) and not self.offset \
                and ops.dtype_of(x) != "float32":
            norm = ops.rms_norm if self.fused else composite.rms_norm
            return ops.cast(norm(ops.cast(x, "float32"), ops.cast(self.weight, "float32"), self.eps), ops.dtype_of(x))
        if self.offset:
            weight = ops.cast(self.weight, "float32") + 1.0
            norm = ops.rms_norm if self.fused else composite.rms_norm
            if self.fused:
                features.note_used("fused-rmsnorm")
            return ops.cast(norm(ops.cast(x, "float32"), weight, self.eps), ops.dtype_of(x))
        if not self.fused:
            return composite.rms_norm(x, self.weight, self.eps)
        features.note_used("fused-rmsnorm")
        return ops.rms_norm(x, self.weight, self.eps)


class HeadsRMSNorm(nn.Module):
    """RMSNorm over all heads of a projection at once (MiniMax-M2's q/k norms): x [b, s, heads, d]
    divided by the root mean square over heads x d features, times a weight of heads x d, in
    float32 as transformers computes it. Under tensor parallelism each rank holds some heads and
    their weights; ``sum_over_heads`` completes the sum of squares over the other ranks' heads."""

    def __init__(self, heads: int, dim: int, eps: float):
        super().__init__()
        self.eps, self.width = eps, heads * dim  # the mean is over the whole layer's width
        self.weight = _param((heads * dim,), value=1.0)

    def forward(self, x, sum_over_heads=lambda t: t):
        features.note_used("family-minimax-m2")
        b, s, heads, d = x.shape
        flat = ops.cast(ops.reshape(x, (b, s, heads * d)), "float32")
        squares = sum_over_heads(ops.sum(flat * flat, dim=-1, keepdim=True))
        normed = flat * ops.rsqrt(squares / self.width + self.eps)
        out = ops.cast(normed, ops.dtype_of(x)) * self.weight  # transformers' order: cast, then scale
        return ops.reshape(ops.cast(out, ops.dtype_of(x)), (b, s, heads, d))  # a float32 weight's too


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), value=1.0)
        self.bias = _param((dim,), value=0.0)

    def forward(self, x):
        # no switch, as in Megatron (LayerNorm is always its fused kernel where there is one)
        features.note_used("fused-layernorm")
        if ops.dtype_of(self.weight) != ops.dtype_of(x):  # float32 weights on a 16-bit input
            return ops.cast(ops.layer_norm(ops.cast(x, "float32"), self.weight, self.bias, self.eps), ops.dtype_of(x))
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


NORMS = (RMSNorm, HeadsRMSNorm, LayerNorm)


def norm_parameters(module) -> list:
    """[(dotted name, the norm holding it, its attribute)] of every norm weight and bias in ``module``."""
    out = []
    for name, _ in nn.named_parameters(module):
        *path, attr = name.split(".")
        owner = module
        for part in path:
            owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
        if isinstance(owner, NORMS):
            out.append((name, owner, attr))
    return out


def repeat_heads(x, times: int):
    """x [b, s, h, d] -> [b, s, h * times, d], each head repeated ``times`` times side by side
    (head i of the result is head i // times of x); autograd sums the copies' gradients."""
    if times == 1:
        return x
    b, s, h, d = x.shape
    return ops.reshape(ops.expand(ops.unsqueeze(x, 3), (b, s, h, times, d)), (b, s, h * times, d))


def activate(h, activation: str, fused_swiglu: bool = False, clamp: float | None = None, offset: float = 0.0):
    """The MLP activation of fc1's output: the gated ones take gate columns, then up columns
    (mcore's fc1 layout) and return act(gate) * up; with ``clamp`` (GPT-OSS) the gate is cut
    from above and up on both sides first, and ``offset`` is added to up."""
    if activation == "swiglu" and clamp is None and not offset:
        if fused_swiglu:
            features.note_used("fused-swiglu")
            return ops.swiglu(h)
        return composite.swiglu(h)
    approximate = "tanh" if activation.endswith("_tanh") else "none"
    if activation in GATED_ACTIVATIONS:
        gate, up = ops.chunk(h, 2, dim=-1)
        if clamp is not None:
            gate, up = ops.clamp(gate, max=clamp), ops.clamp(up, min=-clamp, max=clamp)
        if activation == "swiglu":
            gate = ops.silu(gate)
        elif activation == "quick_geglu":  # the sigmoid approximation of GELU
            gate = gate * ops.sigmoid(gate * 1.702)
        else:
            gate = ops.gelu(gate, approximate=approximate)
        return gate * (up + offset) if offset else gate * up
    if activation == "squared_relu":
        features.note_used("squared-relu")
        r = ops.relu(h)
        return r * r
    return ops.gelu(h, approximate=approximate)


def mlp_activation(cfg, fused_swiglu: bool = False):
    """``activate`` with the configured activation, clamp and offset: h -> act(h)."""
    return functools.partial(activate, activation=cfg.activation, fused_swiglu=fused_swiglu,
                             clamp=cfg.activation_func_clamp_value, offset=cfg.glu_linear_offset)


def make_norm(cfg, dim: int):
    """The configured normalisation over ``dim`` features."""
    if cfg.normalization == "rmsnorm":
        return RMSNorm(dim, cfg.norm_epsilon, "rms_norm" in cfg.fused, cfg.norm_offset, cfg.norm_weight_float32)
    return LayerNorm(dim, cfg.norm_epsilon)
