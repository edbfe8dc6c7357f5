#!/usr/bin/env python
"""Gradient reduction overlapped with backward (--overlap-grad-reduce; with the distributed optimizer
also --overlap-param-gather), through `mindspeed launch` on 4 data-parallel ranks as users run it,
on each framework, in one run.

    python benchmarks/bench_overlap.py [--frameworks pytorch,mindspore] [--rounds 2] [--iters 8]
                                       [--optimizers plain,distributed]

Each contender is one 4-rank job (DP4) of a 4-layer, hidden-512 LLaMA (21M parameters, so
the gradients are 84 MB a step) in 2M-element buckets; with and without the flag, every
round, in alternating order. The table gives the median over rounds of rank 0's mean step
time (the trainer's "iteration" timer, the first two steps left out) and of its "optimizer"
phase, which holds the wait for the reductions: overlap moves the reductions into backward,
so the time it hides is the step time saved. The losses of each pair must be the same bits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile

MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--num-query-groups", "4",
         "--ffn-hidden-size", "1408", "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--lr", "1e-4", "--eval-iters", "0", "--log-interval", "1", "--no-progress", "--seed", "1",
         "--sample-tokens", "0", "--ddp-bucket-size", "2000000", "--make-vocab-size-divisible-by", "8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(framework: str, optimizer: str, overlap: bool, iters: int, root: str) -> dict:
    name = f"{framework}-{optimizer}-{overlap}"
    metrics = os.path.join(root, name + ".jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    shutil.rmtree(os.path.join(root, "ckpt-" + name), ignore_errors=True)  # each round a fresh run
    cmd = [sys.executable, "-m", "mindspeed_core.cli", "launch", "--nproc-per-node", "4", "--master-port",
           str(free_port()), "--log-dir", os.path.join(root, "logs-" + name), "--", "--ai-framework", framework,
           *MODEL, "--train-iters", str(iters), "--metrics-file", metrics, "--save", os.path.join(root, "ckpt-" + name),
           "--save-interval", str(10 * iters)]
    cmd += ["--use-distributed-optimizer"] if optimizer == "distributed" else []
    if overlap:  # with the distributed optimizer, its parameter gathering overlapped too
        cmd += ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if optimizer == "distributed" else [])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    records = [json.loads(line) for line in open(metrics)][2:]
    return {"step": statistics.mean(r["timers"]["iteration"] for r in records),
            "optimizer": statistics.mean(r["timers"]["optimizer"] for r in records),
            "curve": [(r["loss"], r["grad_norm"]) for r in records]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frameworks", default="pytorch,mindspore")
    p.add_argument("--optimizers", default="plain,distributed")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    args = p.parse_args()
    keys = [(f, o, v) for f in args.frameworks.split(",") for o in args.optimizers.split(",") for v in (False, True)]
    results = {k: [] for k in keys}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.rounds):
            for key in (keys if r % 2 == 0 else reversed(keys)):
                results[key].append(run(*key, args.iters, root))
    print(f"DP4 on 4 processes, 21M parameters, 2M-element buckets; median of {args.rounds} rounds")
    print("| framework | optimizer | overlap | step time | optimizer phase | time hidden | same bits |")
    print("|---|---|---|---|---|---|---|")
    for f, o, v in keys:
        step = statistics.median(x["step"] for x in results[f, o, v])
        phase = statistics.median(x["optimizer"] for x in results[f, o, v])
        base = statistics.median(x["step"] for x in results[f, o, False])
        same = all(a["curve"] == b["curve"] for a, b in zip(results[f, o, v], results[f, o, False]))
        print(f"| {f} | {o} | {'on' if v else 'off'} | {1000 * step:.0f} ms | {1000 * phase:.0f} ms | "
              f"{1000 * (base - step):+.0f} ms ({100 * (base - step) / base:+.1f}%) | {'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
