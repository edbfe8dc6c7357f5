"""One rank of the multi-process collective checks (ranks started by tests/launch.py).

Every rank computes what each collective must return from the ranks' known inputs, runs
the facade's collective, and records each mismatch. Results go to <out>/rank<R>.json; the
exit code is non-zero when any check failed, so the launcher fails too.

usage: dist_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np

from mindspeed_core import dist, ops, runtime

runtime.bind()
dist.init()
R, N = dist.rank(), dist.world_size()
failures: list[str] = []
checks: list[str] = []


def expect(name, got, want):
    checks.append(name)
    got_np = ops.to_numpy(got) if ops.is_tensor(got) else np.asarray(got)
    want = np.asarray(want)
    if got_np.shape != want.shape or not np.array_equal(got_np.astype(want.dtype), want):
        failures.append(f"{name}: got {got_np.tolist()} want {want.tolist()}")


def rank_value(r, shape, dtype, base=0):
    """The tensor rank r contributes: distinct per rank and per element."""
    count = int(np.prod(shape))
    return (np.arange(count).reshape(shape) + 10 * r + 1 + base).astype(dtype)


def run(name, fn):
    try:
        fn()
    except Exception:  # noqa: BLE001 - record and go on, so one run reports every failure
        failures.append(f"{name}: raised\n{traceback.format_exc()}")


def check_all_reduce(group, tag):
    members = list(group.ranks) if group else list(range(N))
    for dtype in ("float32", "float16", "bfloat16", "float64", "int32", "int64"):
        arrays = {r: rank_value(r, (2, 3), np.float32 if dtype == "bfloat16" else dtype) for r in members}
        x = ops.tensor(arrays[R], dtype=dtype)
        expect(f"{tag} all_reduce sum {dtype}", dist.all_reduce(x, "sum", group), sum(arrays.values()))
        expect(f"{tag} all_reduce max {dtype}", dist.all_reduce(x, "max", group), np.max(list(arrays.values()), 0))
        expect(f"{tag} all_reduce min {dtype}", dist.all_reduce(x, "min", group), np.min(list(arrays.values()), 0))
        expect(f"{tag} all_reduce leaves input alone {dtype}", x, arrays[R])
        # two sums under way at once, waited for in the other order
        first, second = dist.all_reduce_async(x, group), dist.all_reduce_async(x * 2, group)
        expect(f"{tag} all_reduce_async second {dtype}", second.wait(), 2 * sum(arrays.values()))
        expect(f"{tag} all_reduce_async first {dtype}", first.wait(), sum(arrays.values()))
        expect(f"{tag} all_reduce_async leaves input alone {dtype}", x, arrays[R])
    # int64 beyond float32's exact range: the emulated path must stay exact
    big = {r: np.array([2 ** 40 + 7 * r, -(2 ** 35) - r], np.int64) for r in members}
    expect(f"{tag} all_reduce sum int64 large", dist.all_reduce(ops.tensor(big[R]), "sum", group), sum(big.values()))


def check_all_gather(group, tag):
    members = list(group.ranks) if group else list(range(N))
    for dtype in ("float32", "int64", "bfloat16", "bool", "float64"):
        arrays = {r: rank_value(r, (2, 3), np.float32 if dtype == "bfloat16" else dtype) for r in members}
        if dtype == "bool":
            arrays = {r: (np.arange(6).reshape(2, 3) + r) % 2 == 0 for r in members}
        x = ops.tensor(arrays[R], dtype=dtype)
        for dim in (0, 1):
            expect(f"{tag} all_gather {dtype} dim{dim}", dist.all_gather(x, group, dim=dim),
                   np.concatenate([arrays[r] for r in members], axis=dim))
        work = dist.all_gather_async(x, group)  # waited for after another collective started and ended
        expect(f"{tag} all_gather_async meanwhile {dtype}", dist.all_gather(x, group), np.concatenate(
            [arrays[r] for r in members]))
        expect(f"{tag} all_gather_async {dtype}", work.wait(), np.concatenate([arrays[r] for r in members]))


def check_reduce_scatter(group, tag):
    members = list(group.ranks) if group else list(range(N))
    n, me = len(members), members.index(R)
    for dtype in ("float32", "int64"):
        arrays = {r: rank_value(r, (2 * n, 3), dtype) for r in members}
        total = sum(arrays.values())
        expect(f"{tag} reduce_scatter {dtype} dim0", dist.reduce_scatter(ops.tensor(arrays[R]), "sum", group),
               np.split(total, n, axis=0)[me])
        wide = {r: rank_value(r, (3, 2 * n), dtype) for r in members}
        expect(f"{tag} reduce_scatter {dtype} dim1",
               dist.reduce_scatter(ops.tensor(wide[R]), "sum", group, dim=1), np.split(sum(wide.values()), n, axis=1)[me])


def check_all_to_all(group, tag):
    members = list(group.ranks) if group else list(range(N))
    n, me = len(members), members.index(R)

    def block(src, dst, rows):
        return (np.arange(rows * 2).reshape(rows, 2) + 1000 * src + 100 * dst).astype(np.float32)

    even = np.concatenate([block(me, j, 2) for j in range(n)])
    expect(f"{tag} all_to_all even", dist.all_to_all(ops.tensor(even), group),
           np.concatenate([block(i, me, 2) for i in range(n)]))
    view = ops.transpose(ops.tensor(np.ascontiguousarray(even.T)), 0, 1)  # a strided view of the same rows
    expect(f"{tag} all_to_all of a strided view", dist.all_to_all(view, group),
           np.concatenate([block(i, me, 2) for i in range(n)]))
    count = lambda i, j: (i + 2 * j) % 3  # noqa: E731 - uneven, zero-sized pieces included
    uneven = np.concatenate([block(me, j, count(me, j)) for j in range(n)])
    got = dist.all_to_all(ops.tensor(uneven), group, input_splits=[count(me, j) for j in range(n)],
                          output_splits=[count(i, me) for i in range(n)])
    expect(f"{tag} all_to_all uneven", got, np.concatenate([block(i, me, count(i, me)) for i in range(n)]))
    # started, then waited for after another collective started and ended (MoE's overlapped dispatch)
    work = dist.all_to_all_async(ops.tensor(uneven), group, input_splits=[count(me, j) for j in range(n)],
                                 output_splits=[count(i, me) for i in range(n)])
    expect(f"{tag} all_to_all meanwhile", dist.all_to_all(ops.tensor(even), group),
           np.concatenate([block(i, me, 2) for i in range(n)]))
    expect(f"{tag} all_to_all_async uneven", work.wait(),
           np.concatenate([block(i, me, count(i, me)) for i in range(n)]))


def check_shift(group, tag):
    members = list(group.ranks) if group else list(range(N))
    n, me = len(members), members.index(R)
    for dtype in ("float32", "int64"):
        arrays = {r: rank_value(r, (2, 3), dtype) for r in members}
        for offset in (1, -1, 2):
            expect(f"{tag} shift {dtype} by {offset}", dist.shift(ops.tensor(arrays[R]), offset, group),
                   arrays[members[(me - offset) % n]])
            work = dist.shift_async(ops.tensor(arrays[R]), offset, group)  # waited for after another step
            expect(f"{tag} shift meanwhile {dtype} by {offset}", dist.shift(ops.tensor(arrays[R]), -offset, group),
                   arrays[members[(me + offset) % n]])
            expect(f"{tag} shift_async {dtype} by {offset}", work.wait(), arrays[members[(me - offset) % n]])


def check_broadcast(group, tag):
    members = list(group.ranks) if group else list(range(N))
    src = members[-1]
    for dtype in ("float32", "int64", "bfloat16"):
        arrays = {r: rank_value(r, (3,), np.float32 if dtype == "bfloat16" else dtype) for r in members}
        expect(f"{tag} broadcast {dtype}", dist.broadcast(ops.tensor(arrays[R], dtype=dtype), src, group), arrays[src])


def check_send_recv():
    nxt, prv = (R + 1) % N, (R - 1) % N
    mine = rank_value(R, (2, 2), np.float32)
    ids = np.array([R, 2 ** 40 + R], np.int64)
    if R % 2 == 0:
        dist.send(ops.tensor(mine), nxt)
        dist.send(ops.tensor(ids), nxt)
        got, got_ids = dist.recv((2, 2), "float32", prv), dist.recv((2,), "int64", prv)
    else:
        got, got_ids = dist.recv((2, 2), "float32", prv), dist.recv((2,), "int64", prv)
        dist.send(ops.tensor(mine), nxt)
        dist.send(ops.tensor(ids), nxt)
    expect("send/recv float32 ring", got, rank_value(prv, (2, 2), np.float32))
    expect("send/recv int64 ring", got_ids, np.array([prv, 2 ** 40 + prv], np.int64))


def check_traced_mappings(group, tag):
    """Each tensor/sequence/context-parallel collective's traced formulation (what MindSpore's trace
    capture runs) gives its Function's values and input gradients, here in eager, bit for bit."""
    from mindspeed_core import autograd
    from mindspeed_core.parallel import mappings

    n = dist.world_size(group)
    if n == 1:  # a group of one: every mapping is the identity, with no Function
        return
    for kind, dim in (("copy", 0), ("reduce", 0), ("gather", -1), ("scatter", -1), ("gather_seq", 1),
                      ("scatter_seq", 1), ("gather_ring", 1), ("shift", 0), ("seq_to_heads", 0),
                      ("heads_to_seq", 0)):
        x = ops.tensor(rank_value(R, (2, 2 * n, 2 * n, 2 * n), np.float32) / 7)  # [b, s, heads, d]
        mappings._apply(kind, x, group, dim)  # makes the Function class
        cls = mappings._CLASSES[(kind, group.ranks, dim)]
        results = []
        for fn in (cls.apply, cls.traced):
            out, backward = autograd.vjp(fn, [x])
            cotangent = ops.tensor(rank_value(R, tuple(out.shape), np.float32, base=3) / 5)
            (grad,), _ = backward(cotangent)
            results.append((ops.to_numpy(out), ops.to_numpy(grad)))
        expect(f"{tag} traced {kind} values", results[1][0], results[0][0])
        expect(f"{tag} traced {kind} gradient", results[1][1], results[0][1])


