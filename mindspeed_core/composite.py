"""Composite fallbacks of the fused operators, written once with facade ops.

A backend binds ``ops.<fused>`` to a native kernel where its device has one and to the
function here otherwise (docs/architecture.md, "Kernels on CPU"). The conformance suite checks that the
native binding and this composite agree, so the composite is also the reference of what
each fused op means. Shapes follow the facade contract in :mod:`mindspeed_core.facade`.
"""

from __future__ import annotations

import math

import numpy as np

from mindspeed_core import runtime


def _ops():
    return runtime.bound().ops


def rms_norm(x, weight, eps: float = 1e-6):
    ops = _ops()
    xf = ops.cast(x, "float32")
    y = ops.mul(xf, ops.rsqrt(ops.mean(xf * xf, dim=-1, keepdim=True) + eps))
    return ops.mul(ops.cast(y, ops.dtype_of(x)), weight)


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    ops = _ops()
    xf = ops.cast(x, "float32")
    centred = ops.sub(xf, ops.mean(xf, dim=-1, keepdim=True))
    var = ops.mean(centred * centred, dim=-1, keepdim=True)
    y = ops.mul(ops.cast(ops.mul(centred, ops.rsqrt(var + eps)), ops.dtype_of(x)), weight)
    return y if bias is None else ops.add(y, bias)


def swiglu(x):
    ops = _ops()
    gate, up = ops.chunk(x, 2, dim=-1)
    return ops.silu(gate) * up


def _rope_table(ops, table, x):
    # [s, d] tables broadcast over batch and heads of x: [b, s, h, d]
    if len(table.shape) == 2:
        return ops.reshape(table, (1, table.shape[0], 1, table.shape[1]))
    return table


def apply_rotary(x, cos, sin):
    ops = _ops()
    cos, sin = _rope_table(ops, cos, x), _rope_table(ops, sin, x)
    first, second = ops.chunk(x, 2, dim=-1)
    rotated = ops.cat([ops.neg(second), first], dim=-1)
    return ops.add(ops.mul(x, cos), ops.mul(rotated, sin))


def causal_keep_mask(sq: int, sk: int):
    """Boolean [sq, sk]: query i sees key j when j <= i + (sk - sq) (aligned bottom-right,
    so a query block that continues a cached prefix sees the whole prefix)."""
    ops = _ops()
    rows = ops.reshape(ops.arange(sq, dtype="int64"), (sq, 1))
    cols = ops.reshape(ops.arange(sk, dtype="int64"), (1, sk))
    return ops.le(cols, rows + (sk - sq))


def check_attention_shapes(q, k, v) -> None:
    """The facade's shape contract, checked before any kernel sees the tensors."""
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        raise ValueError("attention: q, k and v must be [batch, seq, heads, head_dim]")
    if tuple(k.shape[:3]) != tuple(v.shape[:3]) or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: {q.shape[2]} query heads are not a multiple of {k.shape[2]} key/value heads")


def segment_keep_mask(segment_ids, sq: int, sk: int):
    """Boolean [b, 1, sq, sk] from packed-sequence document ids: a query sees the keys of its
    own document only. ``segment_ids`` is [b, s] (self-attention, sq == sk == s) or a pair
    (query ids [b, sq], key ids [b, sk])."""
    ops = _ops()
    q_seg, k_seg = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
    if tuple(q_seg.shape[1:]) != (sq,) or tuple(k_seg.shape[1:]) != (sk,):
        raise ValueError(f"attention: segment ids {tuple(q_seg.shape)} / {tuple(k_seg.shape)} do not fit "
                         f"{sq} queries and {sk} keys")
    return ops.unsqueeze(ops.eq(ops.unsqueeze(q_seg, 2), ops.unsqueeze(k_seg, 1)), 1)


def window_keep_mask(sq: int, sk: int, window: int):
    """Boolean [sq, sk]: query i sees key j when it is one of the ``window`` latest keys up to
    i, j > i + (sk - sq) - window (aligned bottom-right as the causal mask; with the causal
    mask, a query sees itself and the window - 1 keys before it)."""
    ops = _ops()
    rows = ops.reshape(ops.arange(sq, dtype="int64"), (sq, 1))
    cols = ops.reshape(ops.arange(sk, dtype="int64"), (1, sk))
    return ops.gt(cols, rows + (sk - sq - window))


def attention_keep(sq: int, sk: int, causal: bool, mask, segment_ids, window: int | None = None):
    """The one mask every attention path applies: bool (True keeps) or float (added), or
    None; causal aligned bottom-right, packed documents kept apart, a sliding window."""
    ops = _ops()
    keep = causal_keep_mask(sq, sk) if causal else None
    if window is not None:
        slide = window_keep_mask(sq, sk, window)
        keep = slide if keep is None else ops.logical_and(keep, slide)
    if segment_ids is not None:
        seg = segment_keep_mask(segment_ids, sq, sk)
        keep = seg if keep is None else ops.logical_and(seg, keep)
    if mask is None:
        return keep
    if keep is None:
        return mask
    if ops.dtype_of(mask) == "bool":
        return ops.logical_and(mask, keep)
    return ops.where(keep, ops.cast(mask, "float32"), ops.full((), float("-inf")))


# What a hidden score becomes when the log-sum-exp is returned: finite, so a row with no
# visible key gets a log-sum-exp near -1e30 (weight exactly 0 when partial results are
# merged) instead of NaN.
MASKED_SCORE = -1e30


