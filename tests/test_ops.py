"""Conformance of every facade op against a float64 numpy reference: values and gradients."""

from __future__ import annotations

import numpy as np
import pytest

import numeric as R
from mindspeed_core import ops

g = R.rng(0)
A = g.standard_normal((3, 4))
B = g.standard_normal((3, 4))
POS = g.uniform(0.5, 2.0, (3, 4))
M = g.standard_normal((4, 5))
BATCH_A, BATCH_B = g.standard_normal((2, 3, 4)), g.standard_normal((2, 4, 5))
IDX = np.array([[0, 2, 1, 3], [3, 3, 0, 1], [1, 0, 2, 2]], np.int64)
MASK = A > 0

# name -> (facade fn, numpy reference, inputs, positions to differentiate)
CASES = {
    "add": (ops.add, np.add, [A, B], (0, 1)),
    "sub": (ops.sub, np.subtract, [A, B], (0, 1)),
    "mul": (ops.mul, np.multiply, [A, B], (0, 1)),
    "div": (ops.div, np.divide, [A, POS], (0, 1)),
    "neg": (ops.neg, np.negative, [A], (0,)),
    "exp": (ops.exp, np.exp, [A], (0,)),
    "log": (ops.log, np.log, [POS], (0,)),
    "sqrt": (ops.sqrt, np.sqrt, [POS], (0,)),
    "rsqrt": (ops.rsqrt, lambda x: 1 / np.sqrt(x), [POS], (0,)),
    "pow": (lambda x: ops.pow(x, 3.0), lambda x: x ** 3, [A], (0,)),
    "abs": (ops.abs, np.abs, [A], (0,)),
    "tanh": (ops.tanh, np.tanh, [A], (0,)),
    "sigmoid": (ops.sigmoid, R.sigmoid, [A], (0,)),
    "sin": (ops.sin, np.sin, [A], (0,)),
    "cos": (ops.cos, np.cos, [A], (0,)),
    "silu": (ops.silu, lambda x: x * R.sigmoid(x), [A], (0,)),
    "relu": (ops.relu, lambda x: np.maximum(x, 0), [A], (0,)),
    "gelu": (ops.gelu, R.gelu, [A], (0,)),
    "gelu_tanh": (lambda x: ops.gelu(x, approximate="tanh"), lambda x: R.gelu(x, "tanh"), [A], (0,)),
    "maximum": (ops.maximum, np.maximum, [A, B], (0, 1)),
    "minimum": (ops.minimum, np.minimum, [A, B], (0, 1)),
    "clamp": (lambda x: ops.clamp(x, -0.5, 0.7), lambda x: np.clip(x, -0.5, 0.7), [A], (0,)),
    "eq": (ops.eq, np.equal, [A, np.where(MASK, A, B)], ()),
    "ne": (ops.ne, np.not_equal, [A, np.where(MASK, A, B)], ()),
    "lt": (ops.lt, np.less, [A, B], ()),
    "le": (ops.le, np.less_equal, [A, np.where(MASK, A, B)], ()),
    "gt": (ops.gt, np.greater, [A, B], ()),
    "ge": (ops.ge, np.greater_equal, [A, np.where(MASK, A, B)], ()),
    "logical_and": (ops.logical_and, np.logical_and, [MASK, B > 0], ()),
    "logical_or": (ops.logical_or, np.logical_or, [MASK, B > 0], ()),
    "logical_not": (ops.logical_not, np.logical_not, [MASK], ()),
    "isfinite": (lambda x: ops.isfinite(ops.log(x)), lambda x: np.isfinite(np.log(np.where(x > 0, x, np.nan))),
                 [A], ()),
    "sum": (lambda x: ops.sum(x, dim=1), lambda x: x.sum(1), [A], (0,)),
    "sum_all": (ops.sum, np.sum, [A], (0,)),
    "mean": (lambda x: ops.mean(x, dim=-1, keepdim=True), lambda x: x.mean(-1, keepdims=True), [A], (0,)),
    "mean_all": (ops.mean, np.mean, [A], (0,)),
    "amax": (lambda x: ops.amax(x, dim=0), lambda x: x.max(0), [A], (0,)),
    "amin": (lambda x: ops.amin(x, dim=1, keepdim=True), lambda x: x.min(1, keepdims=True), [A], (0,)),
    "argmax": (lambda x: ops.argmax(x, dim=1), lambda x: x.argmax(1), [A], ()),
    "logsumexp": (lambda x: ops.logsumexp(x, dim=-1), lambda x: np.log(np.exp(x).sum(-1)), [A], (0,)),
    "matmul": (ops.matmul, np.matmul, [A, M], (0, 1)),
    "matmul_batched": (ops.matmul, np.matmul, [BATCH_A, BATCH_B], (0, 1)),
    "bmm": (ops.bmm, np.matmul, [BATCH_A, BATCH_B], (0, 1)),
    "linear": (ops.linear, lambda x, w, b: x @ w.T + b, [A, M.T, g.standard_normal(5)], (0, 1, 2)),
    "linear_nobias": (ops.linear, lambda x, w: x @ w.T, [A, M.T], (0, 1)),
    "gather": (lambda x, i: ops.gather(x, 1, i), lambda x, i: np.take_along_axis(x, i, 1), [A, IDX], (0,)),
    "scatter_add": (lambda x, i, s: ops.scatter_add(x, 1, i, s),
                    lambda x, i, s: _scatter_add(x, i, s), [A, IDX, B], (0, 2)),
    "index_select": (lambda x, i: ops.index_select(x, 1, i), lambda x, i: x[:, i],
                     [A, np.array([3, 0, 0], np.int64)], (0,)),
    "masked_fill": (lambda x, m: ops.masked_fill(x, m, -2.0), lambda x, m: np.where(m, -2.0, x), [A, MASK], (0,)),
    "where": (ops.where, np.where, [MASK, A, B], (1, 2)),
    "tril": (lambda x: ops.tril(x, 1), lambda x: np.tril(x, 1), [A], (0,)),
    "triu": (lambda x: ops.triu(x), np.triu, [A], (0,)),
    "reshape": (lambda x: ops.reshape(x, (2, 6)), lambda x: x.reshape(2, 6), [A], (0,)),
    "transpose": (lambda x: ops.transpose(x, 0, 2), lambda x: x.transpose(2, 1, 0), [BATCH_A], (0,)),
    "permute": (lambda x: ops.permute(x, (1, 2, 0)), lambda x: x.transpose(1, 2, 0), [BATCH_A], (0,)),
    "cat": (lambda a, b: ops.cat([a, b], dim=1), lambda a, b: np.concatenate([a, b], 1), [A, B], (0, 1)),
    "stack": (lambda a, b: ops.stack([a, b], dim=1), lambda a, b: np.stack([a, b], 1), [A, B], (0, 1)),
    "split": (lambda x: ops.split(x, [1, 3], dim=1)[1], lambda x: x[:, 1:], [A], (0,)),
    "split_even": (lambda x: ops.split(x, 2, dim=1)[0], lambda x: x[:, :2], [A], (0,)),
    "chunk": (lambda x: ops.chunk(x, 2, dim=1)[1], lambda x: x[:, 2:], [A], (0,)),
    "squeeze": (lambda x: ops.squeeze(x, 1), lambda x: x[:, 0], [A[:, :1]], (0,)),
    "unsqueeze": (lambda x: ops.unsqueeze(x, 0), lambda x: x[None], [A], (0,)),
    "expand": (lambda x: ops.expand(x, (2, 3, 4)), lambda x: np.broadcast_to(x, (2, 3, 4)), [A[None]], (0,)),
    "softmax": (lambda x: ops.softmax(x, dim=-1), R.softmax, [A], (0,)),
    "log_softmax": (lambda x: ops.log_softmax(x, dim=0), lambda x: R.log_softmax(x, 0), [A], (0,)),
    "cross_entropy": (lambda x, t: ops.cross_entropy(x, t), R.cross_entropy, [A, np.array([1, 3, 0], np.int64)], (0,)),
    "cross_entropy_ignore": (lambda x, t: ops.cross_entropy(x, t, ignore_index=-100),
                             R.cross_entropy, [A, np.array([1, -100, 2], np.int64)], (0,)),
    "cross_entropy_sum": (lambda x, t: ops.cross_entropy(x, t, reduction="sum"),
                          lambda x, t: R.cross_entropy(x, t, reduction="sum"), [A, np.array([1, 3, 0], np.int64)], (0,)),
    "cross_entropy_none": (lambda x, t: ops.cross_entropy(x, t, ignore_index=7, reduction="none"),
                           lambda x, t: R.cross_entropy(x, t, ignore_index=7, reduction="none"),
                           [A, np.array([1, 7, 0], np.int64)], (0,)),
    "embedding": (lambda i, w: ops.embedding(i, w), lambda i, w: w[i], [np.array([[0, 4], [2, 2]], np.int64),
                                                                        g.standard_normal((5, 3))], (1,)),
    "topk": (lambda x: ops.topk(x, 2, dim=1), lambda x: _topk(x, 2), [A], (0,)),
    "topk_smallest": (lambda x: ops.topk(x, 2, dim=1, largest=False)[0], lambda x: np.sort(x, 1)[:, :2], [A], (0,)),
    "cumsum": (lambda x: ops.cumsum(x, 1), lambda x: np.cumsum(x, 1), [A], (0,)),
    "one_hot": (lambda i: ops.one_hot(i, 5), lambda i: np.eye(5)[i], [np.array([0, 4, 2], np.int64)], ()),
}


