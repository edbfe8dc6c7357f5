#!/usr/bin/env python
"""Where one training step's time goes, with the framework's own profiler.

    python benchmarks/profile_step.py --framework mindspore [--model medium] [--top 15]

Times the phases of a step of our trainer's model (forward, forward + backward, gradient
norm, AdamW; each phase synchronised, median of 3 steps after one warm-up), then profiles one
whole step with MindSpore's Profiler or torch.profiler and prints the operators that took
the most time, summed per operator type. What the profiler attributes to kernels is less
than the step's wall time: the rest is Python, dispatch and what runs between kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import csv
import glob
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import MODELS, model_config  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=("pytorch", "mindspore"), required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="medium")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    import numpy as np

    from mindspeed_core import runtime

    runtime.bind(args.framework)
    from mindspeed_core import autograd, device, nn, ops, random
    from mindspeed_core.models.gpt import GPTModel
    from mindspeed_core.training.optimizer import AdamW

    b = MODELS[args.model]
    cfg = model_config(b)
    cfg = dataclasses.replace(cfg, fused=frozenset({"attention", "rms_norm", "swiglu", "rope"}))
    random.seed(0)
    model = GPTModel(cfg)
    named = nn.named_parameters(model)
    params = [p for _, p in named]
    optimizer = AdamW(named, 1e-4, 0.01)
    ids = np.random.default_rng(0).integers(0, b["vocab_size"], (b["micro_batch_size"], b["seq_length"] + 1))
    x, y = ops.tensor(ids[:, :-1]), ops.tensor(ids[:, 1:])
    grad_fn = autograd.value_and_grad(model.loss, params)

    def step():
        loss, grads = grad_fn(x, y)
        optimizer.step(grads, 1e-4, 1.0 / max(optimizer.grad_norm(grads), 1.0))
        return float(ops.to_numpy(loss))

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        device.synchronize()
        return out, time.perf_counter() - start

    phases = {"forward": [], "forward + backward": [], "gradient norm": [], "AdamW": []}
    for k in range(4):
        _, fwd = timed(lambda: float(ops.to_numpy(model.loss(x, y))))
        (_, grads), both = timed(lambda: (lambda r: (ops.to_numpy(r[0]), r[1]))(grad_fn(x, y)))
        norm, t_norm = timed(lambda: optimizer.grad_norm(grads))
        _, t_adam = timed(lambda: (optimizer.step(grads, 1e-4, 1.0), ops.to_numpy(params[0])))
        if k:
            for key, t in zip(phases, (fwd, both, t_norm, t_adam)):
                phases[key].append(t)
    print(f"{args.framework}, {args.model} model ({cfg.num_parameters() / 1e6:.1f}M parameters, "
          f"{b['micro_batch_size']}x{b['seq_length']} tokens): ms per phase, median of 3")
    for key, ts in phases.items():
        print(f"  {key:20s} {1000 * statistics.median(ts):8.0f}")
    step_ms = 1000 * (statistics.median(phases["forward + backward"]) + statistics.median(phases["gradient norm"])
                      + statistics.median(phases["AdamW"]))
    print(f"  {'step':20s} {step_ms:8.0f}")

    out = tempfile.mkdtemp()
    if args.framework == "mindspore":
        from mindspore import Profiler

        prof = Profiler(output_path=out)
        step()
        device.synchronize()
        prof.stop()
        prof.analyse()
        rows = []
        for path in glob.glob(os.path.join(out, "*", "FRAMEWORK", "cpu_op_type_info_*.csv")):
            with open(path) as fh:
                rows += [(r["op_type"], int(r["type_occurrences"]), float(r["total_compute_time"]))
                         for r in csv.DictReader(fh)]
    else:
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
        # self time of aten operators: the kernels, without double counting their callers
        rows = [(e.key, e.count, e.self_cpu_time_total / 1000.0) for e in prof.key_averages()
                if e.key.startswith("aten::")]
    total = sum(ms for _, _, ms in rows)
    print(f"\nprofiled step: {total:.0f} ms in operators (top {args.top} by time)")
    print(f"  {'operator':28s} {'calls':>6s} {'ms':>8s} {'share':>6s}")
    for name, calls, ms in sorted(rows, key=lambda r: -r[2])[:args.top]:
        print(f"  {name:28s} {calls:6d} {ms:8.1f} {100 * ms / total:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
