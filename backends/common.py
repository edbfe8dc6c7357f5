"""Framework-free helpers that both backends share (numpy only)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from mindspeed_core import features
from mindspeed_core.errors import BackendError, MindSpeedError
from mindspeed_core.facade import DTYPES
from mindspeed_core.runtime import DEVICE_ALIASES


def host_memory_stats() -> dict:
    """Resident and peak resident memory of this process, in bytes (Linux /proc)."""
    stats = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    stats["host_rss_bytes" if key == "VmRSS" else "host_peak_rss_bytes"] = (
                        int(rest.split()[0]) * 1024
                    )
    except OSError:
        pass
    return stats


def host_memory_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (Linux MemAvailable)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits_in_memory(needed: int, what: str) -> None:
    """Refuse, before allocating, what cannot fit in this machine's memory."""
    available = host_memory_available()
    if available is not None and needed > available:
        raise MindSpeedError(f"{what} needs about {needed / 2**30:.1f} GiB but this machine has "
                             f"{available / 2**30:.1f} GiB available")


def measure_matmul_rate(ops, synchronize, n: int = 1024, dtype: str = "float32",
                        min_seconds: float = 0.5) -> float:
    """Floating-point operations per second of an n x n matmul on the bound device.

    Repeats the product until ``min_seconds`` have passed (after one warm-up), so that the
    figure is a rate, not a latency. Used as the peak for MFU.
    """
    a = ops.tensor(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32), dtype=dtype)
    b = ops.tensor(np.random.default_rng(1).standard_normal((n, n)).astype(np.float32), dtype=dtype)
    ops.matmul(a, b)
    synchronize()
    reps, start = 0, time.perf_counter()
    while True:
        ops.matmul(a, b)
        reps += 1
        if reps % 4 == 0:
            synchronize()
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                return 2.0 * n ** 3 * reps / elapsed


def choose_device(wanted: str, available: list[str], framework: str) -> str:
    """Resolve a requested device (auto, cpu, cuda/gpu, npu/ascend) against what the
    framework sees, best first; BackendError when it is not there."""
    wanted = DEVICE_ALIASES.get(wanted, wanted)
    if wanted == "auto":
        return available[0]
    if wanted not in available:
        raise BackendError(f"device {wanted!r} is not available to {framework} here "
                           f"(available: {', '.join(available)})")
    return wanted


def env_int(*names: str, default: int | None = None) -> int | None:
    """The first of the environment variables that is set, as an int."""
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


@dataclass(frozen=True)
class Group:
    """A process group: its global ranks, in group-rank order, and the backend's handle
    (a key of the torch backend's group table, or a MindSpore group name; None for the
    world group)."""

    ranks: tuple
    handle: object = field(default=None, compare=False)


class Pending:
    """A collective under way (or done): ``wait()`` blocks until ``handle`` (the framework's work
    handle; None: nothing to wait for) is done and returns the result: what the collective
    wrote (``out``), or ``finish`` of it."""

    def __init__(self, out, handle=None, finish=None):
        self._out, self._handle, self._finish = out, handle, finish

    def wait(self):
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
            if self._finish is not None:
                self._out, self._finish = self._finish(self._out), None
        return self._out


class GradHooks:
    """autograd.grad_hooks for frameworks whose parameters take ``register_hook(fn(grad))`` and
    return a handle with ``remove()`` (PyTorch; MindSpore's PyNative, where the hook sees the
    total over every use, recomputed segments and vjp pullbacks included: measured on 2.10)."""

    def __init__(self, params, callback):
        self.params, self.callback, self.handles = list(params), callback, []

    def __enter__(self):
        for k, p in enumerate(self.params):
            self.handles.append(p.register_hook(lambda g, k=k: self.callback(k, g)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []


def dtype_table(framework_dtypes: dict) -> dict:
    """The facade dtype name -> framework dtype table a backend's ops convert with, checked to
    name exactly the facade's dtypes (:data:`mindspeed_core.facade.DTYPES`)."""
    if tuple(framework_dtypes) != DTYPES:
        raise RuntimeError(f"a backend's dtype table must list {DTYPES}, in that order")
    return framework_dtypes


def framework_dtype(table: dict, dtype: str):
    """The framework dtype of a facade dtype name; an unknown name is the caller's error."""
    try:
        return table[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {dtype!r}; facade dtypes are {', '.join(DTYPES)}") from None


ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1,
            "uint8": 1, "bool": 1}


class CommStats:
    """Bytes moved per collective on this rank. ``bytes`` is the payload the caller handed
    in (what an analytical count predicts); ``wire_bytes`` is what reached the framework's
    primitives, larger where a collective is emulated (MindSpore CPU)."""

    def __init__(self):
        self.reset()
        self.current = None

    def reset(self) -> None:
        self.ops: dict = {}

    def record(self, op: str, nbytes: int, wire: int | None = None) -> None:
        features.note_used("collectives")  # a collective over more than one rank ran
        entry = self.ops.setdefault(op, {"calls": 0, "bytes": 0, "wire_bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += int(nbytes)
        entry["wire_bytes"] += int(nbytes if wire is None else wire)

    def add_wire(self, nbytes: int) -> None:
        """Credit primitive traffic to the collective being emulated."""
        if self.current is not None:
            self.ops[self.current]["wire_bytes"] += int(nbytes)

    def snapshot(self) -> dict:
        return {op: dict(v) for op, v in self.ops.items()}