def _scatter_add(x, idx, src):
    out = x.copy()
    for i in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            out[i, idx[i, j]] += src[i, j]
    return out


def _topk(x, k):
    order = np.argsort(-x, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(x, order, 1), order


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_numpy(name):
    fn, ref, inputs, wrt = CASES[name]
    R.check_op(fn, ref, inputs, wrt)


# ---- creation, conversion and dtypes -----------------------------------------------------------

def test_creation():
    np.testing.assert_array_equal(ops.to_numpy(ops.zeros((2, 3))), np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(ops.to_numpy(ops.ones((2,), dtype="int32")), np.ones(2, np.int32))
    np.testing.assert_array_equal(ops.to_numpy(ops.full((2, 2), 7.5)), np.full((2, 2), 7.5, np.float32))
    assert ops.to_numpy(ops.empty((4, 1))).shape == (4, 1)
    x = ops.tensor(A)
    assert ops.dtype_of(x) == "float32"  # float64 data defaults to float32 on both frameworks
    assert ops.dtype_of(ops.tensor(A, dtype="float64")) == "float64"
    np.testing.assert_array_equal(ops.to_numpy(ops.zeros_like(x)), np.zeros((3, 4), np.float32))
    np.testing.assert_array_equal(ops.to_numpy(ops.ones_like(x, dtype="int64")), np.ones((3, 4), np.int64))
    np.testing.assert_array_equal(ops.to_numpy(ops.arange(5)), np.arange(5))
    np.testing.assert_array_equal(ops.to_numpy(ops.arange(2, 9, 3)), np.array([2, 5, 8]))
    assert ops.dtype_of(ops.arange(3)) == "int64"
    np.testing.assert_allclose(ops.to_numpy(ops.arange(0, 1, 0.25, dtype="float32")), [0, 0.25, 0.5, 0.75])
    assert ops.numel(x) == 12 and tuple(x.shape) == (3, 4)
    assert ops.is_tensor(x) and not ops.is_tensor(A)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32", "int64", "int16", "int8", "uint8",
                                   "bool"])
