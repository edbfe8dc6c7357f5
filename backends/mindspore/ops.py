"""Facade ops bound to MindSpore (PyNative).

Bindings use ``mindspore.ops``: on the CPU many ``mint`` kernels are not registered
(embedding, layer_norm, scatter_add, random ops, ...), while ``ops`` covers them. The
fused ops have no CPU kernels (RmsNorm, Swiglu, RotaryPositionEmbedding,
FlashAttentionScore all fail with "kernel unregistered"), so on CPU they are composites;
on Ascend the kernels are bound.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops as P

from mindspeed_core import composite
from mindspeed_core.backends.common import dtype_table, framework_dtype

from . import autograd, kernels, random

DTYPES = dtype_table({
    "float32": ms.float32, "float64": ms.float64, "float16": ms.float16,
    "bfloat16": ms.bfloat16, "int32": ms.int32, "int64": ms.int64, "int16": ms.int16,
    "int8": ms.int8, "uint8": ms.uint8, "bool": ms.bool_,
})
_NAMES = {v: k for k, v in DTYPES.items()}
Tensor = ms.Tensor


def _dt(dtype):
    if dtype is None or not isinstance(dtype, str):
        return dtype
    return framework_dtype(DTYPES, dtype)


# ---- creation and conversion -------------------------------------------------------------

def tensor(data, dtype=None):
    if isinstance(data, ms.Tensor):
        return data if dtype is None else data.astype(_dt(dtype))
    arr = np.asarray(data)
    if arr.dtype == np.float64 and dtype is None:
        arr = arr.astype(np.float32)
    if dtype is not None and _dt(dtype) == ms.bfloat16:
        return ms.Tensor(arr.astype(np.float32)).astype(ms.bfloat16)
    return ms.Tensor(arr, dtype=_dt(dtype))


def to_numpy(x):
    if x.dtype == ms.bfloat16:
        x = x.astype(ms.float32)
    return x.asnumpy()


def is_tensor(x):
    return isinstance(x, ms.Tensor)


def zeros(shape, dtype="float32"):
    return P.zeros(tuple(shape), _dt(dtype))


def ones(shape, dtype="float32"):
    return P.ones(tuple(shape), _dt(dtype))


def full(shape, value, dtype="float32"):
    return P.full(tuple(shape), value, dtype=_dt(dtype))


def empty(shape, dtype="float32"):
    return P.zeros(tuple(shape), _dt(dtype))


def zeros_like(x, dtype=None):
    return P.zeros(x.shape, _dt(dtype) or x.dtype)


def ones_like(x, dtype=None):
    return P.ones(x.shape, _dt(dtype) or x.dtype)


def arange(start, end=None, step=1, dtype="int64"):
    if end is None:
        start, end = 0, start
    # built on the host: the bounds are Python numbers, and P.arange fails under jit's trace
    # capture (--compile)
    return ms.Tensor(np.arange(start, end, step), dtype=_dt(dtype))


def cast(x, dtype):
    dt = _dt(dtype)
    return x if x.dtype == dt else x.astype(dt)


def dtype_of(x) -> str:
    return _NAMES[x.dtype]


_BYTES = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "int16": 2, "int8": 1,
          "uint8": 1, "bool": 1}


def write_slice_(dst, src, dim: int, start: int) -> None:
    index = [slice(None)] * len(dst.shape)
    index[dim] = slice(start, start + src.shape[dim])
    dst[tuple(index)] = src.astype(dst.dtype)


def bitcast(x, dtype):
    if _BYTES[dtype] != _BYTES[dtype_of(x)]:
        raise ValueError(f"bitcast keeps the element size: {dtype_of(x)} is {_BYTES[dtype_of(x)]} bytes, "
                         f"{dtype} is {_BYTES[dtype]}")
    return x.view(_dt(dtype))


def numel(x) -> int:
    return int(x.size)


# ---- elementwise -------------------------------------------------------------------------

# MindSpore's CPU elementwise kernels are slow when an operand is broadcast: measured on 2
# cores, [8,8,256,256] + [256,256] takes 17.7 ms, the same add on two full tensors 1.9 ms,
# and tiling the small operand 0.6 ms. So a large broadcast operand is tiled first.
_TILE_ABOVE = 1 << 15


def _full(x, shape):
    if not isinstance(x, ms.Tensor) or tuple(x.shape) == tuple(shape) or int(np.prod(shape)) < _TILE_ABOVE:
        return x
    lead = (1,) * (len(shape) - x.ndim)
    x = P.reshape(x, lead + tuple(x.shape))
    return P.tile(x, tuple(t // s for t, s in zip(shape, x.shape)))


def _broadcast_pair(a, b):
    if not (isinstance(a, ms.Tensor) and isinstance(b, ms.Tensor)) or tuple(a.shape) == tuple(b.shape):
        return a, b
    shape = np.broadcast_shapes(tuple(a.shape), tuple(b.shape))
    return _full(a, shape), _full(b, shape)


def add(a, b):
    return P.add(*_broadcast_pair(a, b))


def sub(a, b):
    return P.sub(*_broadcast_pair(a, b))


def mul(a, b):
    return P.mul(*_broadcast_pair(a, b))


def div(a, b):
    return P.div(*_broadcast_pair(a, b))


neg, exp, log, sqrt, rsqrt, abs = P.neg, P.exp, P.log, P.sqrt, P.rsqrt, P.abs
pow, sigmoid, sin, cos = P.pow, P.sigmoid, P.sin, P.cos


def tanh(x):
    """MindSpore's CPU Tanh is off by up to 1e-4 in float32 (against float64; torch's by 1e-7),
    which moved Gemma 2's soft-capped logits by 1e-4 of their size; 2 sigmoid(2x) - 1 is within
    1.6e-6, and its gradient is tanh's, 1 - tanh(x)^2."""
    if x.dtype == ms.float64:
        return P.tanh(x)
    return P.sigmoid(x * 2.0) * 2.0 - 1.0


