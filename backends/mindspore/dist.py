"""Process groups and collectives for the MindSpore backend (mindspore.communication).

Launched by msrun (MS_WORKER_NUM / MS_ROLE in the environment) the process joins with
mccl on CPU, nccl on GPU, hccl on Ascend; alone, every collective is the identity. The
facade is functional and ``src``/``dst`` are global ranks, as on the torch backend.

On CPU, mccl's AllReduce (float32/float16, SUM only, any group) is the one collective
used natively: AllGather and Broadcast work only on the world group, and ReduceScatter,
AlltoAll, Send/Receive and Barrier have no CPU kernel. Everything else is composed from
that sum in backends/emulated_collectives.py with identical results, and reported as
"emulated" by implementations(). On GPU/Ascend the same emulation runs for now (correct,
not fast): binding the native HCCL/NCCL primitives there needs a machine to test on.
"""

from __future__ import annotations

import os

import mindspore as ms
import numpy as np
from mindspore import communication as comm
from mindspore import ops as P
from mindspore.mint import distributed as mint_dist

import contextlib

from mindspeed_core.backends.common import ITEMSIZE, CommStats, Group, Pending, env_int
from mindspeed_core.backends.emulated_collectives import EmulatedCollectives

from . import autograd, device, ops

_state = {"initialized": False, "groups": {}, "reducers": {}}
_stats = CommStats()


def launched_world_size() -> int:
    if not os.environ.get("MS_ROLE"):
        return 1
    return env_int("MS_WORKER_NUM", "RANK_SIZE", default=1)


def init() -> None:
    # under msrun even one worker joins the cluster: msrun also starts the script as its
    # scheduler, which must become the scheduler (in comm.init), not a second trainer
    if _state["initialized"] or not os.environ.get("MS_ROLE"):
        return
    comm.init({"cpu": "mccl", "cuda": "nccl", "npu": "hccl"}[device.type()])
    _state["initialized"] = True


def is_initialized() -> bool:
    return _state["initialized"]


def shutdown(wait: bool = True) -> None:
    """Leave the job; ``wait``: first meet every rank at a barrier (False on a failing rank)."""
    if _state["initialized"]:
        if wait:
            barrier()
        comm.release()
        _state["initialized"] = False
        _state["groups"].clear()  # a later job creates its groups (and their primitives) anew
        _state["reducers"].clear()


def world_size(group: Group | None = None) -> int:
    if group is not None:
        return len(group.ranks)
    return comm.get_group_size() if _state["initialized"] else 1


def rank(group: Group | None = None) -> int:
    me = comm.get_rank() if _state["initialized"] else 0
    if group is None:
        return me
    return group.ranks.index(me) if me in group.ranks else -1


def _group_name(ranks: tuple) -> str | None:
    """MindSpore's name for a group, created on first use. Unlike torch's new_group, only
    members may call create_group, so non-members get no name."""
    if ranks == tuple(range(world_size())):
        return comm.GlobalComm.WORLD_COMM_GROUP
    if rank() not in ranks:
        return None
    name = "g_" + "_".join(map(str, ranks))
    if name not in _state["groups"]:
        comm.create_group(name, list(ranks))
        _state["groups"][name] = ranks
    return name


def new_group(ranks) -> Group:
    """A group of the given global ranks. Every process calls it (as with torch); only the
    members create it in MindSpore."""
    ranks = tuple(int(r) for r in ranks)
    return Group(ranks, _group_name(ranks) if _state["initialized"] else None)


def _handle(group):
    return comm.GlobalComm.WORLD_COMM_GROUP if group is None else group.handle


def _summer(group):
    """The group's AllReduce(SUM) primitive, made once: making one costs about as much as the
    collective itself on CPU (measured on 2 ranks: 1.1 ms a call made anew, 0.7 ms reused)."""
    name = _handle(group)
    if name not in _state["reducers"]:
        _state["reducers"][name] = P.AllReduce(P.ReduceOp.SUM, name)
    return _state["reducers"][name]


def _sum_f32(array: np.ndarray, group) -> np.ndarray:
    array = np.ascontiguousarray(array, dtype=np.float32)
    _stats.add_wire(array.nbytes)
    return _summer(group)(ms.Tensor(array)).asnumpy()


_emulated = EmulatedCollectives(_sum_f32, world_size, rank)


def _alone(group) -> bool:
    return world_size(group) == 1


def _nbytes(x) -> int:
    return ops.numel(x) * ITEMSIZE[ops.dtype_of(x)]


