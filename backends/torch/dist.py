"""Process groups and collectives for the PyTorch backend (torch.distributed).

Launched by torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment) the process joins
the job with gloo on CPU, nccl on CUDA and hccl on Ascend; with no launcher it runs alone
and every collective is the identity. The facade is functional: each collective returns a
new tensor and leaves its input alone. ``src`` and ``dst`` are global ranks, as in
torch.distributed. gloo has no reduce-scatter, so there it is an all-reduce and a slice.
"""

from __future__ import annotations

import datetime
import gc
import itertools
import time

import torch
import torch.distributed as tdist

from mindspeed_core.backends.common import ITEMSIZE, CommStats, Group, Pending, env_int

from . import device

_stats = CommStats()
# The only references to the torch ProcessGroups this module makes (Group.handle holds a key
# into it), so that shutdown() can really free them: see there.
_groups: dict[int, object] = {}
_keys = itertools.count(1)  # never reused: a group from before shutdown() finds nothing
_REDUCE_OPS = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=env_int("MINDSPEED_DIST_TIMEOUT", default=300))


def launched_world_size() -> int:
    return env_int("WORLD_SIZE", default=1)


def init() -> None:
    """Join the job described by the launcher's environment (no-op when run alone)."""
    if tdist.is_initialized() or launched_world_size() <= 1:
        return
    kind = device.type()
    backend = {"cuda": "nccl", "npu": "hccl"}.get(kind, "gloo")
    tdist.init_process_group(backend=backend, timeout=_timeout())


def is_initialized() -> bool:
    return tdist.is_initialized()


def shutdown(wait: bool = True) -> None:
    """Leave the job, and free the process groups while Python is still fully alive.
    ``wait``: first meet every rank at a barrier (a rank that is failing passes False: its
    peers may be gone).

    gloo's worker threads drop a finished collective's tensors after the caller has moved on;
    when a tensor's Python object is already gone that needs the GIL, and during interpreter
    exit it aborts the process ("terminate called without an active exception", about one
    run in fifteen with torch 2.6). Freeing a ProcessGroup joins those threads (torch
    releases the GIL for it), so nothing of theirs is left for the exit."""
    if not tdist.is_initialized():
        return
    if wait:
        tdist.barrier()  # no rank tears its connections down while a peer still talks to it
    # torch 2.6's gloo worker may still be destroying the barrier's work, whose prior works hold
    # tensors with Python objects: that needs the GIL, while destroy_process_group joins the
    # worker holding it (a deadlock, caught with py-spy in ~ProcessGroupGloo here, about one
    # run in twenty). Sleeping releases the GIL so the worker can finish first.
    time.sleep(0.2)
    tdist.destroy_process_group()
    _groups.clear()
    gc.collect()


def _h(group):
    if group is None or group.handle is None:
        return None
    try:
        return _groups[group.handle]
    except KeyError:
        raise RuntimeError(f"group {group.ranks} belongs to a job this process has left (dist.shutdown)") from None


def world_size(group: Group | None = None) -> int:
    if group is not None:
        return len(group.ranks)
    return tdist.get_world_size() if tdist.is_initialized() else 1


def rank(group: Group | None = None) -> int:
    me = tdist.get_rank() if tdist.is_initialized() else 0
    if group is None:
        return me
    return group.ranks.index(me) if me in group.ranks else -1


def new_group(ranks) -> Group:
    """A group of the given global ranks. Every process must call it, members or not."""
    ranks = tuple(int(r) for r in ranks)
    if not tdist.is_initialized():
        return Group(ranks, None)
    key = next(_keys)
    _groups[key] = tdist.new_group(list(ranks))
    return Group(ranks, key)


def _alone(group) -> bool:
    return world_size(group) == 1


def _record(op: str, x) -> None:
    _stats.record(op, x.numel() * ITEMSIZE[_dtype_name(x)])


def _dtype_name(x) -> str:
    from . import ops

    return ops.dtype_of(x)


def comm_stats() -> dict:
    """{collective: {"calls", "bytes", "wire_bytes"}} on this rank since the last reset."""
    return _stats.snapshot()


def reset_comm_stats() -> None:
    _stats.reset()


def all_reduce(x, op: str = "sum", group: Group | None = None):
    out = x.clone()
    if not _alone(group):
        _record("all_reduce", x)
        tdist.all_reduce(out, op=_REDUCE_OPS[op], group=_h(group))
    return out


class _SumGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, group=ctx.group), None


def sum_gradient(x, group: Group | None = None):
    """x itself; its gradient is summed over the group in backward."""
    return x if _alone(group) else _SumGradient.apply(x, group)


def all_reduce_async(x, group: Group | None = None):
    """Start summing x over the group (gloo and nccl run it on their own threads/streams)."""
    out = x.clone()
    if _alone(group):
        return Pending(out)
    _record("all_reduce", x)
    return Pending(out, tdist.all_reduce(out, op=tdist.ReduceOp.SUM, group=_h(group), async_op=True))