def test_cast_round_trip(dtype):
    values = np.array([[0, 1, 2], [3, 4, 5]], np.float32)
    y = ops.cast(ops.tensor(values), dtype)
    assert ops.dtype_of(y) == dtype
    back = ops.to_numpy(ops.cast(y, "float32"))
    expected = values.astype(bool).astype(np.float32) if dtype == "bool" else values
    np.testing.assert_array_equal(back, expected)


def test_bfloat16_rounds_like_bfloat16():
    # 1 + 2**-9 is not representable in bfloat16 (8 bits of mantissa): it rounds to 1.
    x = ops.tensor(np.array([1 + 2 ** -9, 3.0], np.float32), dtype="bfloat16")
    np.testing.assert_array_equal(ops.to_numpy(x), np.array([1.0, 3.0], np.float32))


def test_write_slice_writes_in_place():
    buffer = ops.zeros((2, 5, 3))
    ops.write_slice_(buffer, ops.tensor(np.arange(12, dtype=np.float32).reshape(2, 2, 3)), 1, 3)
    want = np.zeros((2, 5, 3), np.float32)
    want[:, 3:5] = np.arange(12).reshape(2, 2, 3)
    np.testing.assert_array_equal(ops.to_numpy(buffer), want)


def test_bitcast_reads_the_same_bits():
    x = np.array([1.0, -2.5, 0.0, np.inf], np.float32)
    as_int = ops.bitcast(ops.tensor(x), "int32")
    assert ops.dtype_of(as_int) == "int32"
    np.testing.assert_array_equal(ops.to_numpy(as_int), x.view(np.int32))
    half = ops.bitcast(ops.tensor(np.array([0x3F80, -0x4080], np.int16)), "bfloat16")  # 1.0 and -1.0
    np.testing.assert_array_equal(ops.to_numpy(half), [1.0, -1.0])
    with pytest.raises(ValueError, match="element size"):
        ops.bitcast(ops.tensor(x), "bfloat16")


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown dtype"):
        ops.zeros((2,), dtype="float8")


def test_operators_on_tensors():
    # Models may use Python operators on facade tensors; both frameworks must agree.
    a, b = ops.tensor(A), ops.tensor(B)
    np.testing.assert_allclose(ops.to_numpy(a + b * 2 - b / 4), A + B * 2 - B / 4, rtol=1e-5)
    np.testing.assert_allclose(ops.to_numpy(a @ ops.tensor(M)), A @ M, rtol=1e-5)
    np.testing.assert_allclose(ops.to_numpy(a[1:, ::2]), A[1:, ::2], rtol=1e-6)