def check_comm_stats():
    dist.reset_comm_stats()
    x = ops.zeros((2, 3))  # 24 bytes of float32
    dist.all_reduce(x)
    dist.all_gather(x)
    dist.broadcast(x, 0)
    stats = dist.comm_stats()
    for op in ("all_reduce", "all_gather", "broadcast"):
        expect(f"comm_stats {op} calls", stats[op]["calls"], 1)
        expect(f"comm_stats {op} bytes", stats[op]["bytes"], 24)
        checks.append(f"comm_stats {op} wire")
        if stats[op]["wire_bytes"] < 24 or (dist.implementations()[op] == "native" and stats[op]["wire_bytes"] != 24):
            failures.append(f"comm_stats {op}: wire bytes {stats[op]['wire_bytes']} for a native 24-byte payload")
    dist.reset_comm_stats()
    expect("comm_stats reset", len(dist.comm_stats()), 0)


def main(out_dir):
    expect("world size matches the launcher", N, dist.launched_world_size())
    expect("rank in world group", dist.rank(None), R)
    world = None
    groups = [dist.new_group(range(0, N, 2)), dist.new_group(range(1, N, 2))]  # every rank creates every group
    pair = dist.new_group([0, 1])
    mine = [g for g in groups if R in g.ranks][0]
    expect("rank in sub-group", dist.rank(mine), list(mine.ranks).index(R))
    expect("non-member rank is -1", dist.rank([g for g in groups if R not in g.ranks][0]) if N > 1 else -1, -1)
    for tag, group in (("world", world), ("strided", mine), ("pair", pair if R in pair.ranks else None)):
        if tag == "pair" and group is None:
            continue
        for fn in (check_all_reduce, check_all_gather, check_reduce_scatter, check_all_to_all, check_shift,
                   check_broadcast, *([check_traced_mappings] if group is not None else [])):
            run(f"{tag} {fn.__name__}", lambda: fn(group, tag))
        dist.barrier(group)
    run("send/recv", check_send_recv)
    run("comm stats", check_comm_stats)
    outsider = [g for g in groups if R not in g.ranks][0]
    for name in ("all_reduce", "all_reduce_async", "all_gather", "all_gather_async", "reduce_scatter", "all_to_all",
                 "shift", "shift_async", "broadcast"):
        checks.append(f"{name} refuses a non-member")
        try:
            fn = getattr(dist, name)
            fn(ops.zeros((2 * N,)), outsider.ranks[0], outsider) if name == "broadcast" else fn(ops.zeros((2 * N,)), group=outsider)
            failures.append(f"{name} on a group without this rank did not refuse")
        except ValueError as exc:
            if "not a member" not in str(exc):
                failures.append(f"{name} refused a non-member with the wrong message: {exc}")
    dist.barrier()
    implementations = dist.implementations()
    handles = torch_process_groups()
    dist.shutdown()
    # gloo's worker threads must be gone before the interpreter exits (see shutdown()):
    # nothing may keep a torch ProcessGroup alive past it
    checks.append("shutdown frees every process group")
    if any(ref() is not None for ref in handles):
        failures.append(f"{sum(ref() is not None for ref in handles)} of {len(handles)} torch process groups "
                        "outlived dist.shutdown()")
    result = {"rank": R, "world": N, "checks": len(checks), "failures": failures, "implementations": implementations}
    with open(os.path.join(out_dir, f"rank{R}.json"), "w") as fh:
        json.dump(result, fh)
    return 1 if failures else 0


def torch_process_groups() -> list:
    """Weak references to the torch ProcessGroups of this job (none on MindSpore)."""
    if runtime.bound().NAME != "pytorch":
        return []
    import weakref

    import torch.distributed as tdist

    groups = [tdist.group.WORLD, *runtime.bound().dist._groups.values()]
    return [weakref.ref(pg) for pg in groups if isinstance(pg, tdist.ProcessGroup)]  # not the non-member marker


if __name__ == "__main__":
    runtime.exit_process(main(sys.argv[1]))