@contextlib.contextmanager
def _recording(op: str, payload_bytes: int):
    """Count the caller's payload for ``op``; the primitives called inside add the bytes
    they really move (the emulation's overhead)."""
    _stats.record(op, payload_bytes, wire=0)
    outer, _stats.current = _stats.current, op
    try:
        yield
    finally:
        _stats.current = outer


def comm_stats() -> dict:
    """{collective: {"calls", "bytes", "wire_bytes"}} on this rank since the last reset."""
    return _stats.snapshot()


def reset_comm_stats() -> None:
    _stats.reset()


def _back(array, like):
    return ops.tensor(array, dtype=ops.dtype_of(like))


def all_reduce(x, op: str = "sum", group: Group | None = None):
    if _alone(group):
        return x.copy()
    with _recording("all_reduce", _nbytes(x)):
        return _reduce(x, op, group)


def _reduce(x, op: str, group):
    """The reduction itself: mccl's native SUM for float32/float16, the emulation otherwise
    (while tracing, a sum of another float type is a float32 sum rounded back)."""
    if op == "sum" and x.dtype in (ms.float32, ms.float16):
        _stats.add_wire(_nbytes(x))
        return _summer(group)(x)
    if op == "sum" and autograd.tracing() and x.dtype in (ms.bfloat16, ms.float64):
        return _reduce(x.astype(ms.float32), op, group).astype(x.dtype)
    return _back(_emulated.all_reduce(_to_host(x, f"all_reduce({op!r})"), op, group), x)


def _to_host(x, what: str) -> np.ndarray:
    """x's values for the host emulation; refused while tracing, where they would be frozen
    into the graph as the values of the trace."""
    if autograd.tracing():
        raise NotImplementedError(f"{what} of {x.dtype} runs on the host here, which a compiled (traced) step "
                                  f"cannot follow")
    return ops.to_numpy(x)


def sum_gradient(x, group: Group | None = None):
    """x itself; its gradient is summed over the group in backward. InsertGradientOf keeps
    that under trace capture too (it compiles the function it is given: plain primitives)."""
    if _alone(group):
        return x
    reducer = _summer(group)

    def summed(grad):
        return P.cast(reducer(P.cast(grad, ms.float32)), grad.dtype)

    return P.InsertGradientOf(summed)(x)


def all_reduce_async(x, group: Group | None = None):
    """Start summing x over the group: mccl's asynchronous all-reduce (mint.distributed, on a
    copy: it reduces in place) for float32/float16; other dtypes are summed at once (emulated)."""
    if _alone(group):
        return Pending(x.copy())
    if x.dtype not in (ms.float32, ms.float16):
        return Pending(all_reduce(x, group=group))
    out = x.copy()
    with _recording("all_reduce", _nbytes(x)):
        _stats.add_wire(_nbytes(x))
        handle = mint_dist.all_reduce(out, op="sum", group=_handle(group), async_op=True)
    return Pending(out, handle)


def all_gather_async(x, group: Group | None = None):
    """Start gathering every member's x: the emulated gather's exact exchange (each rank's
    bytes in its own slot of a float32 sum) on mccl's asynchronous all-reduce."""
    if _alone(group):
        return Pending(x.copy())
    arr = ops.to_numpy(x)
    slots = ms.Tensor(_emulated.gather_slots(arr, group))
    with _recording("all_gather", _nbytes(x)):
        _stats.add_wire(slots.nbytes)
        handle = mint_dist.all_reduce(slots, op="sum", group=_handle(group), async_op=True)
    return Pending(slots, handle, finish=lambda summed: _back(np.concatenate(list(
        _emulated.gathered(summed.asnumpy(), arr.dtype, arr.shape)), axis=0), x))


def all_gather(x, group: Group | None = None, dim: int = 0):
    if _alone(group):
        return x.copy()
    with _recording("all_gather", _nbytes(x)):
        parts = _emulated.all_gather_stack(_to_host(x, "all_gather"), group)
    return _back(np.concatenate(list(parts), axis=dim), x)


def reduce_scatter(x, op: str = "sum", group: Group | None = None, dim: int = 0):
    n = world_size(group)
    if n == 1:
        return x.copy()
    with _recording("reduce_scatter", _nbytes(x)):
        full = _reduce(x, op, group)
    return ops.chunk(full, n, dim)[rank(group)]


