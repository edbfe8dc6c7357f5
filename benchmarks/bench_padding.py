#!/usr/bin/env python
"""Dynamic padding (--no-pad-to-seq-lengths) against full-length fine-tuning micro-batches, through
`mindspeed train --stage sft` as users run it, on each framework, in one run.

    python benchmarks/bench_padding.py [--frameworks pytorch,mindspore] [--rounds 2] [--iters 8]
                                       [--seq-length 1024]

The data: Alpaca records whose prompt and reply lengths are drawn from 20 to 400 bytes (the
byte-level tokenizer: a byte is a token), so most samples are far shorter than --seq-length,
as in the instruction sets MindSpeed-LLM's fine-tuning scripts train on. Every contender runs in
its own process, every round, in alternating order. The table gives the median over rounds of
the mean step time (the trainer's own "iteration" timer, first two steps left out) and the
last step's loss: the losses of a framework's two rows must agree (only padding is cut).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--num-query-groups", "4",
         "--ffn-hidden-size", "704", "--tokenizer-type", "ByteLevel", "--make-vocab-size-divisible-by", "8",
         "--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "1e-4", "--eval-iters", "0",
         "--split", "100,0,0", "--seed", "1", "--no-progress", "--stage", "sft", "--log-interval", "1"]


def make_data(root: str, seq_length: int) -> str:
    rng = random.Random(0)

    def words(n):
        return "".join(rng.choice(string.ascii_lowercase + "     ") for _ in range(n))

    source = os.path.join(root, "alpaca.jsonl")
    with open(source, "w") as fh:
        for _ in range(400):
            fh.write(json.dumps({"instruction": words(rng.randint(20, 400)), "output": words(rng.randint(20, 400))})
                     + "\n")
    prefix = os.path.join(root, "alpaca")
    subprocess.run([sys.executable, "-m", "mindspeed_core.cli", "preprocess", "--input", source, "--output-prefix",
                    prefix, "--handler-name", "AlpacaStyleInstructionHandler", "--tokenizer-type", "ByteLevel",
                    "--prompt-type", "empty", "--seq-length", str(seq_length)], check=True, capture_output=True)
    return prefix


def run(framework: str, dynamic: bool, data: str, seq_length: int, iters: int, root: str) -> dict:
    metrics = os.path.join(root, f"{framework}-{dynamic}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [sys.executable, "-m", "mindspeed_core.cli", "train", "--ai-framework", framework, *MODEL,
           "--seq-length", str(seq_length), "--data-path", data, "--train-iters", str(iters),
           "--metrics-file", metrics] + (["--no-pad-to-seq-lengths"] if dynamic else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if out.returncode:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-2000:])
    records = [json.loads(line) for line in open(metrics)]
    timed = [r["timers"]["iteration"] for r in records[2:]]
    return {"step_s": sum(timed) / len(timed), "loss": records[-1]["loss"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frameworks", default="pytorch,mindspore")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=1024)
    args = p.parse_args()
    frameworks = args.frameworks.split(",")
    with tempfile.TemporaryDirectory() as root:
        data = make_data(root, args.seq_length)
        results = {(f, d): [] for f in frameworks for d in (False, True)}
        for r in range(args.rounds):
            order = list(results) if r % 2 == 0 else list(reversed(results))
            for framework, dynamic in order:
                results[framework, dynamic].append(run(framework, dynamic, data, args.seq_length, args.iters, root))
    print(f"sft, --seq-length {args.seq_length}, micro-batch 4, samples of 40-800 tokens; median of {args.rounds} rounds")
    print(f"| framework | micro-batch width | step time | loss at step {args.iters} | speed-up |")
    print("|---|---|---|---|---|")
    for framework in frameworks:
        full = statistics.median(x["step_s"] for x in results[framework, False])
        for dynamic in (False, True):
            step = statistics.median(x["step_s"] for x in results[framework, dynamic])
            loss = results[framework, dynamic][-1]["loss"]
            width = "longest sample, to a multiple of 8" if dynamic else f"--seq-length ({args.seq_length})"
            print(f"| {framework} | {width} | {1000 * step:.0f} ms | {loss:.6f} | {full / step:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
