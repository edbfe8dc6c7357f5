"""Context parallelism: attention memory, step time and traffic per rank, by sequence length.

For sequence lengths 1k, 2k, 4k, 8k and C = 1, 2, 4 context-parallel ranks (ring, Ulysses,
and at C = 4 hybrid 2 x 2), one attention layer's forward and backward (the model's
attention seam, causal, composite attention as the trainer runs it without
--use-flash-attn) on this rank's 2 of 2C chunks:

- memory, measured (PyTorch only): bytes autograd keeps for the backward (saved tensors,
  each storage once), from torch.autograd.graph.saved_tensors_hooks; MindSpore has no such
  statistic on CPU, so "-".
- memory, counted: bytes of the fp32 score blocks the algorithm materialises on the rank
  (b x heads x query rows x key columns x 4 over the blocks it computes): the term that
  grows with the sequence, shown for both frameworks.
- step time: the slowest rank's forward + backward, median over the timed steps. All ranks
  share this machine's two cores, so C ranks do not run C times as fast: the figure shows
  the cost of the algorithm's extra work and messages, not a speed-up.
- traffic: payload bytes handed to the collectives in one step (dist.comm_stats) against
  the analytical count: ring (n - 1) key/value messages of b x S/C x kv heads x 2d forward
  and as many gradients back, or (the ring's other form) one all-gather of the rank's block
  and a reduce-scatter of all n back; Ulysses four all-to-alls (q, k, v, output) forward and
  four back. "wire" is what reached the framework's primitives (MindSpore's CPU runtime emulates
  data movement by a sum all-reduce with a slot per rank, each 16-bit lane in a float32:
  2C times). The ring's default form is the one moving fewer wire bytes on the framework:
  point-to-point where it is native, the all-gather where it is emulated.

usage: python benchmarks/bench_context.py [--frameworks pytorch mindspore] [--seq 1024 2048 4096 8192]
       [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

B, HEADS, KV_HEADS, D = 1, 4, 4, 32  # Ulysses at C = 4 needs 4 | key/value heads
RING, GATHER = ("megatron_cp_algo", None, False), ("megatron_cp_algo", None, True)
ALGOS = {1: [("single", None, None)], 2: [RING, GATHER, ("ulysses_cp_algo", None, None)],
         4: [RING, GATHER, ("ulysses_cp_algo", None, None), ("hybrid_cp_algo", 2, None)]}


def label(algo: str, gather) -> str:
    if algo == "megatron_cp_algo":
        return "ring, all-gather" if gather else "ring, point-to-point"
    return {"single": "-", "ulysses_cp_algo": "Ulysses", "hybrid_cp_algo": "hybrid 2x2"}[algo]


def counted_bytes(seq: int, cp: int, algo: str, degree) -> int:
    """fp32 score elements x 4 the rank materialises: every (query run, key run) block of
    the composite attention that is not skipped (a causal block on the diagonal is computed
    whole)."""
    import numpy as np

    from mindspeed_core.parallel.context import local_columns, ulysses_degree

    if cp == 1:
        return 4 * B * HEADS * seq * seq
    u = ulysses_degree(cp, algo, degree)
    me = 0  # every rank does the same work (the causal load balance)
    heads = HEADS // u
    ring = cp // u
    # after Ulysses a rank holds the columns of its u-group; the ring passes the other groups'
    group_cols = [np.sort(np.concatenate([local_columns(seq, cp, g * u + j) for j in range(u)])) for g in range(ring)]
    mine = group_cols[me]
    total = 0
    for q_run in _runs(mine):
        for cols in group_cols:
            for k_run in _runs(cols):
                if k_run[0] <= q_run[-1]:  # not wholly after every query: computed
                    total += len(q_run) * len(k_run)
    return 4 * B * heads * total


def _runs(cols):
    import numpy as np

    breaks = np.flatnonzero(np.diff(cols) != 1) + 1
    return np.split(cols, breaks)


def analytical_bytes(seq: int, cp: int, algo: str, degree, gather) -> int:
    from mindspeed_core.parallel.context import ulysses_degree

    if cp == 1:
        return 0
    u = ulysses_degree(cp, algo, degree)
    local = B * (seq // cp)
    n, block = cp // u, local * KV_HEADS * 2 * D * 4
    if gather:  # an all-gather of the rank's block; backward a reduce-scatter of all n
        ring = (1 + n) * block if n > 1 else 0
    else:  # n - 1 steps forward, as many back
        ring = 2 * (n - 1) * block
    ulysses = 2 * local * D * (2 * HEADS + 2 * KV_HEADS) * 4 if u > 1 else 0
    return ring + ulysses


def worker(argv: list[str]) -> None:
    """One rank: every (sequence length, algorithm) at this job's C; rank 0 writes the rows."""
    import numpy as np

    from mindspeed_core import autograd, dist, nn, ops, runtime

    backend = runtime.bind()
    dist.init()
    from mindspeed_core.models.gpt import Seams
    from mindspeed_core.parallel import context, state

    out_file, steps, seqs = argv[0], int(argv[1]), [int(s) for s in argv[2:]]
    cp = dist.world_size()
    ps = state.initialize(cp=cp)
    rows = []
    for seq in seqs:
        for algo, degree, gather in ALGOS[cp]:
            g = np.random.default_rng(seq)
            local = seq // cp
            q, k, v, cot = (g.standard_normal((B, local, h, D)).astype(np.float32)
                            for h in (HEADS, KV_HEADS, KV_HEADS, HEADS))
            seams = Seams() if cp == 1 else context.ContextParallelSeams(Seams(), ps, algo, degree)
            default = getattr(seams, "ring_by_gather", None)
            if gather is not None:
                seams.ring_by_gather = gather
            params = [nn.Parameter(ops.tensor(a)) for a in (q, k, v)]
            cot_t = ops.tensor(cot)

            def loss():
                return ops.sum(seams.attention(*params, 0.0, False, None) * cot_t)

            step = autograd.value_and_grad(loss, params)
            saved = _saved_bytes(backend.NAME, loss)
            times, comm = [], None
            for i in range(steps):
                dist.barrier()
                dist.reset_comm_stats()
                start = time.perf_counter()
                _, grads = step()
                ops.to_numpy(grads[0])  # wait for the work (MindSpore may run it asynchronously)
                elapsed = time.perf_counter() - start
                comm = dist.comm_stats()
                if i:  # the first step allocates and builds groups
                    times.append(elapsed)
            slowest = ops.to_numpy(dist.all_reduce(ops.tensor([statistics.median(times)]), op="max"))[0]
            rows.append({"seq": seq, "cp": cp, "algo": algo, "degree": degree,
                         "gather": getattr(seams, "ring_by_gather", None),
                         "default": gather is None or gather == default, "seconds": float(slowest),
                         "saved": saved, "bytes": sum(v["bytes"] for v in comm.values()),
                         "wire": sum(v["wire_bytes"] for v in comm.values())})
    if dist.rank() == 0:
        with open(out_file, "w") as fh:
            json.dump(rows, fh)
    dist.shutdown()


