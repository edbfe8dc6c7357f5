"""Memory saved by recompute and swap attention, measured, on both frameworks.

Each configuration trains in a fresh process (python -m mindspeed_core.measure) a
4-layer model (hidden 128, 4 heads, sequence 512, micro-batch 4, fp32, no dropout) and
reports:

* peak: the process's resident memory at the first full-size forward and backward, above
  where it started (Linux VmHWM; large buffers mapped and unmapped one by one). MindSpore
  keeps freed memory in its own pool, so its later steps show no growth: the first full step
  is where its pool grows to the peak, and the same step is measured on PyTorch;
* saved: what autograd holds for backward at the end of forward, counted through the
  saved-tensor hooks (PyTorch only; MindSpore has none);
* estimate: Korthikanti et al.'s per-layer activations for these widths, at the peak
  (mindspeed_core/memory/accounting.py estimated_peak_bytes), transformer layers only;
* step: seconds of one training step after two warm-up steps (median over --rounds).

usage: python benchmarks/bench_memory.py [--frameworks pytorch,mindspore] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from mindspeed_core.memory import accounting
from mindspeed_core.memory.recompute import Recompute

SIZE = {"s": 512, "b": 4, "h": 128, "a": 4, "f": 384}
LAYERS = 4
MODEL = ["--num-layers", str(LAYERS), "--hidden-size", str(SIZE["h"]), "--num-attention-heads", str(SIZE["a"]),
         "--ffn-hidden-size", str(SIZE["f"]), "--seq-length", str(SIZE["s"]), "--micro-batch-size", str(SIZE["b"]),
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "511", "--make-vocab-size-divisible-by", "1",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--split", "100,0,0",
         "--no-progress", "--train-iters", "3"]
FULL = ["--recompute-granularity", "full", "--recompute-method"]
CONFIGS = {  # name: (flags, policy for the estimate, swap)
    "none": ([], Recompute(), False),
    "selective": (["--recompute-activations"], Recompute("selective"), False),
    "full uniform 1": (FULL + ["uniform", "--recompute-num-layers", "1"], Recompute("full", "uniform", 1), False),
    "full block 2": (FULL + ["block", "--recompute-num-layers", "2"], Recompute("full", "block", 2), False),
    "norm": (["--recompute-norm"], Recompute(norm=True), False),
    "swap attention": (["--swap-attention"], Recompute(), True),
}


def run(framework: str, flags: list) -> dict:
    env = {**os.environ, **accounting.MALLOC_ENV}
    env.pop("MINDSPEED_AI_FRAMEWORK", None)
    out = subprocess.run([sys.executable, "-m", "mindspeed_core.measure", "--ai-framework", framework, *MODEL,
                          *flags], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode:
        raise SystemExit(f"{framework} {flags} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", default="pytorch,mindspore")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(CONFIGS))
    args = parser.parse_args()
    size = {**SIZE, "element": 4, "dropout": False, "gated": True}
    print(f"model: {LAYERS} layers, {json.dumps(SIZE)}, fp32; median of {args.rounds} fresh processes per cell")
    print("| framework | configuration | peak MiB (measured) | saving vs none | saved for backward MiB (counted) "
          "| estimate MiB (Korthikanti) | estimated saving | step s | loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    names = args.only.split(",")
    for framework in args.frameworks.split(","):
        base = None
        for name in names:
            flags, policy, swap = CONFIGS[name]
            if swap and framework == "mindspore":
                print(f"| {framework} | {name} | refused: no saved-tensor hooks | | | | | | |")
                continue
            runs = [run(framework, flags) for _ in range(args.rounds)]
            peak = statistics.median(r["first_host_peak_bytes"] for r in runs)
            saved = runs[0]["saved_bytes"]
            estimate = accounting.estimated_peak_bytes(policy, LAYERS, swap, **size)
            if base is None:
                base = (peak, estimate)
            step = statistics.median(r["step_seconds"] for r in runs)
            print(f"| {framework} | {name} | {mib(peak)} | {(base[0] - peak) / base[0]:+.0%} | {mib(saved)} "
                  f"| {mib(estimate)} | {(base[1] - estimate) / base[1]:+.0%} | {step:.2f} | {runs[0]['loss']:.6f} |",
                  flush=True)
            if swap:
                print(f"|  | (swap: host memory held at most {mib(runs[0]['swapped_peak_host_bytes'])} MiB, "
                      f"{runs[0]['swapped_tensors']} tensors moved over the run) | | | | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
