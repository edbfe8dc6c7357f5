"""Measure what a training step holds in memory: ``python -m mindspeed_core.measure [train flags]``.

One process, no pipeline stages: trains a few steps on random tokens and prints one JSON
line: the first full-size step's peak, and the last step's peak, saved bytes and time
(benchmarks/bench_memory.py). The accounting itself is :mod:`mindspeed_core.memory.accounting`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time

import numpy as np

from mindspeed_core import device, dist, features, ops, runtime
from mindspeed_core.compat import megatron_args
from mindspeed_core.data import indexed
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.memory.accounting import SavedBytes, host_peak_during
from mindspeed_core.training.trainer import Trainer


def _random_data(vocab: int) -> str:
    prefix = os.path.join(tempfile.mkdtemp(), "random")
    writer = indexed.IndexedDatasetWriter(prefix, np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(32):
        writer.add_document(rng.integers(0, vocab, 2048))
    writer.finalize()
    return prefix


def main(argv=None) -> int:
    """Train --train-iters steps (at least 3) and report the last one; with --first-step-only
    (this tool's own flag) stop after the first full-size step, whose loss and saved bytes it
    reports then (the later steps' peak and time are null)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    first_only = "--first-step-only" in argv
    argv = [a for a in argv if a != "--first-step-only"]
    parser = megatron_args.training_parser()
    args = parser.parse_args(argv)
    backend = runtime.bind(args.ai_framework)  # this entry point's one binding
    try:
        features.validate(args, backend.NAME, device.type(), backend.FRAMEWORK_VERSION)
    except MindSpeedError as e:
        print(f"measure: error: {e}", file=sys.stderr)
        return 2
    if args.pipeline_model_parallel_size > 1 or dist.launched_world_size() > 1:
        print("measure: error: it measures one process without pipeline stages (drop the parallel flags)",
              file=sys.stderr)
        return 2
    if not args.data_path:  # random tokens of the model's vocabulary
        args = parser.parse_args([*argv, "--data-path", _random_data(args.vocab_size or 512)])
    steps = max(args.train_iters or 3, 3)
    with open(os.devnull, "w") as null:
        trainer = Trainer(args, out=null)
        trainer.build()
        # A framework that keeps freed memory in a pool of its own (MindSpore on CPU) grows
        # the pool to its peak once, in the first full-size step, and never gives it back:
        # so warm every operator up on a short sequence, then measure the first full step.
        ids, labels, _ = trainer.batches.micro_batch("train", range(args.micro_batch_size))
        short = [ops.tensor(ops.to_numpy(t)[:, :16].copy()) for t in (ids, labels)]
        trainer.grad_fn(*short)
        counter = SavedBytes() if runtime.bound().NAME == "pytorch" else None
        if first_only:
            with counter.counting() if counter else contextlib.nullcontext():
                (loss, _), first_peak = host_peak_during(lambda: trainer.gradients(0))
            peak = seconds = None
        else:
            _, first_peak = host_peak_during(lambda: trainer.gradients(0))
            for i in range(steps - 1):  # then whole steps, until every buffer kept across steps exists
                trainer.train_step(i)
            start = time.perf_counter()
            with counter.counting() if counter else contextlib.nullcontext():
                (loss, _, _), peak = host_peak_during(lambda: trainer.train_step(steps - 1))
            seconds = time.perf_counter() - start
    swap = trainer.swap
    print(json.dumps({"loss": loss, "first_host_peak_bytes": first_peak, "host_peak_bytes": peak,
                      "saved_bytes": counter.bytes if counter else None,
                      "swapped_peak_host_bytes": swap.peak_host_bytes if swap else 0,
                      "swapped_tensors": swap.swapped if swap else 0, "step_seconds": seconds}))
    return 0


if __name__ == "__main__":
    runtime.exit_process(main())
