"""Facade ops bound to PyTorch (CPU, CUDA, and Ascend NPU kernels through torch_npu)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mindspeed_core import composite
from mindspeed_core.backends.common import dtype_table, framework_dtype

from . import device

DTYPES = dtype_table({
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
})
_NAMES = {v: k for k, v in DTYPES.items()}
Tensor = torch.Tensor


def _dt(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return framework_dtype(DTYPES, str(dtype))


def _dev():
    return device.torch_device()


# ---- creation and conversion -------------------------------------------------------------

def tensor(data, dtype=None):
    if isinstance(data, torch.Tensor):
        return data.to(device=_dev(), dtype=_dt(dtype))
    arr = np.asarray(data)
    if arr.dtype == np.float64 and dtype is None:
        arr = arr.astype(np.float32)  # the facade's default float type, as on MindSpore
    out = torch.as_tensor(arr, device=_dev())
    return out if dtype is None else out.to(_dt(dtype))


def to_numpy(x):
    x = x.detach()
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.cpu().numpy()


def is_tensor(x):
    return isinstance(x, torch.Tensor)


def zeros(shape, dtype="float32"):
    return torch.zeros(tuple(shape), dtype=_dt(dtype), device=_dev())


def ones(shape, dtype="float32"):
    return torch.ones(tuple(shape), dtype=_dt(dtype), device=_dev())


def full(shape, value, dtype="float32"):
    return torch.full(tuple(shape), value, dtype=_dt(dtype), device=_dev())


def empty(shape, dtype="float32"):
    return torch.empty(tuple(shape), dtype=_dt(dtype), device=_dev())


def zeros_like(x, dtype=None):
    return torch.zeros_like(x, dtype=_dt(dtype))


def ones_like(x, dtype=None):
    return torch.ones_like(x, dtype=_dt(dtype))


def arange(start, end=None, step=1, dtype="int64"):
    if end is None:
        start, end = 0, start
    return torch.arange(start, end, step, dtype=_dt(dtype), device=_dev())


def cast(x, dtype):
    return x.to(_dt(dtype))


def dtype_of(x) -> str:
    return _NAMES[x.dtype]


def write_slice_(dst, src, dim: int, start: int) -> None:
    with torch.no_grad():
        dst.narrow(dim, start, src.shape[dim]).copy_(src)


def bitcast(x, dtype):
    dt = _dt(dtype)
    if dt.itemsize != x.dtype.itemsize:
        raise ValueError(f"bitcast keeps the element size: {dtype_of(x)} is {x.dtype.itemsize} bytes, "
                         f"{dtype} is {dt.itemsize}")
    return x.view(dt)


def numel(x) -> int:
    return x.numel()


# ---- elementwise -------------------------------------------------------------------------

add, sub, mul, div = torch.add, torch.sub, torch.mul, torch.div
neg, exp, log, sqrt, rsqrt, abs = torch.neg, torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.abs
pow, tanh, sigmoid, sin, cos = torch.pow, torch.tanh, torch.sigmoid, torch.sin, torch.cos
maximum, minimum = torch.maximum, torch.minimum
silu, relu = F.silu, F.relu
eq, ne, lt, le, gt, ge = torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge
logical_and, logical_or, logical_not = torch.logical_and, torch.logical_or, torch.logical_not
isfinite = torch.isfinite


def gelu(x, approximate: str = "none"):
    return F.gelu(x, approximate=approximate)


def clamp(x, min=None, max=None):
    return torch.clamp(x, min=min, max=max)


# ---- reductions --------------------------------------------------------------------------

def _reduce(fn, x, dim, keepdim):
    if dim is None:
        out = fn(x)
        return out.reshape([1] * x.dim()) if keepdim else out
    return fn(x, dim=dim, keepdim=keepdim)


def sum(x, dim=None, keepdim=False):
    return _reduce(torch.sum, x, dim, keepdim)


def mean(x, dim=None, keepdim=False):
    return _reduce(torch.mean, x, dim, keepdim)


def amax(x, dim=None, keepdim=False):
    return _reduce(torch.amax, x, dim, keepdim)


def amin(x, dim=None, keepdim=False):
    return _reduce(torch.amin, x, dim, keepdim)


def argmax(x, dim=-1, keepdim=False):
    return torch.argmax(x, dim=dim, keepdim=keepdim)


def logsumexp(x, dim=-1, keepdim=False):
    return torch.logsumexp(x, dim=dim, keepdim=keepdim)


# ---- linear algebra ----------------------------------------------------------------------

matmul, bmm = torch.matmul, torch.bmm


def linear(x, weight, bias=None):
    return F.linear(x, weight, bias)


# ---- indexing ----------------------------------------------------------------------------

def gather(x, dim, index):
    return torch.gather(x, dim, index)


def scatter_add(x, dim, index, src):
    return torch.scatter_add(x, dim, index, src)


def index_select(x, dim, index):
    return torch.index_select(x, dim, index)


def masked_fill(x, mask, value):
    return torch.masked_fill(x, mask, value)


def where(cond, a, b):
    return torch.where(cond, a, b)


def tril(x, diagonal=0):
    return torch.tril(x, diagonal)


def triu(x, diagonal=0):
    return torch.triu(x, diagonal)


# ---- shape -------------------------------------------------------------------------------

def reshape(x, shape):
    return torch.reshape(x, tuple(shape))


def transpose(x, dim0, dim1):
    return torch.transpose(x, dim0, dim1)


def permute(x, dims):
    return x.permute(*dims)


def cat(xs, dim=0):
    return torch.cat(list(xs), dim=dim)


def stack(xs, dim=0):
    return torch.stack(list(xs), dim=dim)


def split(x, split_size_or_sections, dim=0):
    return list(torch.split(x, split_size_or_sections, dim=dim))


def chunk(x, chunks, dim=0):
    return list(torch.chunk(x, chunks, dim=dim))


def squeeze(x, dim):
    return torch.squeeze(x, dim)


def unsqueeze(x, dim):
    return torch.unsqueeze(x, dim)


def expand(x, shape):
    return x.expand(*shape)


# ---- neural-network functions ------------------------------------------------------------

def softmax(x, dim=-1):
    return torch.softmax(x, dim=dim)


def log_softmax(x, dim=-1):
    return torch.log_softmax(x, dim=dim)


def cross_entropy(logits, target, ignore_index=-100, reduction="mean"):
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


def embedding(ids, weight):
    return F.embedding(ids, weight)


def topk(x, k, dim=-1, largest=True):
    values, indices = torch.topk(x, k, dim=dim, largest=largest)
    return values, indices


def cumsum(x, dim):
    return torch.cumsum(x, dim=dim)


def one_hot(ids, num_classes, dtype="float32"):
    return F.one_hot(ids.long(), num_classes).to(_dt(dtype))


def dropout(x, p, training=True):
    return F.dropout(x, p=p, training=training)


def rand(shape, dtype="float32"):
    return torch.rand(tuple(shape), dtype=_dt(dtype), device=_dev())


def randn(shape, dtype="float32"):
    return torch.randn(tuple(shape), dtype=_dt(dtype), device=_dev())


# ---- fused operators: native where the device has a kernel, composite otherwise -----------

def _native_rms_norm(x, weight, eps=1e-6):
    # F.rms_norm computes in the input dtype; the composite computes in fp32 like HF Llama,
    # so low-precision inputs are lifted first to keep the two in agreement.
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return y * weight


def _native_layer_norm(x, weight, bias=None, eps=1e-5):
    return F.layer_norm(x.float(), (x.shape[-1],), None, None, eps).to(x.dtype) * weight + (0 if bias is None else bias)


def _native_attention(q, k, v, causal=False, mask=None, dropout_p=0.0, scale=None, segment_ids=None,
                      return_lse=False, window=None, softcap=None):
    if return_lse or softcap is not None:
        # torch's CPU flash kernel returns the log-sum-exp but does not differentiate it (a
        # merge of partial results would get wrong gradients), and SDPA has no soft-capping:
        # the composite does both
        return composite.attention(q, k, v, causal=causal, mask=mask, dropout_p=dropout_p, scale=scale,
                                   segment_ids=segment_ids, return_lse=return_lse, window=window, softcap=softcap)
    composite.check_attention_shapes(q, k, v)
    sq, sk = q.shape[1], k.shape[1]
    attn_mask, is_causal = mask, causal
    if segment_ids is not None or window is not None or (causal and (mask is not None or sq != sk)):
        # SDPA aligns its causal mask top-left and refuses a mask together with is_causal;
        # the facade's causal mask is aligned bottom-right: one explicit mask instead
        attn_mask, is_causal = composite.attention_keep(sq, sk, causal, mask, segment_ids, window), False
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask,
        dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)


def _native_matmul_add(a, b, acc):
    return torch.addmm(acc, a.float(), b.float()) if a.dim() == 2 else acc + torch.matmul(a.float(), b.float())


class _GroupedMM(torch.autograd.Function):
    """torch._grouped_mm with its backward written here (the CPU kernel has none): the input's
    gradient is dy's groups times each weight transposed, the weight's each group's x^T dy, both
    grouped calls of the same kernel."""

    @staticmethod
    def forward(ctx, x, weight, offs):
        ctx.save_for_backward(x, weight, offs)
        return torch._grouped_mm(x, weight, offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, weight.transpose(1, 2), offs=offs) if ctx.needs_input_grad[0] else None
        dw = torch._grouped_mm(x.t(), dy, offs=offs) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def _grouped_mm_takes(x, weight) -> bool:
    """Whether torch's grouped-matmul kernel takes these operands: the release has it, 2-D rows
    by 3-D weights of one floating dtype, and (its rule) every row 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm") or x.dim() != 2 or weight.dim() != 3 or x.dtype != weight.dtype:
        return False
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type not in ("cpu", "cuda"):
        return False
    size = x.element_size()
    return (x.shape[1] * size) % 16 == 0 and (weight.shape[2] * size) % 16 == 0