def all_gather_async(x, group: Group | None = None):
    """Start gathering every member's x (concatenated along dim 0 at wait)."""
    if _alone(group):
        return Pending(x.clone())
    _record("all_gather", x)
    parts = [torch.empty_like(x) for _ in range(world_size(group))]
    work = tdist.all_gather(parts, x.contiguous(), group=_h(group), async_op=True)
    return Pending(parts, work, finish=lambda gathered: torch.cat(gathered, dim=0))


def all_gather(x, group: Group | None = None, dim: int = 0):
    """Concatenation along ``dim`` of every group member's x, in group-rank order."""
    if _alone(group):
        return x.clone()
    _record("all_gather", x)
    parts = [torch.empty_like(x) for _ in range(world_size(group))]
    tdist.all_gather(parts, x.contiguous(), group=_h(group))
    return torch.cat(parts, dim=dim)


def reduce_scatter(x, op: str = "sum", group: Group | None = None, dim: int = 0):
    """This rank's slice along ``dim`` of the reduction of every member's x."""
    n = world_size(group)
    if n == 1:
        return x.clone()
    _record("reduce_scatter", x)
    if _native_reduce_scatter():
        parts = [p.contiguous() for p in torch.chunk(x, n, dim=dim)]
        out = torch.empty_like(parts[0])
        tdist.reduce_scatter(out, parts, op=_REDUCE_OPS[op], group=_h(group))
        return out
    out = x.clone()  # gloo has no reduce-scatter: all-reduce and keep this rank's slice
    tdist.all_reduce(out, op=_REDUCE_OPS[op], group=_h(group))
    return torch.chunk(out, n, dim=dim)[rank(group)].clone()


def all_to_all(x, group: Group | None = None, input_splits=None, output_splits=None):
    """Split x along dim 0 (evenly, or by ``input_splits``), send piece j to group rank j,
    and concatenate what arrives. Uneven splits need ``output_splits``."""
    n = world_size(group)
    if n == 1:
        return x.clone()
    x = x.contiguous()  # empty_like below keeps a view's strides, and the kernel writes row-major
    if input_splits is None:
        out = torch.empty_like(x)
    else:
        out = x.new_empty((int(sum(output_splits)),) + tuple(x.shape[1:]))
    _record("all_to_all", x)
    tdist.all_to_all_single(out, x, output_splits, input_splits, group=_h(group))
    return out


def all_to_all_async(x, group: Group | None = None, input_splits=None, output_splits=None):
    """Start all_to_all (gloo and nccl run it on their own threads/streams); wait() returns
    what arrived."""
    n = world_size(group)
    if n == 1:
        return Pending(x.clone())
    x = x.contiguous()
    out = torch.empty_like(x) if input_splits is None else x.new_empty((int(sum(output_splits)),) + tuple(x.shape[1:]))
    _record("all_to_all", x)
    work = tdist.all_to_all_single(out, x, output_splits, input_splits, group=_h(group), async_op=True)
    return Pending(out, work)


def broadcast(x, src: int, group: Group | None = None):
    out = x.clone()
    if not _alone(group):
        _record("broadcast", x)
        tdist.broadcast(out, src, group=_h(group))
    return out


def shift(x, offset: int = 1, group: Group | None = None):
    """Every member sends x to group rank (r + offset) % n and returns what (r - offset) % n
    sent: a ring step, posted as one batch of isend/irecv so no rank waits on another's send."""
    return shift_async(x, offset, group).wait()


class _Works:
    """The isend/irecv pair of one ring step, waited for as one handle."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()


def shift_async(x, offset: int = 1, group: Group | None = None):
    """Start shift(x, offset, group); wait() returns what arrived."""
    n = world_size(group)
    if n == 1 or offset % n == 0:
        return Pending(x.clone())
    me = rank(group)
    ranks = group.ranks if group is not None else tuple(range(n))
    out = torch.empty_like(x)
    _record("shift", x)
    works = tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, x.contiguous(), ranks[(me + offset) % n], _h(group)),
                                     tdist.P2POp(tdist.irecv, out, ranks[(me - offset) % n], _h(group))])
    return Pending(out, _Works(works))


def send(x, dst: int) -> None:
    _record("send", x)
    tdist.send(x.contiguous(), dst)


def recv(shape, dtype, src: int):
    from . import ops

    out = ops.empty(shape, dtype)
    _record("recv", out)
    tdist.recv(out, src)
    return out


def barrier(group: Group | None = None) -> None:
    if not _alone(group):
        _stats.record("barrier", 0)
        tdist.barrier(group=_h(group))


def _native_reduce_scatter() -> bool:
    return tdist.get_backend() != "gloo"


def implementations() -> dict:
    """native / emulated for each collective with the current process-group backend."""
    kinds = {name: "native" for name in ("all_reduce", "all_reduce_async", "all_gather", "all_gather_async",
                                         "all_to_all", "broadcast", "shift", "shift_async", "send", "recv",
                                         "barrier")}
    gloo = (tdist.get_backend() if tdist.is_initialized() else "gloo") == "gloo"
    kinds["reduce_scatter"] = "emulated" if gloo else "native"
    return kinds