maximum, minimum = P.maximum, P.minimum
silu, relu = P.silu, P.relu
eq, ne, lt, le, gt, ge = P.equal, P.ne, P.lt, P.le, P.gt, P.ge
logical_and, logical_or, logical_not = P.logical_and, P.logical_or, P.logical_not
isfinite = P.isfinite


def gelu(x, approximate: str = "none"):
    return P.gelu(x, approximate=approximate)


def clamp(x, min=None, max=None):
    return P.clamp(x, min, max)


# ---- reductions --------------------------------------------------------------------------

def _all_dims(x, dim):
    return tuple(range(x.ndim)) if dim is None else dim


def sum(x, dim=None, keepdim=False):
    return P.sum(x, _all_dims(x, dim), keepdim)


def mean(x, dim=None, keepdim=False):
    return P.mean(x, _all_dims(x, dim), keepdim)


def amax(x, dim=None, keepdim=False):
    return P.amax(x, _all_dims(x, dim), keepdim)


def amin(x, dim=None, keepdim=False):
    return P.amin(x, _all_dims(x, dim), keepdim)


def argmax(x, dim=-1, keepdim=False):
    return P.argmax(x, dim, keepdim).astype(ms.int64)


def logsumexp(x, dim=-1, keepdim=False):
    return P.logsumexp(x, dim, keepdim)


# ---- linear algebra ----------------------------------------------------------------------

matmul, bmm = P.matmul, P.bmm


_matmul_nt = P.MatMul(transpose_b=True)


def linear(x, weight, bias=None):
    # A 2-D MatMul with transpose_b is the fastest CPU path: measured on 2 cores for
    # [2048,256] x [704,256]^T, 1.8 ms against 3.3 ms for ops.dense and 2.7 ms for a
    # batched matmul with weight.T.
    out = _matmul_nt(P.reshape(x, (-1, x.shape[-1])), weight)
    if bias is not None:
        out = out + bias
    return P.reshape(out, tuple(x.shape[:-1]) + (weight.shape[0],))


# ---- indexing ----------------------------------------------------------------------------

def gather(x, dim, index):
    return P.gather_elements(x, dim, index)


def scatter_add(x, dim, index, src):
    return P.tensor_scatter_elements(x, index, src, dim, "add")


def index_select(x, dim, index):
    return P.index_select(x, dim, index)


def masked_fill(x, mask, value):
    return P.masked_fill(x, _full(mask, x.shape), ms.Tensor(value, x.dtype))


def where(cond, a, b):
    if isinstance(a, ms.Tensor) and isinstance(b, ms.Tensor):
        shape = np.broadcast_shapes(tuple(cond.shape), tuple(a.shape), tuple(b.shape))
        cond, a, b = _full(cond, shape), _full(a, shape), _full(b, shape)
    return P.where(cond, a, b)