def _saved_bytes(framework: str, loss) -> int | None:
    """Bytes autograd keeps for the backward of ``loss`` (PyTorch), each storage once."""
    if framework != "pytorch":
        return None
    import torch

    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = loss()
    del out
    return sum(storages.values())


def run(framework: str, cp: int, seqs: list[int], steps: int) -> list[dict]:
    from ranks import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        launch(framework, cp, [os.path.abspath(__file__), "rank-worker", out, str(steps), *map(str, seqs)], tmp,
               threads=max(1, 2 // cp))
        with open(out) as fh:
            return json.load(fh)


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def main() -> None:
    if sys.argv[1:2] == ["rank-worker"]:
        worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", nargs="+", default=["pytorch", "mindspore"])
    parser.add_argument("--seq", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"one attention layer, batch {B}, {HEADS} query / {KV_HEADS} key-value heads of {D}, causal, fp32; "
          f"per rank; {os.cpu_count()} CPU cores shared by all ranks")
    print("| framework | S | C | algorithm | memory measured (MiB) | memory counted (MiB) | step (s) | "
          "traffic (MiB) | analytical (MiB) | wire (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for framework in args.frameworks:
        for cp in (1, 2, 4):
            for r in run(framework, cp, args.seq, args.steps):
                counted = counted_bytes(r["seq"], cp, r["algo"], r["degree"])
                analytical = analytical_bytes(r["seq"], cp, r["algo"], r["degree"], r["gather"])
                name = label(r["algo"], r["gather"]) + ("" if r["default"] else " (not the default here)")
                print(f"| {framework} | {r['seq']} | {cp} | {name} | {_mib(r['saved'])} | {_mib(counted)} "
                      f"| {r['seconds']:.3f} | {_mib(r['bytes'])} | {_mib(analytical)} | {_mib(r['wire'])} |",
                      flush=True)


if __name__ == "__main__":
    main()