def _native_grouped_matmul(x, weight, group_sizes):
    """The experts' grouped matmul as one torch._grouped_mm call (one kernel for every expert,
    the same products as the composite's matmul per expert); the composite where the kernel
    does not take the shapes (and on releases without it)."""
    if not _grouped_mm_takes(x, weight):
        return composite.grouped_matmul(x, weight, group_sizes)
    sizes = [int(s) for s in group_sizes]
    if len(sizes) != weight.shape[0] or int(np.sum(sizes)) != x.shape[0]:
        return composite.grouped_matmul(x, weight, group_sizes)  # its own error message
    offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device=x.device)
    return _GroupedMM.apply(x.contiguous(), weight, offs)


def _native_solve_unit_lower(a, b):
    return torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)


def _npu_kernels():
    import torch_npu  # noqa: F401  (only reached on an NPU device)

    return {
        "rms_norm": lambda x, w, eps=1e-6: torch_npu.npu_rms_norm(x, w, epsilon=eps)[0],
        "swiglu": lambda x: torch_npu.npu_swiglu(x, dim=-1),
        "apply_rotary": lambda x, cos, sin: torch_npu.npu_rotary_mul(
            x, *(t.reshape(1, t.shape[0], 1, t.shape[1]) if t.dim() == 2 else t for t in (cos, sin))
        ),
    }


