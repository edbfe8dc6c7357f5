"""Profiling with MindSpore's Profiler: per window a folder MindStudio Insight and MindInsight
open (ASCEND_PROFILER_OUTPUT/trace_view.json is also a Chrome trace), and each operator type's
total time, read from the profiler's own operator statistics."""

from __future__ import annotations

import csv
import glob
import os

import mindspore as ms

from . import device

_session = {}


def start(save_path: str, worker: str, level: str = "level0", with_cpu: bool = False, with_stack: bool = False,
          with_memory: bool = False, record_shapes: bool = False) -> None:
    if _session:
        raise RuntimeError("a profiling window is already open")
    prof = ms.profiler
    # on the CPU the operators are CPU activity; on Ascend, host-side activity only when asked
    activities = [prof.ProfilerActivity.CPU] if with_cpu or device.type() == "cpu" else []
    if device.type() == "npu":
        activities.append(prof.ProfilerActivity.NPU)
    level_names = {"level0": "Level0", "level1": "Level1", "level2": "Level2"}
    folder = os.path.join(save_path, worker)
    os.makedirs(folder, exist_ok=True)
    before = set(os.listdir(folder))
    session = prof.profile(activities=activities, with_stack=with_stack, profile_memory=with_memory,
                           record_shapes=record_shapes, on_trace_ready=prof.tensorboard_trace_handler(folder),
                           experimental_config=prof._ExperimentalConfig(
                               profiler_level=getattr(prof.ProfilerLevel, level_names[level])),
                           schedule=prof.schedule(wait=0, warmup=0, active=1 << 30, repeat=1))
    session.start()
    _session.update(profile=session, folder=folder, before=before)


def step() -> None:
    _session["profile"].step()


def stop() -> dict:
    """Close the window: the profiler writes and parses its folder; return {"files": [...],
    "ops": [(name, calls, seconds)] by time}."""
    session, folder, before = _session.pop("profile"), _session.pop("folder"), _session.pop("before")
    session.stop()
    made = sorted(set(os.listdir(folder)) - before)
    files, ops = [], []
    for name in made:
        root = os.path.join(folder, name)
        files += glob.glob(os.path.join(root, "ASCEND_PROFILER_OUTPUT", "*.json"))
        for table in glob.glob(os.path.join(root, "FRAMEWORK", "cpu_op_type_info_*.csv")) + \
                glob.glob(os.path.join(root, "ASCEND_PROFILER_OUTPUT", "op_statistic.csv")):
            with open(table, newline="") as fh:
                for row in csv.DictReader(fh):
                    if "total_compute_time" in row:  # the CPU table, milliseconds
                        ops.append((row["op_type"], int(row["type_occurrences"]), float(row["total_compute_time"]) / 1e3))
                    else:  # Ascend's, microseconds
                        ops.append((row["OP Type"], int(row["Count"]), float(row["Total Time(us)"]) / 1e6))
    ops.sort(key=lambda op: -op[2])
    return {"files": files, "ops": ops}
