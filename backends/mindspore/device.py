"""Device selection and device facts for the MindSpore backend.

``auto`` picks Ascend, then GPU, then CPU. Device names are the facade's (cpu, cuda, npu),
mapped to MindSpore's targets (CPU, GPU, Ascend).
"""

from __future__ import annotations

import os

import mindspore as ms
from mindspore._c_expression import RuntimeConf

from mindspeed_core.backends.common import choose_device, host_memory_stats, measure_matmul_rate

_TARGETS = {"npu": "Ascend", "cuda": "GPU", "cpu": "CPU"}
_selected = {"type": "cpu"}


def available() -> list[str]:
    return [kind for kind, target in _TARGETS.items() if ms.hal.is_available(target)]


def select(wanted: str = "auto") -> str:
    wanted = choose_device(wanted, available(), "MindSpore")
    if wanted == "cpu":
        host_blocking_run()
    ms.set_device(_TARGETS[wanted])
    if wanted == "cpu":
        # PyNative's asynchronous dispatch hands every op to another thread; on a CPU that
        # thread competes with the kernels for the same cores. Measured on 2 cores: a
        # 131k-element add 1.2 ms async vs 0.04 ms blocking, a [1024,128]x[128,384] matmul
        # 0.85 vs 0.49 ms. Blocking also makes a failing kernel raise at its own call.
        ms.runtime.launch_blocking()
    _selected["type"] = wanted
    return wanted


def host_blocking_run() -> None:
    """Even with launch_blocking, each op passes through a queue whose worker thread waits for
    work by spinning (sched_yield); MS_DEV_HOST_BLOCKING_RUN runs the op on the calling thread
    instead (MindSpore reads it at the first op). See share_the_cores for what was measured."""
    os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")


def share_the_cores() -> None:
    """Where the job says how many threads a rank gets (OMP_NUM_THREADS: torchrun sets 1 for
    several ranks a node, and so does `mindspeed launch` for msrun), MindSpore's CPU kernel
    pool and its runtime pool are sized to it, as torch sizes its intra-op pool; by default
    they spin waiting for work, and several ranks on a few cores then spend their time
    yielding to each other. Set as MindSpore is imported, before any op starts the pools.
    Measured on 2 cores: the 35 cases of test_parallel's four-rank launch took 166 s against
    222 s (its 25 two-rank cases 48 s against 59 s); launches of a few cases vary too much from
    run to run to show it (31-44 s without, 34-40 s with). One process alone: unchanged."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if not (threads.isdigit() and int(threads) > 0) or available() != ["cpu"]:
        return  # with an accelerator the runtime pool dispatches its kernels: left as MindSpore sets it
    conf = RuntimeConf.get_instance()  # each can be set once a process
    if not conf.is_op_threads_num_configured():
        ms.device_context.cpu.op_tuning.threads_num(int(threads))
    if not conf.is_dispatch_threads_num_configured():
        ms.runtime.dispatch_threads_num(int(threads))


def type() -> str:  # noqa: A001 - facade name
    return _selected["type"]


def current() -> str:
    return _selected["type"]


def target() -> str:
    """MindSpore's own name of the selected device (CPU, GPU, Ascend)."""
    return _TARGETS[_selected["type"]]


def synchronize() -> None:
    """Wait for queued work. PyNative runs ops asynchronously; ms.runtime.synchronize()
    refuses the CPU, where the PyNative executor's own sync is the way."""
    if _selected["type"] == "cpu":
        from mindspore.common.api import _pynative_executor

        _pynative_executor.sync()
    else:
        ms.runtime.synchronize()


def supports_dtype(dtype: str) -> bool:
    """Whether training math runs in this dtype: MindSpore's CPU MatMul has no float16 or
    bfloat16 kernel ("Select CPU operator[BatchMatMul] fail! Unsupported data type")."""
    if _selected["type"] == "cpu":
        return dtype in ("float32", "float64")
    return dtype in ("float32", "float16", "bfloat16")


def memory_stats() -> dict:
    stats = host_memory_stats()
    if _selected["type"] != "cpu":
        stats.update(
            allocated_bytes=ms.runtime.memory_allocated(), reserved_bytes=ms.runtime.memory_reserved(),
            peak_allocated_bytes=ms.runtime.max_memory_allocated(),
        )
    return stats


def set_deterministic(on: bool = True) -> None:
    """MindSpore's deterministic kernels; on Ascend also HCCL's deterministic reductions
    (read when communication starts, so this runs before the job's collectives are set up).
    MindSpore takes the setting once per process; asking again for the same is a no-op."""
    import os

    if _selected.get("deterministic") == on:
        return
    if "deterministic" in _selected:
        raise RuntimeError("MindSpore sets deterministic computing once per process; start a new process to change it")
    _selected["deterministic"] = on
    if on:
        os.environ["HCCL_DETERMINISTIC"] = "true"
    else:
        os.environ.pop("HCCL_DETERMINISTIC", None)
    ms.set_deterministic(on)


def to_host(x):
    """A copy of x in host memory."""
    return x.copy() if _selected["type"] == "cpu" else x.move_to("CPU")


def to_device(x):
    return x if _selected["type"] == "cpu" else x.move_to("Ascend" if _selected["type"] == "npu" else "GPU")


def matmul_rate(n: int = 1024, dtype: str = "float32", min_seconds: float = 0.5) -> float:
    from . import ops

    return measure_matmul_rate(ops, synchronize, n, dtype, min_seconds)
