"""Pipeline bubble: measured idle fraction of each stage vs the analytical one.

For each framework, P in {2, 4} pipeline ranks and m in {4, 8} micro-batches (and the
interleaved schedule with V = 2 model chunks per rank), a tiny LLaMA trains a few steps.
The schedule records when each forward and backward ran (training/schedules.py,
``timeline``); a stage's bubble is 1 - (time computing) / (time of the schedule), averaged
over the steps after the first and over the stages. Analytical: (P - 1) / (m + P - 1) for
1F1B, (P - 1) / (V * m + P - 1) interleaved (a backward costing twice a forward does not
change these fractions).

On this machine all ranks share two CPU cores: with P = 4 two ranks compute at a time, so
a "computing" stage may be waiting for a core and measured bubbles come out low. The figures
are what this machine measures, printed as they are.

With --timelines FIGURE it measures instead the schedules' own timelines at P = 4 on a mixture-of-
experts model of 8 layers (top-2 of 4 experts after a dense first layer, one MTP module, 8 micro-
batches): 1F1B against DualPipeV, each rank's forwards and backwards of its last step as they ran,
drawn one row per rank (plot.draw_timelines), and each rank's waiting time printed. With
--timelines-ep FIGURE the same model trains at P = 4 x EP 2 (eight ranks, the experts over each
data-parallel pair, the alltoall dispatcher) through the Megatron entry script with --profile on its
last step: 1F1B against DualPipeV with --moe-fb-overlap, read from the window's schedule traces
(training/profiling.py schedule_rank<r>.trace.json).

usage: python benchmarks/bench_pipeline.py [--frameworks pytorch mindspore] [--steps 4]
       python benchmarks/bench_pipeline.py --timelines docs/pipeline-measured.png [--frameworks pytorch]
       python benchmarks/bench_pipeline.py --timelines-ep docs/pipeline-fb-overlap.png [--frameworks pytorch]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

MODEL = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "352",
         "--seq-length", "64", "--micro-batch-size", "2", "--lr", "1e-3", "--eval-iters", "0", "--no-progress",
         "--sample-tokens", "0", "--log-interval", "1000"]


def worker(argv: list[str]) -> None:
    """One rank: train ``steps`` steps recording the schedule; rank 0 writes the bubbles."""
    import contextlib
    import io

    from mindspeed_core import dist, runtime

    runtime.bind()
    from mindspeed_core.compat.megatron_args import training_parser
    from mindspeed_core.training import distributed
    from mindspeed_core.training.trainer import Trainer

    out_file, steps, flags = argv[0], int(argv[1]), argv[2:]
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(training_parser().parse_args(flags))
        trainer.build()
        bubbles = []
        for i in range(steps):
            trainer.timeline = []
            trainer.train_step(i)
            if i == 0:
                continue  # first step: allocation, group set-up
            begin, end = next((t0, t1) for kind, _, _, t0, t1 in trainer.timeline if kind == "step")
            busy = sum(t1 - t0 for kind, _, _, t0, t1 in trainer.timeline if kind != "step")
            bubbles.append(1.0 - busy / (end - begin))
    # the bubble, and the last step's actions (time.perf_counter: one clock for every process here)
    per_rank = distributed.gather_json({"bubble": sum(bubbles) / len(bubbles), "timeline": trainer.timeline},
                                       trainer.ps)
    if dist.rank() == 0:
        with open(out_file, "w") as fh:
            json.dump(per_rank, fh)
    dist.shutdown()


def run(framework: str, pp: int, chunks: int, micro_batches: int, steps: int, data: str, extra=()) -> list:
    """Each rank's {"bubble", "timeline"} (in pipeline-rank order: these runs are pure PP)."""
    flags = [*MODEL, "--data-path", data, "--pipeline-model-parallel-size", str(pp), "--global-batch-size",
             str(2 * micro_batches), "--train-iters", str(steps), *extra]
    if chunks > 1 and "--schedules-method" not in extra:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(8 // (pp * chunks))]
    from ranks import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bubbles.json")
        launch(framework, pp, [os.path.abspath(__file__), "rank-worker", out, str(steps), *flags], tmp)
        with open(out) as fh:
            return json.load(fh)


# the measured timelines' model: DeepSeek-V3's ingredients, small (MODEL's sizes)
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "176", "--first-k-dense-replace", "1",
       "--mtp-num-layers", "1", "--untie-embeddings-and-output-weights", "--moe-grouped-gemm"]