def _native_adamw_step(weights, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decays, step):
    # torch's fused AdamW kernel (CPU and CUDA): one call per weight-decay value, in place.
    # The CPU kernel walks every tensor as if it were laid out like a contiguous one (a
    # transposed gradient or a column slice of a loaded moment gives silently wrong
    # updates; torch.optim checks layouts before calling it, we call it directly), so all
    # inputs are made contiguous first and the contiguous tensors are what is returned.
    weights, grads, exp_avgs, exp_avg_sqs = ([t.contiguous() for t in ts] for ts in (weights, grads, exp_avgs, exp_avg_sqs))
    groups: dict = {}
    for i, wd in enumerate(weight_decays):
        groups.setdefault(float(wd), []).append(i)
    with torch.no_grad():
        for wd, idx in groups.items():
            torch._fused_adamw_([weights[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                                [exp_avg_sqs[i] for i in idx], [],
                                [torch.tensor(float(step)) for _ in idx], lr=lr, beta1=beta1,
                                beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
    return weights, exp_avgs, exp_avg_sqs


def _native_kernels(device_type: str) -> dict:
    native = {
        "adamw_step": _native_adamw_step,
        "rms_norm": _native_rms_norm,
        "layer_norm": _native_layer_norm,
        "attention": _native_attention,
        "matmul_add": _native_matmul_add,
        "solve_unit_lower": _native_solve_unit_lower,
    }
    if hasattr(torch, "_grouped_mm") and device_type in ("cpu", "cuda"):
        native["grouped_matmul"] = _native_grouped_matmul
    if device_type == "npu":
        native.update(_npu_kernels())
    return native


# Until binding picks the device's kernels (bind_fused below), every fused op is its
# composite; bind_fused() sets the module-level names rms_norm, layer_norm, swiglu,
# apply_rotary, attention, matmul_add and grouped_matmul.
_IMPLEMENTATIONS: dict = composite.bind_fused(globals(), {})


def bind_fused(device_type: str) -> None:
    """Point each fused op at the native kernel of the device, or at its composite."""
    _IMPLEMENTATIONS.clear()
    _IMPLEMENTATIONS.update(composite.bind_fused(globals(), _native_kernels(device_type)))


def implementations() -> dict:
    """Which implementation each fused op uses on the selected device: native or composite."""
    return dict(_IMPLEMENTATIONS)
