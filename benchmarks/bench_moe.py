"""Mixture of experts: tokens/s by expert-parallel size, the token traffic, and load balance.

A small Mixtral-shaped model (4 layers, hidden 128, 8 experts of ffn 256, top-2, softmax,
aux loss 0.01) trained by the trainer itself on the embedded corpus:

- speed: 4 ranks (DP = 4) at EP = 1, 2, 4, each dispatcher; tokens/s of the whole job,
  median over the logged steps after the first. The ranks share this machine's two cores:
  the figure shows what expert parallelism's extra messages cost, not a speed-up.
- traffic: rank 0's all-to-all payload per step (dist.comm_stats) against the count for
  perfectly balanced routing: each MoE layer and micro-batch moves T k rows of h float32
  out and back, and their gradients the same two ways: 4 T k h x 4 bytes (T tokens of the
  micro-batch, k = top-k). Measured / balanced is rank 0's share of the routing (above one:
  its experts were busier than the mean). "wire" is what reached the framework's
  primitives (MindSpore's CPU runtime emulates all-to-all by a sum all-reduce: EP x the
  payload). For the all-gather dispatcher the payload is the all-gather of the tokens (and
  their routing) and the reduce-scatter of the outputs.
- load balance: one process, 200 steps with and without the aux loss (coefficient 0.01 vs
  0): the busiest expert's tokens over the mean, per layer, averaged over the last 50 steps
  and the layers (1.0 is perfect balance, 8 / 2 = 4 the worst for top-2 of 8).

usage: python benchmarks/bench_moe.py [--frameworks pytorch mindspore] [--iters 12]
       [--balance-iters 200] [--parts speed balance]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "256", "--seq-length", "128", "--micro-batch-size", "2", "--lr", "1e-3",
         "--lr-warmup-iters", "5", "--eval-iters", "0", "--log-interval", "1", "--no-progress", "--seed", "3",
         "--sample-tokens", "0", "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
         "--moe-grouped-gemm"]
HIDDEN, TOPK, LAYERS, SEQ, MICRO = 128, 2, 4, 128, 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(framework: str, nproc: int, argv: list[str], folder: str) -> list[dict]:
    """The trainer on ``nproc`` ranks (`mindspeed launch`); returns its metrics records."""
    metrics = os.path.join(folder, "metrics.jsonl")
    cmd = [sys.executable, "-m", "mindspeed_core.cli", "launch", "--nproc-per-node", str(nproc), "--master-port",
           str(_port()), "--log-dir", os.path.join(folder, "logs"), "--", "--ai-framework", framework, *argv,
           "--metrics-file", metrics]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=folder)
    if done.returncode:
        raise SystemExit(f"{framework} x {nproc}: {done.stdout[-3000:]}{done.stderr[-3000:]}")
    return [r for r in map(json.loads, open(metrics)) if "loss" in r]


def speed(framework: str, iters: int) -> list[dict]:
    rows = []
    for ep, dispatcher in ((1, "-"), (2, "alltoall"), (2, "allgather"), (4, "alltoall"), (4, "allgather")):
        flags = [*MODEL, "--train-iters", str(iters), "--global-batch-size", str(4 * MICRO)]
        if ep > 1:
            flags += ["--expert-model-parallel-size", str(ep), "--moe-token-dispatcher-type", dispatcher]
        with tempfile.TemporaryDirectory() as folder:
            records = train(framework, 4, flags, folder)
        steps = records[1:]
        op = {"alltoall": ("all_to_all",), "allgather": ("all_gather", "reduce_scatter")}.get(dispatcher, ())
        payload = [sum(r["comm"].get(o, {}).get("bytes", 0) for o in op) for r in steps]
        wire = [sum(r["comm"].get(o, {}).get("wire_bytes", 0) for o in op) for r in steps]
        balanced = 4 * SEQ * MICRO * TOPK * HIDDEN * 4 * LAYERS  # one micro-batch per rank and step
        rows.append({"framework": framework, "ep": ep, "dispatcher": dispatcher,
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
                     "bytes": statistics.median(payload), "wire": statistics.median(wire),
                     "balanced": balanced if dispatcher == "alltoall" else None})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def balance(framework: str, iters: int) -> dict:
    out = {}
    for coeff in ("0.01", "0"):
        flags = [*MODEL, "--train-iters", str(iters), "--moe-aux-loss-coeff", coeff, "--log-interval", "1"]
        with tempfile.TemporaryDirectory() as folder:
            records = train(framework, 1, flags, folder)
        last = records[-50:]
        out[coeff] = statistics.mean(statistics.mean(r["moe"]["load_balance"]) for r in last)
        print(json.dumps({"framework": framework, "aux_loss_coeff": coeff, "load_max_over_mean": out[coeff]}),
              flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", nargs="+", default=["pytorch", "mindspore"])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--balance-iters", type=int, default=200)
    parser.add_argument("--parts", nargs="+", choices=("speed", "balance"), default=["speed", "balance"])
    args = parser.parse_args()
    table, balanced = [], {}
    for fw in args.frameworks:
        if "speed" in args.parts:
            table += speed(fw, args.iters)
        if "balance" in args.parts:
            balanced[fw] = balance(fw, args.balance_iters)
    print("\n| framework | EP | dispatcher | tokens/s (4 ranks) | rank 0 payload / step | wire / step "
          "| balanced all-to-all | measured / balanced |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        ratio = f"{r['bytes'] / r['balanced']:.2f}" if r["balanced"] else "-"
        bal = f"{r['balanced'] / 2**20:.2f} MiB" if r["balanced"] else "-"
        print(f"| {r['framework']} | {r['ep']} | {r['dispatcher']} | {r['tokens_per_s']:,.0f} | "
              f"{r['bytes'] / 2**20:.2f} MiB | {r['wire'] / 2**20:.2f} MiB | {bal} | {ratio} |")
    print(f"\n| framework | load max/mean, aux loss 0.01 | without aux loss | (last 50 of {args.balance_iters} steps) |")
    print("|---|---|---|---|")
    for fw, b in balanced.items():
        print(f"| {fw} | {b['0.01']:.2f} | {b['0']:.2f} | |")


if __name__ == "__main__":
    main()
