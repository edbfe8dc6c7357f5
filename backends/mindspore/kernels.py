"""Hand-written forward and backward of the hot composites, for MindSpore devices without a
native kernel (the CPU).

The reference composites in ``mindspeed_core.composite`` are right on MindSpore but slow
there, for reasons measured on 2 cores (docs/benchmarks.md has the step times they give):

- an elementwise op with a broadcast operand costs 10-20x the same op on full tensors
  ([2048, 8192] * [2048, 1]: 244 ms against 14 ms; tiling the small operand first: 23 ms),
  and MindSpore's automatic backward of mean, softmax and every broadcast op does exactly
  that;
- ``ops.cross_entropy`` takes 1.1 s forward and backward on [2048, 8192] logits;
- grouped-query attention expands keys and values to every query head before the matmuls.

So each op here is a Cell with its own ``bprop``: the backward is written out once, every
broadcast operand is tiled to full shape, and attention multiplies each key/value head with
its group of query heads stacked along the rows (no copy of keys or values). The conformance
suite checks values and gradients against the reference composites.
"""

from __future__ import annotations

import math

import mindspore as ms
from mindspore import ops as P

from mindspeed_core import composite

_bmm_nt = P.BatchMatMul(transpose_b=True)
_bmm_tn = P.BatchMatMul(transpose_a=True)
_bmm = P.BatchMatMul()
_F32 = ms.float32


