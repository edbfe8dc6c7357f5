"""The planner on layouts none of its constants were read from: models of other sizes than
bench_plan.py's (the StepCounts of mindspeed_core/planner.py were read from that 59M model's
first six layouts), and context and expert parallelism, which that set has not. Each layout
trains --steps steps in its own launch on two ranks (bench_plan.measure: the ranks' highest
peak resident memory, rank 0's median step after the first); the planner predicts them with its
own probe of the machine. Writes benchmarks/plan_heldout.<framework>.json (the probe, each
layout's prediction and measurement), which tests/test_plan.py holds the planner's current
predictions against.

usage: python benchmarks/bench_plan_heldout.py [--framework pytorch|mindspore] [--steps 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

COMMON = ["--tokenizer-type", "NullTokenizer", "--make-vocab-size-divisible-by", "8", "--attention-dropout", "0",
          "--hidden-dropout", "0", "--lr", "1e-4", "--eval-iters", "0", "--split", "100,0,0", "--no-progress",
          "--log-interval", "1", "--sample-tokens", "0"]
MODELS = {  # other shapes than bench_plan's (8 layers, hidden 512, sequence 256)
    "wide": ["--num-layers", "4", "--hidden-size", "768", "--num-attention-heads", "12", "--ffn-hidden-size", "2048",
             "--seq-length", "128", "--global-batch-size", "8", "--vocab-size", "7999"],
    "deep-long": ["--num-layers", "12", "--hidden-size", "256", "--num-attention-heads", "4", "--num-query-groups", "2",
                  "--ffn-hidden-size", "704", "--seq-length", "512", "--global-batch-size", "4", "--vocab-size",
                  "15999"],
    "moe": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--ffn-hidden-size", "512",
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512", "--seq-length", "256",
            "--global-batch-size", "8", "--vocab-size", "7999"],
}
# name: (model, TP, PP, CP, EP, micro-batch, recompute, distributed optimizer)
LAYOUTS = {
    "wide dp2 mbs2": ("wide", 1, 1, 1, 1, 2, "none", False),
    "wide tp2 mbs4 selective": ("wide", 2, 1, 1, 1, 4, "selective", False),
    "deep-long cp2 mbs1": ("deep-long", 1, 1, 2, 1, 1, "none", False),
    "deep-long pp2 mbs1 full": ("deep-long", 1, 2, 1, 1, 1, "full", False),
    "moe ep2 mbs2": ("moe", 1, 1, 1, 2, 2, "none", False),
    "moe dp2 mbs2 distopt": ("moe", 1, 1, 1, 1, 2, "none", True),
}


def machine_record(machine) -> dict:
    out = dataclasses.asdict(machine)
    out["matmul_flops"] = [[*shape, rate] for shape, rate in machine.matmul_flops.items()]
    out["collectives"] = {op: list(v) for op, v in (machine.collectives or {}).items()} or None
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", default="pytorch")
    parser.add_argument("--steps", type=int, default=4)
    a = parser.parse_args()
    os.environ["MINDSPEED_AI_FRAMEWORK"] = a.framework
    from mindspeed_core import runtime

    runtime.bind(a.framework)
    import bench_plan

    from mindspeed_core import planner
    from mindspeed_core.measure import _random_data

    world, gib = 2, 2**30
    data = _random_data(7999)  # ids every model here has
    plans, rows = {}, []
    print(f"{'layout':<28} {'mem pred GiB':>12} {'mem meas GiB':>12} {'error':>7} {'step pred s':>11} "
          f"{'step meas s':>11} {'error':>7}")
    for name, (model, tp, pp, cp, ep, mbs, recompute, distopt) in LAYOUTS.items():
        flags = [*COMMON, *MODELS[model]]
        if model not in plans:  # one probe of the machine per model (its matmul shapes)
            plans[model] = planner.plan(planner.parse([*flags, "--devices", str(world), "--memory-per-device", "10"]))
        result = plans[model]
        lay = planner.Layout(tp, pp, world // (tp * pp * cp), cp=cp, ep=ep, mbs=mbs, recompute=recompute,
                             distopt=distopt)
        pred = next(r for r in result["rows"] if r["layout"] == lay)
        got = bench_plan.measure(a.framework, lay.flags(), data, a.steps, world, model=flags)
        rows.append({"name": name, "model": flags, "layout": dataclasses.asdict(lay),
                     "machine": machine_record(result["machine"]),
                     "predicted": {"memory": pred["memory"]["total"], "step": pred["step"]["total"]},
                     "measured": {"memory": got["peak"], "step": got["step"]}})
        m, s = pred["memory"]["total"], pred["step"]["total"]
        print(f"{name:<28} {m / gib:>12.3f} {got['peak'] / gib:>12.3f} {100 * (m / got['peak'] - 1):>+6.1f}% "
              f"{s:>11.3f} {got['step']:>11.3f} {100 * (s / got['step'] - 1):>+6.1f}%", flush=True)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"plan_heldout.{a.framework}.json")
    with open(path, "w") as fh:
        json.dump({"framework": a.framework, "steps": a.steps, "layouts": rows}, fh, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
