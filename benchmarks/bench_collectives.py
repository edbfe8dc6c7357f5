"""What the sequence-parallel exchanges of a TP2 + SP step cost on each framework's CPU
collectives, on two local ranks.

Under tensor parallelism with --sequence-parallel every layer gathers its input sequence and
scatters its output, forward and backward: on the medium model of bench_train.py ([8, 256,
512] float32 activations, 4 MiB) that is 8 exchanges per layer. PyTorch runs them as gloo's
all-gather and reduce-scatter (each rank sends its half); MindSpore's CPU backend (mccl) has
AllReduce alone on a sub-group (docs/architecture.md, "Kernels on CPU"), so its compiled step sums the whole tensor
in slots for each of them (parallel/mappings.py, the traced formulations), and its eager step
emulates them on the host.

    python benchmarks/bench_collectives.py [--frameworks pytorch mindspore] [--reps 20]

Prints, per framework and operation, the median milliseconds of one call, and that times the
exchanges a step of the medium model makes (``--exchanges``, 6 layers x 8 + the final norm's 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

SHAPE = (8, 256, 512)  # bench_train.py's medium model: micro-batch x sequence x hidden


def worker(argv: list[str]) -> None:
    """One rank: time each operation ``reps`` times after two warm-ups; rank 0 writes the medians."""
    import numpy as np

    from mindspeed_core import dist, ops, runtime

    runtime.bind()
    dist.init()
    out_file, reps = argv[0], int(argv[1])
    rng = np.random.default_rng(dist.rank())
    whole = ops.tensor(rng.standard_normal(SHAPE).astype(np.float32))
    half = ops.tensor(rng.standard_normal((SHAPE[0], SHAPE[1] // 2, SHAPE[2])).astype(np.float32))
    cases = {
        "all_reduce of the whole tensor": lambda: dist.all_reduce(whole),
        "all_gather of each rank's half": lambda: dist.all_gather(half, dim=1),
        "reduce_scatter of the whole tensor": lambda: dist.reduce_scatter(whole, dim=1),
    }
    medians = {}
    for name, call in cases.items():
        times = []
        for i in range(reps + 2):
            dist.barrier()
            start = time.perf_counter()
            ops.to_numpy(call())  # done, on MindSpore too (its calls return before the work has run)
            if i >= 2:
                times.append(time.perf_counter() - start)
        medians[name] = statistics.median(times) * 1e3
    if dist.rank() == 0:
        with open(out_file, "w") as fh:
            json.dump(medians, fh)
    dist.shutdown()


def main() -> None:
    if sys.argv[1:2] == ["rank-worker"]:
        worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", nargs="+", default=["pytorch", "mindspore"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--exchanges", type=int, default=6 * 8 + 2)
    args = parser.parse_args()
    from ranks import launch

    mib = 4 * SHAPE[0] * SHAPE[1] * SHAPE[2] / 2**20
    print(f"two ranks, activations {list(SHAPE)} float32 ({mib:.0f} MiB); medians of {args.reps} calls; "
          f"x {args.exchanges} exchanges per TP2 + SP step of the medium model")
    print("| framework | operation | ms per call | ms per step |")
    print("|---|---|---|---|")
    for framework in args.frameworks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "medians.json")
            launch(framework, 2, [os.path.abspath(__file__), "rank-worker", out, str(args.reps)], tmp)
            with open(out) as fh:
                medians = json.load(fh)
        for name, ms in medians.items():
            print(f"| {framework} | {name} | {ms:.2f} | {ms * args.exchanges:.0f} |", flush=True)


if __name__ == "__main__":
    main()
