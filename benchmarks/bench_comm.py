#!/usr/bin/env python
"""Collective traffic per training step and rank, measured against the analytical count.

    python benchmarks/bench_comm.py [--ai-framework pytorch|mindspore] [--steps 4]

For each layout it runs `mindspeed launch` on this machine, reads the per-step collective
bytes the trainer logged (dist.comm_stats), and prints them beside
mindspeed_core.parallel.traffic.step_bytes. On native collectives "measured" equals
"analytical"; "wire" is what reached the framework's primitives, and wire / analytical is
the overhead of emulated collectives (MindSpore's CPU backend).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "256", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--eval-iters", "0", "--no-progress", "--make-vocab-size-divisible-by", "8", "--sample-tokens", "0"]
LAYOUTS = [("DP=2", 2, []), ("DP=2 distributed optimizer", 2, ["--use-distributed-optimizer"]),
           ("TP=2", 2, ["--tensor-model-parallel-size", "2"]),
           ("TP=2 + SP", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
           ("TP=2 x DP=2 + SP + distributed optimizer", 4,
            ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"])]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ai-framework", default=os.environ.get("MINDSPEED_AI_FRAMEWORK", "pytorch"))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from mindspeed_core import runtime

    runtime.bind(args.ai_framework)
    from mindspeed_core.data.corpus import build_stdlib_corpus
    from mindspeed_core.models.config import ModelConfig
    from mindspeed_core.parallel.traffic import step_bytes

    data = build_stdlib_corpus()
    cfg = ModelConfig(vocab_size=264, hidden_size=128, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=256, max_position_embeddings=64)
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    print(f"{args.ai_framework}: bytes per training step on rank 0 (model {cfg.num_parameters() / 1e6:.2f}M parameters, "
          f"global batch 8 x 64 tokens)")
    print(f"{'layout':44s} {'measured':>12s} {'analytical':>12s} {'wire':>12s} {'wire/analytical':>16s}")
    for name, ranks, flags in LAYOUTS:
        with tempfile.TemporaryDirectory() as tmp:
            metrics = os.path.join(tmp, "m.jsonl")
            cmd = [sys.executable, "-m", "mindspeed_core.cli", "launch", "--nproc-per-node", str(ranks), "--master-port",
                   str(_port()), "--log-dir", os.path.join(tmp, "logs"), "--", "--ai-framework", args.ai_framework,
                   *MODEL, *flags, "--data-path", data, "--train-iters", str(args.steps), "--log-interval",
                   str(args.steps), "--metrics-file", metrics]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
            if out.returncode:
                print(f"{name}: failed\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
                return 1
            comm = [json.loads(x) for x in open(metrics)][-1]["comm"]
        tp = 2 if "--tensor-model-parallel-size" in flags else 1
        dp = ranks // tp
        expected = step_bytes(cfg, micro_batch=2, seq_length=64, grad_accum=8 // (2 * dp), tp=tp, dp=dp,
                              sp="--sequence-parallel" in flags,
                              distributed_optimizer="--use-distributed-optimizer" in flags,
                              local_params=(cfg.num_parameters() - norms) // tp + norms, sp_partial_params=norms)
        measured = sum(v["bytes"] for v in comm.values()) / args.steps
        wire = sum(v["wire_bytes"] for v in comm.values()) / args.steps
        analytical = sum(expected.values())
        print(f"{name:44s} {measured:12,.0f} {analytical:12,} {wire:12,.0f} {wire / analytical:16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