def tile_to(x, shape):
    """``x`` repeated to ``shape`` (same rank, each size dividing): full-size operands for the
    CPU's elementwise kernels."""
    reps = tuple(t // s for t, s in zip(shape, x.shape))
    return x if all(r == 1 for r in reps) else P.tile(x, reps)


def _lead(x, rank):
    return P.reshape(x, (1,) * (rank - x.ndim) + tuple(x.shape))


# ---- cross entropy ---------------------------------------------------------------------------

class _CrossEntropy(ms.nn.Cell):
    """Per-row -log softmax(logits)[target]; rows whose target is ``ignore`` give 0."""

    def __init__(self, ignore: int):
        super().__init__()
        self.ignore = ignore

    def construct(self, logits, target):
        keep = P.ne(target, self.ignore)
        safe = P.select(keep, target, P.zeros_like(target))
        self.log_probs = P.log_softmax(logits.astype(_F32), -1)
        self.keep, self.safe = keep.astype(_F32), P.reshape(safe, (-1, 1))
        picked = P.reshape(P.gather_elements(self.log_probs, 1, self.safe), (-1,))
        return -picked * self.keep

    def bprop(self, logits, target, out, dout):
        rows, classes = logits.shape
        scale = P.reshape(dout.astype(_F32) * self.keep, (-1, 1))
        grad = P.tensor_scatter_elements(P.exp(self.log_probs), self.safe, -P.ones((rows, 1), _F32), 1, "add")
        grad = grad * P.tile(scale, (1, classes))
        return grad.astype(logits.dtype), P.zeros_like(target)


def cross_entropy(logits, target, ignore_index=-100, reduction="mean"):
    per_row = _CrossEntropy(ignore_index)(logits, target)
    if reduction == "none":
        return per_row
    total = P.sum(per_row)
    if reduction == "sum":
        return total
    count = P.sum(P.ne(target, ignore_index).astype(_F32))
    return total / count  # mean over the rows that count, as torch's cross_entropy


# ---- RMSNorm ---------------------------------------------------------------------------------

class _RMSNorm(ms.nn.Cell):
    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def construct(self, x, weight):
        shape, h = x.shape, x.shape[-1]
        xf = P.reshape(x, (-1, h)).astype(_F32)
        self.x = xf
        self.inv = P.rsqrt(P.mean(xf * xf, -1, True) + self.eps)  # [N, 1]
        self.normed = (xf * P.tile(self.inv, (1, h))).astype(x.dtype)
        return P.reshape(self.normed * tile_to(_lead(weight, 2), self.normed.shape), shape)

    def bprop(self, x, weight, out, dout):
        h = x.shape[-1]
        d = P.reshape(dout, (-1, h))
        dweight = P.sum(d.astype(_F32) * self.normed.astype(_F32), 0).astype(weight.dtype)
        dy = d.astype(_F32) * tile_to(_lead(weight.astype(_F32), 2), d.shape)
        y = self.x * P.tile(self.inv, (1, h))
        # d/dx of x * r(x): r * (dy - y * mean(dy * y))
        proj = P.tile(P.mean(dy * y, -1, True), (1, h))
        dx = (dy - y * proj) * P.tile(self.inv, (1, h))
        return P.reshape(dx.astype(x.dtype), x.shape), dweight


def rms_norm(x, weight, eps=1e-6):
    return _RMSNorm(eps)(x, weight)


# ---- rotary embedding ------------------------------------------------------------------------

def _rotate(x, sign_first):
    first, second = P.chunk(x, 2, -1)
    return P.cat([-second, first], -1) if sign_first else P.cat([second, -first], -1)


class _Rotary(ms.nn.Cell):
    def construct(self, x, cos, sin):
        if cos.ndim == 2:  # [s, d] tables over [b, s, h, d]
            cos = P.reshape(cos, (1, cos.shape[0], 1, cos.shape[1]))
            sin = P.reshape(sin, (1, sin.shape[0], 1, sin.shape[1]))
        self.cos, self.sin = tile_to(_lead(cos, x.ndim), x.shape), tile_to(_lead(sin, x.ndim), x.shape)
        return x * self.cos + _rotate(x, True) * self.sin

    def bprop(self, x, cos, sin, out, dout):
        # the transpose of "rotate half" is rotating the other way
        return dout * self.cos + _rotate(dout * self.sin, False), P.zeros_like(cos), P.zeros_like(sin)


def apply_rotary(x, cos, sin):
    return _Rotary()(x, cos, sin)


# ---- attention -------------------------------------------------------------------------------

_CAUSAL_BIAS: dict = {}


def _causal_bias(shape, sq: int, sk: int, rep: int):
    """Additive causal bias (0 / -inf) tiled to the full score shape [b, hk, rep * sq, sk],
    built once per shape: adding a broadcast bias costs ~10x a full one."""
    key = tuple(shape)
    if key not in _CAUSAL_BIAS:
        import numpy as np

        keep = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
        bias = np.where(keep, 0.0, -np.inf).astype(np.float32)
        _CAUSAL_BIAS.clear()  # one shape at a time is what training uses
        _CAUSAL_BIAS[key] = ms.Tensor(np.broadcast_to(np.tile(bias, (rep, 1)), key).copy())
    return _CAUSAL_BIAS[key]


class _Attention(ms.nn.Cell):
    """softmax(q k^T * scale + causal bias) v with each key/value head multiplied by its
    query heads stacked along the rows."""

    def __init__(self, causal: bool, scale: float):
        super().__init__()
        self.causal, self.scale = causal, scale

    def construct(self, q, k, v):
        b, sq, hq, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        rep = hq // hk
        self.qh = P.reshape(P.transpose(q.astype(_F32) * self.scale, (0, 2, 1, 3)), (b, hk, rep * sq, d))
        self.kh = P.transpose(k.astype(_F32), (0, 2, 1, 3))
        self.vh = P.transpose(v, (0, 2, 1, 3))
        scores = _bmm_nt(self.qh, self.kh)  # [b, hk, rep * sq, sk]
        if self.causal:
            scores = scores + _causal_bias(scores.shape, sq, sk, rep)
        self.probs = P.softmax(scores, -1)
        out = _bmm(self.probs.astype(v.dtype), self.vh)  # [b, hk, rep * sq, dv]
        return P.transpose(P.reshape(out, (b, hq, sq, v.shape[-1])), (0, 2, 1, 3))

    def bprop(self, q, k, v, out, dout):
        b, sq, hq, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        rep = hq // hk
        probs = self.probs
        do = P.reshape(P.transpose(dout, (0, 2, 1, 3)), (b, hk, rep * sq, v.shape[-1]))
        dv = _bmm_tn(probs.astype(do.dtype), do)  # [b, hk, sk, dv]
        dp = _bmm_nt(do.astype(_F32), self.vh.astype(_F32))
        row = P.sum(dp * probs, -1, True)
        ds = probs * (dp - P.tile(row, (1, 1, 1, sk)))
        dq = _bmm(ds, self.kh) * self.scale
        dk = _bmm_tn(ds, self.qh)
        dq = P.transpose(P.reshape(dq, (b, hq, sq, d)), (0, 2, 1, 3))
        return (dq.astype(q.dtype), P.transpose(dk, (0, 2, 1, 3)).astype(k.dtype),
                P.transpose(dv, (0, 2, 1, 3)).astype(v.dtype))


def attention(q, k, v, causal=False, mask=None, dropout_p=0.0, scale=None, segment_ids=None, return_lse=False,
              window=None, softcap=None):
    if (mask is not None or dropout_p > 0.0 or segment_ids is not None or return_lse or window is not None
            or softcap is not None):
        # what this kernel does not cover: the reference
        return composite.attention(q, k, v, causal=causal, mask=mask, dropout_p=dropout_p, scale=scale,
                                   segment_ids=segment_ids, return_lse=return_lse, window=window, softcap=softcap)
    composite.check_attention_shapes(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _Attention(causal, scale)(q, k, v)


# ---- AdamW -----------------------------------------------------------------------------------

_adam_weight_decay = P.AdamWeightDecay()


def adamw_step(weights, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decays, step):
    """MindSpore's fused AdamWeightDecay kernel, in place (151 ms for 26.6M elements against
    1.4 s for the composite on 2 cores). It has no bias correction; folding it in:
    lr/c1 * m / (sqrt(v)/sqrt(c2) + eps) = (lr sqrt(c2)/c1) * m / (sqrt(v) + eps sqrt(c2)),
    and the kernel's decay term lr' * wd' * w must equal lr * wd * w, so wd' = wd * c1 / sqrt(c2)
    (written without dividing by lr, which may be 0)."""
    c1, c2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    lr_k, eps_k = lr * math.sqrt(c2) / c1, eps * math.sqrt(c2)
    for w, g, m, v, wd in zip(weights, grads, exp_avgs, exp_avg_sqs, weight_decays):
        _adam_weight_decay(w, m, v, lr_k, beta1, beta2, eps_k, wd * c1 / math.sqrt(c2), g)
    return weights, exp_avgs, exp_avg_sqs


# SwiGLU is not here: a hand-written backward measured slower than the automatic one (83 vs
# 55 ms on [8, 256, 2816]), which has no broadcast to avoid.
KERNELS = {"rms_norm": rms_norm, "apply_rotary": apply_rotary, "attention": attention}
