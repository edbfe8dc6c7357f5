"""Fused operators: each against its float64 reference (values and gradients), and the
backend's binding (native kernel where the device has one) against the composite."""

from __future__ import annotations

import numpy as np
import pytest

import numeric as R
from mindspeed_core import composite, device, ops

g = R.rng(3)
X = g.standard_normal((2, 3, 8))
W = g.uniform(0.5, 1.5, 8)
BIAS = g.standard_normal(8)
Q = g.standard_normal((2, 5, 4, 8))
K = g.standard_normal((2, 5, 2, 8))
V = g.standard_normal((2, 5, 2, 8))
COS, SIN = R.rope_tables(5, 8)
BOOL_MASK = g.uniform(size=(5, 5)) > 0.3
np.fill_diagonal(BOOL_MASK, True)  # no fully masked row
ADD_MASK = g.standard_normal((5, 5))

# name -> (feature id, facade op name, call(fn, *tensors), reference, inputs, positions to differentiate)
CASES = {
    "rms_norm": ("fused-rmsnorm", "rms_norm", lambda f, x, w: f(x, w, 1e-6), R.rms_norm, [X, W], (0, 1)),
    "layer_norm": ("fused-rmsnorm", "layer_norm", lambda f, x, w, b: f(x, w, b, 1e-5), R.layer_norm, [X, W, BIAS],
                   (0, 1, 2)),
    "layer_norm_nobias": ("fused-rmsnorm", "layer_norm", lambda f, x, w: f(x, w, None, 1e-5), R.layer_norm, [X, W], (0,)),
    "swiglu": ("fused-swiglu", "swiglu", lambda f, x: f(x), R.swiglu, [X], (0,)),
    "apply_rotary": ("fused-rope", "apply_rotary", lambda f, x, c, s: f(x, c, s), R.apply_rotary, [Q, COS, SIN], (0,)),
    "attention": ("flash-attention", "attention", lambda f, q, k, v: f(q, k, v), R.attention, [Q, Q, Q], (0, 1, 2)),
    "attention_causal_gqa": ("flash-attention", "attention", lambda f, q, k, v: f(q, k, v, causal=True),
                             lambda q, k, v: R.attention(q, k, v, causal=True), [Q, K, V], (0, 1, 2)),
    "attention_bool_mask": ("flash-attention", "attention", lambda f, q, k, v, m: f(q, k, v, mask=m),
                            lambda q, k, v, m: R.attention(q, k, v, mask=m), [Q, K, V, BOOL_MASK], (0, 1, 2)),
    "attention_additive_mask_causal": (
        "flash-attention", "attention", lambda f, q, k, v, m: f(q, k, v, causal=True, mask=m, scale=0.2),
        lambda q, k, v, m: R.attention(q, k, v, causal=True, mask=m, scale=0.2), [Q, K, V, ADD_MASK], (0, 1, 2)),
    "attention_causal_kv_prefix": (  # 2 new queries continuing a 5-key cache: bottom-right alignment
        "flash-attention", "attention", lambda f, q, k, v: f(q, k, v, causal=True),
        lambda q, k, v: R.attention(q, k, v, causal=True), [Q[:, :2], K, V], (0, 1, 2)),
    "matmul_add": ("matmul-add", "matmul_add", lambda f, a, b, c: f(a, b, c), lambda a, b, c: c + a @ b,
                   [g.standard_normal((3, 4)), g.standard_normal((4, 5)), g.standard_normal((3, 5))], (0, 1, 2)),
    "grouped_matmul": ("gmm", "grouped_matmul", lambda f, x, w: f(x, w, [2, 0, 4]),
                       lambda x, w: np.concatenate([x[:2] @ w[0], x[2:6] @ w[2]]),
                       [g.standard_normal((6, 4)), g.standard_normal((3, 4, 5))], (0, 1)),
}


def _case_params():
    return [pytest.param(name, marks=pytest.mark.feature(CASES[name][0])) for name in sorted(CASES)]


@pytest.mark.parametrize("name", _case_params())
def test_fused_matches_reference(name):
    _, op, call, ref, inputs, wrt = CASES[name]
    R.check_op(lambda *t: call(getattr(ops, op), *t), ref, inputs, wrt, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", _case_params())
def test_bound_kernel_agrees_with_composite(name):
    _, op, call, _, inputs, _ = CASES[name]
    tensors = [ops.tensor(a) for a in inputs]
    bound = ops.to_numpy(call(getattr(ops, op), *tensors))
    reference = ops.to_numpy(call(getattr(composite, op), *tensors))
    np.testing.assert_allclose(bound, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.feature("fused-rmsnorm")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_norm_agrees_with_composite(dtype):
    if not device.supports_dtype(dtype):
        pytest.skip(f"{dtype} math is not available on this device (the matrix marks it unsupported)")
    x, w = ops.tensor(X, dtype=dtype), ops.tensor(W, dtype=dtype)
    bound, comp = ops.to_numpy(ops.rms_norm(x, w)), ops.to_numpy(composite.rms_norm(x, w))
    np.testing.assert_allclose(bound, comp, rtol=1e-2, atol=1e-2)
    assert ops.dtype_of(ops.rms_norm(x, w)) == dtype


def test_implementations_cover_every_fused_op():
    kinds = ops.implementations()
    assert set(kinds) == set(composite.FUSED)
    assert set(kinds.values()) <= {"native", "composite"}
    for name, kind in kinds.items():
        bound = getattr(ops, name)
        assert (bound is getattr(composite, name)) == (kind == "composite"), name


@pytest.mark.feature("flash-attention")
def test_attention_dropout_is_unbiased():
    from mindspeed_core import random

    random.seed(11)
    q, k, v = ops.tensor(Q[:1, :3, :2]), ops.tensor(K[:1, :3, :1]), ops.tensor(V[:1, :3, :1])
    plain = ops.to_numpy(ops.attention(q, k, v))
    draws = np.stack([ops.to_numpy(ops.attention(q, k, v, dropout_p=0.3)) for _ in range(400)])
    assert not np.allclose(draws[0], plain)  # dropout did something
    # Inverted dropout keeps the expectation: the mean over draws is the plain result up to
    # sampling error (5 standard errors per element).
    stderr = draws.std(0) / np.sqrt(len(draws))
    assert np.all(np.abs(draws.mean(0) - plain) <= 5 * stderr + 1e-4)


def test_grouped_matmul_rejects_bad_sizes():
    x, w = ops.tensor(np.ones((4, 2))), ops.tensor(np.ones((2, 2, 3)))
    with pytest.raises(ValueError, match="add up to"):
        ops.grouped_matmul(x, w, [1, 2])
    with pytest.raises(ValueError, match="group sizes for"):
        ops.grouped_matmul(x, w, [4])


def test_attention_rejects_incompatible_heads():
    with pytest.raises(ValueError, match="multiple"):
        ops.attention(ops.tensor(Q[:, :, :3]), ops.tensor(K), ops.tensor(V))
