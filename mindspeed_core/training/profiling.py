"""--profile: a window of training steps recorded by the framework's profiler (the facade's
``profiler``), MindSpeed's flags and defaults.

The window holds the steps whose 0-based number is in [--profile-step-start,
--profile-step-end), as Megatron counts them: with the defaults 10 and 12, the 11th and 12th
steps. The ranks of --profile-ranks (-1, the default: every rank) each write their trace under
--profile-save-path and a table of the operators that took the most time; the lowest of them
prints its table when the window closes. Under pipeline parallelism each also writes
schedule_rank<r>.trace.json: the schedule's compute actions in the window (a forward, a backward,
a --moe-fb-overlap pair) as Chrome-trace spans on the host's monotonic clock, which every rank
of one machine shares (Perfetto and chrome://tracing open it beside the framework's trace).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from mindspeed_core import features, profiler
from mindspeed_core.errors import MindSpeedError

TOP = 15  # operators in the printed table


def check(args, world: int) -> None:
    """One line for a window or ranks that cannot be profiled."""
    if not args.profile:
        return
    if args.profile_step_end <= args.profile_step_start:
        raise MindSpeedError(f"--profile-step-end {args.profile_step_end} must be after --profile-step-start "
                             f"{args.profile_step_start}: the window is the steps from start (counted from 0) up to end")
    if args.train_iters is not None and args.profile_step_start >= args.train_iters:
        raise MindSpeedError(f"--profile-step-start {args.profile_step_start} is not before --train-iters "
                             f"{args.train_iters}: no step would be profiled")
    ranks = [r for r in args.profile_ranks if r != -1]
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise MindSpeedError(f"--profile-ranks {' '.join(map(str, bad))}: the job has ranks 0..{world - 1} "
                             "(-1: every rank)")


def table(ops: list, top: int = TOP) -> str:
    """The operators that took the most time: calls, total and mean milliseconds, share."""
    total = sum(seconds for _, _, seconds in ops) or 1.0
    width = max([len("operator")] + [len(name) for name, _, _ in ops[:top]])
    lines = [f"{'operator':<{width}}  {'calls':>7}  {'total ms':>10}  {'mean ms':>9}  {'share':>6}"]
    for name, calls, seconds in ops[:top]:
        lines.append(f"{name:<{width}}  {calls:>7}  {1e3 * seconds:>10.3f}  {1e3 * seconds / max(calls, 1):>9.4f}  "
                     f"{100 * seconds / total:>5.1f}%")
    return "\n".join(lines)


@dataclass(frozen=True)
class Settings:
    """The profiled window (--profile and MindSpeed's --profile-* flags)."""
    on: bool
    step_start: int  # counted from 0
    step_end: int  # the first step not profiled
    ranks: tuple  # -1: every rank
    level: str
    with_cpu: bool
    with_stack: bool
    with_memory: bool
    record_shapes: bool
    save_path: str


def settings(args) -> Settings:
    """From the parsed flags (the flag layer's: training/configuration.py)."""
    return Settings(bool(args.profile), args.profile_step_start, args.profile_step_end, tuple(args.profile_ranks),
                    args.profile_level, bool(args.profile_with_cpu), bool(args.profile_with_stack),
                    bool(args.profile_with_memory), bool(args.profile_record_shapes), args.profile_save_path)


class Window:
    def __init__(self, chosen: Settings, train_iters: int, rank: int, world: int, say_all):
        """``say_all``: print from this rank (the table comes from a profiled rank, maybe not 0)."""
        self.chosen, self.train_iters = chosen, train_iters
        ranks = sorted(set(range(world)) if -1 in chosen.ranks else set(chosen.ranks))
        self.on = chosen.on and rank in ranks
        self.rank, self.first = rank, ranks[0] if ranks else None
        self.say_all = say_all
        self.open = False
        self.result = None
        self.schedule = None  # while open: the pipeline schedule's actions (schedules.forward_backward_pipelining)

    def before_step(self, iteration: int) -> None:
        a = self.chosen
        if self.on and iteration == a.step_start:
            features.note_used("profiling")
            profiler.start(a.save_path, f"rank{self.rank}", level=a.level, with_cpu=a.with_cpu,
                           with_stack=a.with_stack, with_memory=a.with_memory, record_shapes=a.record_shapes)
            self.open = True
            self.schedule = []

    def after_step(self, iteration: int) -> bool:
        """``iteration``: the number of steps done. True when the window closed here (writing
        the trace took time that is not training's)."""
        if self.open:
            profiler.step()
            if iteration >= self.chosen.step_end:
                self.close()
                return True
        return False

    def close(self) -> None:
        """End the window (at its end, or where training stopped inside it)."""
        if not self.open:
            return
        self.open = False
        a = self.chosen
        self.result = profiler.stop()
        if self.schedule:
            self.result["files"].append(write_schedule(self.schedule, a.save_path, self.rank))
        self.schedule = None
        last = min(a.step_end, self.train_iters)
        text = table(self.result["ops"])
        path = os.path.join(a.save_path, f"top_ops_rank{self.rank}.txt")
        with open(path, "w") as fh:
            fh.write(text + "\n")
        if self.rank == self.first:
            self.say_all(f"profiled steps {a.step_start + 1}-{last} on rank {self.rank}; traces: "
                         f"{', '.join(self.result['files']) or a.save_path}\n"
                         f"top operators by time (rank {self.rank}, {path}):\n{text}")


def write_schedule(actions: list, folder: str, rank: int) -> str:
    """The pipeline schedule's actions ((kind, chunk, micro-batch, start, end) in seconds of
    time.perf_counter, as schedules.forward_backward_pipelining records them) as a Chrome trace:
    one complete event each, in microseconds, on this rank's row. Returns the file."""
    events = [{"name": kind if kind == "step" else f"{kind} chunk {chunk} mb {mb}", "cat": "schedule", "ph": "X",
               "ts": start * 1e6, "dur": (end - start) * 1e6, "pid": rank, "tid": "pipeline schedule",
               "args": {"kind": kind, "chunk": chunk, "micro_batch": mb}}
              for kind, chunk, mb, start, end in actions]
    path = os.path.join(folder, f"schedule_rank{rank}.trace.json")
    with open(path, "w") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)
    return path


def read_schedule(path: str) -> list:
    """write_schedule's actions back: [(kind, chunk, micro-batch, start, end)] in seconds."""
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    return [(e["args"]["kind"], e["args"]["chunk"], e["args"]["micro_batch"], e["ts"] / 1e6,
             (e["ts"] + e["dur"]) / 1e6) for e in events if e.get("cat") == "schedule"]
