"""Device selection and device facts for the PyTorch backend.

``auto`` picks an Ascend NPU when torch_npu imports and sees one, then CUDA, then the CPU.
torch_npu is detected, never required: on a machine without Ascend's CANN, importing it
fails, and that only means there is no NPU.
"""

from __future__ import annotations

import torch

from mindspeed_core.backends.common import choose_device, host_memory_stats, measure_matmul_rate

_selected = {"type": "cpu"}


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure (missing CANN included) means "no NPU"
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def available() -> list[str]:
    found = ["cpu"]
    if torch.cuda.is_available():
        found.insert(0, "cuda")
    if _npu_available():
        found.insert(0, "npu")
    return found


def select(wanted: str = "auto") -> str:
    wanted = choose_device(wanted, available(), "PyTorch")
    _selected["type"] = wanted
    if wanted == "cuda":
        torch.cuda.set_device(_local_index())
    elif wanted == "npu":
        torch.npu.set_device(_local_index())
    return wanted


def _local_index() -> int:
    import os

    return int(os.environ.get("LOCAL_RANK", "0"))


def type() -> str:  # noqa: A001 - facade name
    return _selected["type"]


def current() -> str:
    kind = _selected["type"]
    return kind if kind == "cpu" else f"{kind}:{_local_index()}"


def torch_device() -> torch.device:
    return torch.device(current())


def synchronize() -> None:
    kind = _selected["type"]
    if kind == "cuda":
        torch.cuda.synchronize()
    elif kind == "npu":
        torch.npu.synchronize()


def supports_dtype(dtype: str) -> bool:
    """Whether training math (matmul and elementwise) runs in this dtype on the device."""
    return dtype in ("float32", "float64", "bfloat16", "float16")


def memory_stats() -> dict:
    """Allocator statistics of the device in bytes, plus the host process's resident memory."""
    stats = host_memory_stats()
    kind = _selected["type"]
    if kind in ("cuda", "npu"):
        mod = getattr(torch, kind)
        stats.update(
            allocated_bytes=mod.memory_allocated(), reserved_bytes=mod.memory_reserved(),
            peak_allocated_bytes=mod.max_memory_allocated(),
        )
    return stats


def set_deterministic(on: bool = True) -> None:
    """Deterministic kernels and, on accelerators, deterministic collectives. cuBLAS needs a
    fixed workspace, HCCL its own switch; both are read when the library starts, so this
    runs before the first kernel and before the job's collectives are set up."""
    import os

    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ["HCCL_DETERMINISTIC"] = "true"
    else:
        os.environ.pop("HCCL_DETERMINISTIC", None)
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    if on:
        torch.backends.cudnn.benchmark = False  # autotuning may pick another kernel per run


def to_host(x):
    """A copy of x in host memory (page-locked when a device will copy it back)."""
    host = x.detach().to("cpu", copy=True)
    return host.pin_memory() if _selected["type"] in ("cuda", "npu") else host


def to_device(x):
    return x.to(torch_device(), non_blocking=True)


def matmul_rate(n: int = 1024, dtype: str = "float32", min_seconds: float = 0.5) -> float:
    """Measured matmul FLOP/s of the device (the peak that MFU is reported against)."""
    from . import ops

    return measure_matmul_rate(ops, synchronize, n, dtype, min_seconds)
