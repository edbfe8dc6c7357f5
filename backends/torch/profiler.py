"""Profiling with torch.profiler (torch_npu.profiler on Ascend): a Chrome trace per window,
which chrome://tracing, Perfetto and TensorBoard's PyTorch profiler plugin open, and each
operator's total self time."""

from __future__ import annotations

import os
import time

import torch

from . import device

_session = {}


def _module():
    if device.type() == "npu":
        import torch_npu

        return torch_npu.profiler
    return torch.profiler


def start(save_path: str, worker: str, level: str = "level0", with_cpu: bool = False, with_stack: bool = False,
          with_memory: bool = False, record_shapes: bool = False) -> None:
    if _session:
        raise RuntimeError("a profiling window is already open")
    prof = _module()
    # on the CPU the operators are CPU activity; on an accelerator, host-side activity only when asked
    activities = [prof.ProfilerActivity.CPU] if with_cpu or device.type() == "cpu" else []
    if device.type() == "cuda":
        activities.append(prof.ProfilerActivity.CUDA)
    extra = {}
    if device.type() == "npu":
        activities.append(prof.ProfilerActivity.NPU)
        level_names = {"level0": "Level0", "level1": "Level1", "level2": "Level2"}
        extra["experimental_config"] = prof._ExperimentalConfig(
            profiler_level=getattr(prof.ProfilerLevel, level_names[level]))
    session = prof.profile(activities=activities, record_shapes=record_shapes, profile_memory=with_memory,
                           with_stack=with_stack, **extra)
    session.start()
    _session.update(profile=session, path=save_path, worker=worker)


def step() -> None:
    _session["profile"].step()


def stop() -> dict:
    """Close the window: write the trace, return {"files": [...], "ops": [(name, calls, self
    seconds)] by time}."""
    session, path, worker = _session.pop("profile"), _session.pop("path"), _session.pop("worker")
    session.stop()
    os.makedirs(path, exist_ok=True)
    # the plugin's naming: <worker>.<time>.pt.trace.json
    trace = os.path.join(path, f"{worker}.{time.time_ns()}.pt.trace.json")
    session.export_chrome_trace(trace)
    on_device = device.type() != "cpu"
    ops = []
    for e in session.key_averages():
        if "::" not in e.key:  # Python frames (--profile-with-stack) and step markers are not operators
            continue
        seconds = (getattr(e, "self_device_time_total", 0) if on_device else e.self_cpu_time_total) / 1e6
        ops.append((e.key, int(e.count), float(seconds)))
    ops.sort(key=lambda op: -op[2])
    return {"files": [trace], "ops": ops}