def timelines(framework: str, steps: int, data: str, figure: str) -> None:
    """1F1B against DualPipeV at P = 4 with 8 micro-batches: the last step of each, measured."""
    from mindspeed_core.plot import draw_timelines

    drawn = {}
    print(f"{framework}: each rank's wait in the last step (ms), P = 4, 8 micro-batches")
    for name, extra in (("1F1B", MOE), ("DualPipeV", [*MOE, "--schedules-method", "dualpipev"])):
        ranks = run(framework, 4, 2 if name == "DualPipeV" else 1, 8, steps, data, extra)
        begin = min(t0 for r in ranks for kind, _, _, t0, _ in r["timeline"] if kind == "step")
        end = max(t1 for r in ranks for kind, _, _, _, t1 in r["timeline"] if kind == "step")
        actions = {rank: [(kind, chunk, mb, (t0 - begin) * 1e3, (t1 - begin) * 1e3)
                          for kind, chunk, mb, t0, t1 in r["timeline"] if kind != "step"]
                   for rank, r in enumerate(ranks)}
        waits = [(end - begin) * 1e3 - sum(a[4] - a[3] for a in acts) for acts in actions.values()]
        print(f"  {name:9s} step {(end - begin) * 1e3:7.1f} | waits " + " ".join(f"{w:6.1f}" for w in waits))
        drawn[f"{name} ({framework}, measured): step {(end - begin) * 1e3:.0f} ms"] = actions
    draw_timelines(drawn, figure, unit="ms from the step's start (all ranks on one clock)")
    print(f"wrote {figure}")


ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "pretrain_gpt.py")
EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]


def timelines_ep(framework: str, steps: int, data: str, figure: str) -> None:
    """1F1B against DualPipeV with --moe-fb-overlap at P = 4 x EP 2, 8 micro-batches a data-parallel
    rank: the last step of each, from its --profile window's schedule traces."""
    from mindspeed_core.plot import draw_timelines
    from mindspeed_core.training.profiling import read_schedule

    from ranks import launch

    drawn = {}
    print(f"{framework}: each rank's wait in the last step (ms), P = 4 x EP 2, 8 micro-batches a data-parallel rank "
          "(ranks 2p and 2p + 1: pipeline rank p)")
    for name, extra in (("1F1B", EP2), ("DualPipeV, --moe-fb-overlap", [*EP2, "--schedules-method", "dualpipev",
                                                                       "--moe-fb-overlap"])):
        with tempfile.TemporaryDirectory() as tmp:
            profile = os.path.join(tmp, "profile")
            # the window's two last steps: its first pays for the profiler's start on every rank
            flags = [*MODEL, *MOE, "--data-path", data, "--pipeline-model-parallel-size", "4", "--global-batch-size",
                     "32", "--train-iters", str(steps), "--profile", "--profile-step-start", str(steps - 2),
                     "--profile-step-end", str(steps), "--profile-save-path", profile, *extra]
            launch(framework, 8, [os.path.abspath(ENTRY), *flags], tmp)
            ranks = []
            for r in range(8):  # each rank's last step
                actions = read_schedule(os.path.join(profile, f"schedule_rank{r}.trace.json"))
                step = [a for a in actions if a[0] == "step"][-1]
                ranks.append([step] + [a for a in actions if a[0] != "step" and a[3] >= step[3]])
        begin = min(a[3] for r in ranks for a in r if a[0] == "step")
        end = max(a[4] for r in ranks for a in r if a[0] == "step")
        actions = {rank: [(kind, chunk, mb, (t0 - begin) * 1e3, (t1 - begin) * 1e3)
                          for kind, chunk, mb, t0, t1 in r if kind != "step"] for rank, r in enumerate(ranks)}
        waits = [(end - begin) * 1e3 - sum(a[4] - a[3] for a in acts) for acts in actions.values()]
        print(f"  {name:27s} step {(end - begin) * 1e3:7.1f} | waits " + " ".join(f"{w:6.1f}" for w in waits))
        drawn[f"{name} ({framework}, P4 x EP2, measured): step {(end - begin) * 1e3:.0f} ms"] = actions
    draw_timelines(drawn, figure, unit="ms from the step's start (all ranks on one clock)")
    print(f"wrote {figure}")


def main() -> None:
    if sys.argv[1:2] == ["rank-worker"]:
        worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", nargs="+", default=["pytorch", "mindspore"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timelines", default=None, help="measure 1F1B against DualPipeV and draw them to this PNG")
    parser.add_argument("--timelines-ep", default=None, help="measure 1F1B against DualPipeV with --moe-fb-overlap at "
                                                             "P4 x EP2 from --profile traces, and draw them to this PNG")
    args = parser.parse_args()
    from mindspeed_core.data.corpus import build_stdlib_corpus

    data = build_stdlib_corpus()
    for figure, measure in ((args.timelines, timelines), (args.timelines_ep, timelines_ep)):
        if figure:
            for framework in args.frameworks:
                name = figure if len(args.frameworks) == 1 else figure.replace(".png", f"-{framework}.png")
                measure(framework, args.steps, data, name)
    if args.timelines or args.timelines_ep:
        return
    print("| framework | P | V | m | measured bubble | analytical |")
    print("|---|---|---|---|---|---|")
    for framework in args.frameworks:
        for pp in (2, 4):
            for chunks in (1, 2):
                for m in (4, 8):
                    per_rank = run(framework, pp, chunks, m, args.steps, data)
                    measured = sum(r["bubble"] for r in per_rank) / len(per_rank)
                    analytical = (pp - 1) / (chunks * m + pp - 1)
                    print(f"| {framework} | {pp} | {chunks} | {m} | {measured:.3f} | {analytical:.3f} |", flush=True)


if __name__ == "__main__":
    main()
