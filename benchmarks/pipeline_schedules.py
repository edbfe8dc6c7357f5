"""The pipeline schedules' own timelines, simulated: 1F1B against DualPipeV on the same ranks.

Each schedule's program (training/schedules.py, the one the trainer runs) is stepped with a
forward of one stage taking 1 and its backward 2, transfers free (schedules.simulated_timeline).
DualPipeV's chunks are half a stage, so its forwards take 0.5 and its backwards 1. Prints, per
P and micro-batches m, each schedule's idle time per rank (the bubble) in those units and as a
share of the step, and with --figure draws both timelines at one P and m in one PNG (the
figure in docs/parallelism.md). Nothing overlaps here (no --moe-fb-overlap): DualPipeV's gain is
only what its V fills.

usage: python benchmarks/pipeline_schedules.py [--figure docs/pipeline-schedules.png] [--pp 4] [--micro-batches 8]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mindspeed_core.training.schedules import DUALPIPEV, idle_time, pipeline_program, simulated_timeline  # noqa: E402


def timelines(pp: int, micro_batches: int) -> dict:
    """{title: simulated timeline} of 1F1B and DualPipeV at ``pp`` ranks."""
    return {f"1F1B, PP{pp}, {micro_batches} micro-batches":
            simulated_timeline(pipeline_program(pp, 1, micro_batches), 1, None, 1.0, 2.0),
            f"DualPipeV, PP{pp} (two chunks a rank, chunk 1 hatched), {micro_batches} micro-batches":
            simulated_timeline(pipeline_program(pp, 2, micro_batches, schedule=DUALPIPEV), 2, DUALPIPEV, 0.5, 1.0)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--figure", default=None, help="write the timelines at --pp and --micro-batches to this PNG")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    args = p.parse_args(argv)
    print(f"{'P':>3} {'m':>4} | {'1F1B idle':>10} {'share':>6} | {'DualPipeV idle':>14} {'share':>6}")
    for pp in (2, 4, 8):
        for m in (2 * pp, 4 * pp):
            row = []
            for timeline in timelines(pp, m).values():
                idle = max(idle_time(timeline).values())
                end = max(a[4] for actions in timeline.values() for a in actions)
                row.append((idle, idle / end))
            print(f"{pp:>3} {m:>4} | {row[0][0]:>10.1f} {row[0][1]:>6.1%} | {row[1][0]:>14.1f} {row[1][1]:>6.1%}")
    if args.figure:
        from mindspeed_core.plot import draw_timelines

        draw_timelines(timelines(args.pp, args.micro_batches), args.figure,
                       unit="time (a stage's forward of one micro-batch = 1, its backward = 2)")
        print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