def all_to_all(x, group: Group | None = None, input_splits=None, output_splits=None):
    n = world_size(group)
    if n == 1:
        return x.copy()
    arr = _to_host(x, "all_to_all")
    if input_splits is None:
        input_splits = [arr.shape[0] // n] * n
    chunks = np.split(arr, np.cumsum(input_splits)[:-1])
    with _recording("all_to_all", _nbytes(x)):
        received = _emulated.all_to_all(chunks, group)
    if output_splits is not None and [r.shape[0] for r in received] != list(output_splits):
        raise ValueError(f"all_to_all: output_splits {list(output_splits)} do not match what the ranks sent "
                         f"({[r.shape[0] for r in received]})")
    return _back(np.concatenate(received, axis=0), x)


def all_to_all_async(x, group: Group | None = None, input_splits=None, output_splits=None):
    """Start all_to_all: the row counts are exchanged first (small, synchronous), then the
    emulated exchange (each rank's chunks in its own slots of a float32 sum) runs on mccl's
    asynchronous all-reduce; wait() returns what arrived."""
    n = world_size(group)
    if n == 1:
        return Pending(x.copy())
    arr = _to_host(x, "all_to_all")
    if input_splits is None:
        input_splits = [arr.shape[0] // n] * n
    chunks = np.split(arr, np.cumsum(input_splits)[:-1])
    all_rows = _emulated.all_gather_stack(np.array([c.shape[0] for c in chunks], np.int64), group)  # [src, dst]
    if output_splits is not None and list(all_rows[:, rank(group)]) != list(output_splits):
        raise ValueError(f"all_to_all_async: output_splits {list(output_splits)} do not match what the ranks send "
                         f"({list(all_rows[:, rank(group)])})")
    slots = ms.Tensor(_emulated.all_to_all_slots(chunks, all_rows, group))
    with _recording("all_to_all", _nbytes(x)):
        _stats.add_wire(slots.nbytes)
        handle = mint_dist.all_reduce(slots, op="sum", group=_handle(group), async_op=True)
    return Pending(slots, handle, finish=lambda summed: _back(np.concatenate(_emulated.all_to_all_received(
        summed.asnumpy(), arr.dtype, arr.shape[1:], all_rows, group), axis=0), x))


def broadcast(x, src: int, group: Group | None = None):
    if _alone(group):
        return x.copy()
    src_in_group = src if group is None else group.ranks.index(src)
    with _recording("broadcast", _nbytes(x)):
        return _back(_emulated.broadcast(_to_host(x, "broadcast"), src_in_group, group), x)


def shift(x, offset: int = 1, group: Group | None = None):
    if _alone(group) or offset % world_size(group) == 0:
        return x.copy()
    with _recording("shift", _nbytes(x)):
        return _back(_emulated.shift(_to_host(x, "shift"), offset, group), x)


def shift_async(x, offset: int = 1, group: Group | None = None):
    """Start shift(x, offset, group): the emulated exchange (each rank's bytes in its receiver's
    slot of a float32 sum) on mccl's asynchronous all-reduce; wait() returns what arrived."""
    n = world_size(group)
    if _alone(group) or offset % n == 0:
        return Pending(x.copy())
    arr = _to_host(x, "shift")
    slots = ms.Tensor(_emulated.shift_slots(arr, offset, group))
    with _recording("shift", _nbytes(x)):
        _stats.add_wire(slots.nbytes)
        handle = mint_dist.all_reduce(slots, op="sum", group=_handle(group), async_op=True)
    return Pending(slots, handle, finish=lambda summed: _back(
        _emulated.shifted(summed.asnumpy(), arr.dtype, arr.shape, group), x))


def _pair(a: int, b: int) -> Group:
    ranks = tuple(sorted((a, b)))
    return Group(ranks, _group_name(ranks))


def send(x, dst: int) -> None:
    with _recording("send", _nbytes(x)):
        _emulated.send(ops.to_numpy(x), _pair(rank(), dst))


def recv(shape, dtype, src: int):
    host_dtype = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
    with _recording("recv", int(np.prod(shape)) * ITEMSIZE[dtype]):
        array = _emulated.recv(tuple(shape), host_dtype, _pair(rank(), src))
    return ops.tensor(array, dtype=dtype)


def barrier(group: Group | None = None) -> None:
    if not _alone(group):
        with _recording("barrier", 0):
            _emulated.barrier(group)


def implementations() -> dict:
    kinds = {name: "emulated" for name in ("all_gather", "all_gather_async", "reduce_scatter", "all_to_all",
                                           "broadcast", "shift", "shift_async", "send", "recv", "barrier")}
    kinds["all_reduce"] = kinds["all_reduce_async"] = "native"
    return kinds