def attention(q, k, v, causal: bool = False, mask=None, dropout_p: float = 0.0, scale=None, segment_ids=None,
              return_lse: bool = False, window: int | None = None, softcap: float | None = None):
    ops = _ops()
    check_attention_shapes(q, k, v)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qh, kh, vh = (ops.transpose(t, 1, 2) for t in (q, k, v))  # [b, h, s, d]
    # grouped-query attention: each kv head serves rep = hq // hk query heads, which are
    # neighbours in q; so the queries of a group are stacked as rows [b, hk, rep * sq, d] and
    # meet their kv head once, instead of copying the keys and values out to every query head
    rep = hq // hk
    scores = ops.matmul(ops.cast(ops.reshape(qh, (b, hk, rep * sq, d)), "float32"),
                        ops.cast(ops.transpose(kh, -2, -1), "float32"))
    scores = ops.reshape(scores, (b, hq, sq, sk)) * scale
    if softcap is not None:  # Gemma 2: scores squashed into (-softcap, softcap) before the mask
        scores = ops.tanh(scores * (1.0 / softcap)) * softcap
    # every mask becomes one additive bias (0 or the masked score, plus any float mask), added once
    keep = attention_keep(sq, sk, causal, mask, segment_ids, window)
    if keep is not None:
        hidden = MASKED_SCORE if return_lse else float("-inf")
        if ops.dtype_of(keep) == "bool":
            bias = ops.where(keep, ops.zeros(keep.shape), ops.full(keep.shape, hidden))
        else:
            bias = ops.maximum(ops.cast(keep, "float32"), ops.full((), hidden))
        scores = ops.add(scores, bias)
    if return_lse:
        lse = ops.logsumexp(scores, dim=-1)  # [b, h, sq]
        probs = ops.exp(scores - ops.unsqueeze(lse, -1))
    else:
        probs = ops.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = ops.dropout(probs, dropout_p)
    out = ops.matmul(ops.reshape(ops.cast(probs, ops.dtype_of(v)), (b, hk, rep * sq, sk)), vh)
    out = ops.transpose(ops.reshape(out, (b, hq, sq, v.shape[-1])), 1, 2)
    return (out, ops.transpose(lse, 1, 2)) if return_lse else out


def matmul_add(a, b, acc):
    ops = _ops()
    return acc + ops.matmul(ops.cast(a, "float32"), ops.cast(b, "float32"))


def solve_unit_lower(a, b):
    """x with a x = b for ``a`` [..., n, n] unit lower triangular (its diagonal and upper part
    are not read): with N = -strict_lower(a) nilpotent, a^-1 = sum_k N^k = (I + N)(I + N^2)
    (I + N^4)..., exact after ceil(log2 n) factors (a polynomial of N, not a truncated series)."""
    ops = _ops()
    size = a.shape[-1]
    power = ops.neg(ops.tril(a, -1))
    inverse = ops.tensor(np.eye(size, dtype=np.float32)) + power
    for _ in range(max(math.ceil(math.log2(size)) - 1, 0)):
        power = ops.matmul(power, power)
        inverse = inverse + ops.matmul(inverse, power)
    return ops.matmul(inverse, b)


def grouped_matmul(x, weight, group_sizes):
    ops = _ops()
    sizes = [int(s) for s in group_sizes]
    if len(sizes) != weight.shape[0]:
        raise ValueError(f"grouped_matmul: {len(sizes)} group sizes for {weight.shape[0]} weight groups")
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"grouped_matmul: group sizes add up to {sum(sizes)}, but x has {x.shape[0]} rows")
    outs, start = [], 0
    for e, n in enumerate(sizes):
        if n:
            outs.append(ops.matmul(x[start : start + n], weight[e]))
        start += n
    if not outs:  # no rows: still a product of x, so a backward pass reaches x (and whatever sent it)
        return ops.matmul(x, weight[0])
    return outs[0] if len(outs) == 1 else ops.cat(outs, dim=0)


def adamw_step(weights, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decays, step):
    """One AdamW step (decoupled weight decay, bias correction; torch.optim.AdamW's formula)
    on lists of float32 tensors; returns the new (weights, exp_avgs, exp_avg_sqs)."""
    ops = _ops()
    c1, c2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    step_size, root_c2 = lr / c1, math.sqrt(c2)
    new_w, new_m, new_v = [], [], []
    for w, g, m, v, wd in zip(weights, grads, exp_avgs, exp_avg_sqs, weight_decays):
        m = m * beta1 + g * (1.0 - beta1)
        v = v * beta2 + g * g * (1.0 - beta2)
        if wd:
            w = w * (1.0 - lr * wd)
        denom = ops.sqrt(v) * (1.0 / root_c2) + eps
        new_w.append(w - m * step_size / denom)
        new_m.append(m)
        new_v.append(v)
    return new_w, new_m, new_v


FUSED = ("rms_norm", "layer_norm", "swiglu", "apply_rotary", "attention", "matmul_add", "grouped_matmul",
         "adamw_step", "solve_unit_lower")


def bind_fused(namespace: dict, native: dict) -> dict:
    """Set each fused op in a backend's ops namespace to its native kernel when ``native``
    has one, else to the composite above; return {op: "native" | "composite"}."""
    kinds = {}
    for name in FUSED:
        namespace[name] = native.get(name) or globals()[name]
        kinds[name] = "native" if name in native else "composite"
    return kinds