def tril(x, diagonal=0):
    return P.tril(x, diagonal)


def triu(x, diagonal=0):
    return P.triu(x, diagonal)


# ---- shape -------------------------------------------------------------------------------

def reshape(x, shape):
    return P.reshape(x, tuple(shape))


def transpose(x, dim0, dim1):
    return P.swapaxes(x, dim0, dim1)


def permute(x, dims):
    return P.permute(x, tuple(dims))


def cat(xs, dim=0):
    return P.cat(list(xs), dim)


def stack(xs, dim=0):
    xs = list(xs)
    if autograd.tracing():  # trace capture cannot differentiate Stack ("Bprop Stack: the pointer is null")
        dim = dim % (xs[0].ndim + 1)
        return P.cat([P.expand_dims(x, dim) for x in xs], dim)
    return P.stack(xs, dim)


def split(x, split_size_or_sections, dim=0):
    sections = split_size_or_sections
    return list(P.split(x, list(sections) if isinstance(sections, (list, tuple)) else sections, dim))


def chunk(x, chunks, dim=0):
    return list(P.chunk(x, chunks, dim))


def squeeze(x, dim):
    return P.squeeze(x, dim)


def unsqueeze(x, dim):
    return P.unsqueeze(x, dim)


def expand(x, shape):
    return P.broadcast_to(x, tuple(shape))


# ---- neural-network functions ------------------------------------------------------------

def softmax(x, dim=-1):
    return P.softmax(x, dim)


def log_softmax(x, dim=-1):
    return P.log_softmax(x, dim)


# ops.cross_entropy takes ~1.1 s forward and backward on [2048, 8192] logits on 2 cores; the
# hand-written one ~0.1 s (kernels.py)
cross_entropy = kernels.cross_entropy


def embedding(ids, weight):
    # ops.embedding has no CPU kernel; a gather along the vocabulary is the same lookup.
    return P.gather(weight, ids, 0)


def topk(x, k, dim=-1, largest=True):
    values, indices = P.topk(x, k, dim, largest)
    return values, indices.astype(ms.int64)


def cumsum(x, dim):
    return P.cumsum(x, dim)


def one_hot(ids, num_classes, dtype="float32"):
    on, off = ms.Tensor(1, _dt(dtype)), ms.Tensor(0, _dt(dtype))
    return P.one_hot(ids, num_classes, on, off)


def dropout(x, p, training=True):
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0
    # MindSpore's CPU random kernels cannot be replayed from a saved state, so the mask
    # comes from the backend's own generator (see random.py); the tracker can then fork it.
    return x * (random.draw("keep", x.shape, p) / (1.0 - p)).astype(x.dtype)


def rand(shape, dtype="float32"):
    return cast(random.draw("random", shape), dtype)


def randn(shape, dtype="float32"):
    return cast(random.draw("standard_normal", shape), dtype)


# ---- fused operators: native where the device has a kernel, composite otherwise -----------

def _ascend_kernels() -> dict:
    return {
        "rms_norm": lambda x, w, eps=1e-6: P.rms_norm(x, w, eps)[0],
        "swiglu": lambda x: P.swiglu(x, -1),
    }


def _native_kernels(device_type: str) -> dict:
    native = {"adamw_step": kernels.adamw_step}  # AdamWeightDecay has CPU, GPU and Ascend kernels
    if device_type == "npu":
        native.update(_ascend_kernels())
    return native


def _bind(native: dict) -> dict:
    kinds = composite.bind_fused(globals(), native)
    # where no native kernel is bound, the composite with a hand-written backward (kernels.py)
    # stands in for the reference one: the same math, without MindSpore's slow broadcasts
    for name, fn in kernels.KERNELS.items():
        if kinds[name] == "composite":
            globals()[name] = fn
    return kinds


# Until binding picks the device's kernels (bind_fused below), every fused op is its
# composite; bind_fused() sets the module-level names rms_norm, layer_norm, swiglu,
# apply_rotary, attention, matmul_add and grouped_matmul.
_IMPLEMENTATIONS: dict = _bind({})  # until bind_fused


def bind_fused(device_type: str) -> None:
    _IMPLEMENTATIONS.clear()
    _IMPLEMENTATIONS.update(_bind(_native_kernels(device_type)))


def implementations() -> dict:
    return dict(_IMPLEMENTATIONS)
