"""The planner (mindspeed plan) against this machine: its predicted memory per device and step
time beside the measured ones, for several layouts of one model on two ranks, and its top
choice measured against the default layout (TP1 x PP1 x DP2, micro-batch 1).

Each layout trains --steps steps of a 59M-parameter LLaMA-style model (8 layers, hidden 512,
sequence 256, vocabulary 32000, global batch 8, fp32) on random tokens in its own launch;
every rank reports its peak resident memory (Linux VmHWM: the whole process, framework
included) and rank 0 its step times (the median of the steps after the first). The planner
runs in this process with the same flags and its own probe of the machine. The planner's
StepCounts (copies held, element-wise passes) were read from the first six layouts on each
framework; the layouts marked "(new)" and the planner's own top choice were not used for them.
"of it optimizer" is the part of the step after the backward: gradient reductions, norm, update.

usage: python benchmarks/bench_plan.py [--framework pytorch|mindspore] [--steps 4]
       [--layouts default,dp2-mbs4,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODEL = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--ffn-hidden-size", "1408",
         "--seq-length", "256", "--global-batch-size", "8", "--tokenizer-type", "NullTokenizer", "--vocab-size",
         "31999", "--make-vocab-size-divisible-by", "8", "--attention-dropout", "0", "--hidden-dropout", "0",
         "--lr", "1e-4", "--eval-iters", "0", "--split", "100,0,0", "--no-progress", "--log-interval", "1",
         "--sample-tokens", "0"]
# name: the layout's flags (the planner's own spelling, so its predictions match by flags)
LAYOUTS = {
    "default": "1 1 1 none -",
    "dp2-mbs4": "1 1 4 none -",
    "dp2-mbs4-distopt": "1 1 4 none distopt",
    "tp2-mbs8": "2 1 8 none -",
    "pp2-mbs2": "1 2 2 none -",
    "tp2-mbs8-full": "2 1 8 full -",
    # not among the layouts the copy counts of mindspeed_core/planner.py were read from
    "dp2-mbs2-distopt": "1 1 2 none distopt",
    "tp2-mbs2-selective": "2 1 2 selective -",
    "pp2-mbs1": "1 2 1 none -",
}
CALIBRATION = ("default", "dp2-mbs4", "dp2-mbs4-distopt", "tp2-mbs8", "pp2-mbs2", "tp2-mbs8-full")


def layout_of(spec: str, world: int):
    from mindspeed_core.planner import Layout

    tp, pp, mbs, recompute, distopt = spec.split()
    tp, pp = int(tp), int(pp)
    return Layout(tp, pp, world // (tp * pp), mbs=int(mbs), recompute=recompute, distopt=distopt == "distopt")


def rank_worker(out: str, argv: list[str]) -> None:
    """One rank: train, then write its peak resident memory (and, on rank 0, its step times)."""
    from mindspeed_core import dist, runtime

    runtime.bind()
    from mindspeed_core.backends.common import host_memory_stats
    from mindspeed_core.compat.megatron_args import training_parser
    from mindspeed_core.training.trainer import Trainer

    args = training_parser().parse_args(argv)
    with open(os.devnull, "w") as null:
        trainer = Trainer(args, out=null)
        trainer.run()
    rank = dist.rank()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"peak": host_memory_stats()["host_peak_rss_bytes"]}, fh)
    dist.shutdown()


def measure(framework: str, flags: list[str], data: str, steps: int, world: int, model: list[str] = MODEL) -> dict:
    import ranks

    folder = tempfile.mkdtemp(prefix="bench-plan-")
    metrics = os.path.join(folder, "m.jsonl")
    argv = [*model, *flags, "--data-path", data, "--train-iters", str(steps), "--metrics-file", metrics]
    ranks.launch(framework, world, [os.path.abspath(__file__), "--rank-worker", folder, *argv], folder)
    peaks = [json.load(open(os.path.join(folder, f"rank{r}.json")))["peak"] for r in range(world)]
    timers = [r["timers"] for r in map(json.loads, open(metrics)) if "timers" in r and r["iteration"] > 1]
    return {"peak": max(peaks), "peaks": peaks, "step": statistics.median(t["iteration"] for t in timers),
            "optimizer": statistics.median(t["optimizer"] for t in timers)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", default="pytorch")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--memory-per-device", type=float, default=10.0, help="GiB the planner may use per device")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    a = parser.parse_args()
    os.environ["MINDSPEED_AI_FRAMEWORK"] = a.framework
    from mindspeed_core import runtime

    runtime.bind(a.framework)
    from mindspeed_core import planner
    from mindspeed_core.measure import _random_data

    world, gib = 2, 2**30
    result = planner.plan([*MODEL, "--devices", str(world), "--memory-per-device", str(a.memory_per_device)])
    machine = result["machine"]
    print(f"{a.framework}: probe: matmul {machine.peak_flops / 1e9:.1f} GFLOP/s and element-wise "
          f"{machine.elementwise_rate / 1e9:.2f} G elements/s per device, baseline {machine.baseline_bytes / gib:.2f} GiB; "
          "collectives on two ranks: " + ", ".join(f"{op} {bw / 1e6:.0f} MB/s + {lat * 1e3:.2f} ms per call"
                                                  for op, (lat, bw) in machine.collectives.items()))
    rows = {r["layout"]: r for r in result["rows"]}
    fitting = [r for r in result["rows"] if r["fits"]]
    top = fitting[0]["layout"]
    wanted = {name: layout_of(LAYOUTS[name], world) for name in a.layouts.split(",")}
    if top not in wanted.values():
        wanted["planner's top"] = top
    data = _random_data(32000)
    print(f"{'layout':<20} {'planner':<32} {'mem pred GiB':>12} {'mem meas GiB':>12} {'error':>7} "
          f"{'step pred s':>11} {'step meas s':>11} {'of it optimizer':>15}")
    measured = {}
    for name, lay in wanted.items():
        got = measure(a.framework, lay.flags(), data, a.steps, world)
        pred = rows[lay]
        measured[lay] = got
        error = pred["memory"]["total"] / got["peak"] - 1
        tag = "" if name in CALIBRATION or name == "planner's top" else " (new)"
        print(f"{name + tag:<20} {lay.describe():<32} {pred['memory']['total'] / gib:>12.3f} {got['peak'] / gib:>12.3f} "
              f"{100 * error:>+6.1f}% {pred['step']['total']:>11.3f} {got['step']:>11.3f} {got['optimizer']:>15.3f}", flush=True)
    default = layout_of(LAYOUTS["default"], world)
    ratio = measured[top]["step"] / measured[default]["step"]
    print(f"planner's top choice {top.describe()}: {measured[top]['step']:.3f} s per step, the default "
          f"{default.describe()}: {measured[default]['step']:.3f} s ({ratio:.2f}x the default's time)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-worker":
        rank_worker(sys.argv[2], sys.argv[3:])
    else:
        main()
