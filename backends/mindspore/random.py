"""Random state for the MindSpore backend.

MindSpore's CPU random kernels (dropout, rand, uniform, ...) draw from hidden per-operator
counters: ``get_rng_state``/``set_rng_state`` do not replay them, and the Generator-taking
``mint`` kernels are not registered on CPU. A tracker of named states needs exact replay,
so this backend's random ops draw from a numpy generator of its own (the "device"
generator) and copy the result to the device; ``implementation()`` says so. Initializers
use a second host generator, as on PyTorch, so weights match across frameworks.
"""

from __future__ import annotations

import contextlib
import random as _py_random

import mindspore as ms
import numpy as np

from mindspeed_core.rng_tracker import RNGStatesTracker

_gens = {"host": np.random.Generator(np.random.PCG64(0)), "device": np.random.Generator(np.random.PCG64(1))}


def _device_seed(value: int) -> None:
    # A distinct stream from the initializers', derived from the same seed.
    _gens["device"] = np.random.Generator(np.random.PCG64([int(value), 1]))


def seed(value: int) -> None:
    value = int(value)
    ms.set_seed(value)
    _gens["host"] = np.random.Generator(np.random.PCG64(value))
    _device_seed(value)
    np.random.seed(value % 2**32)
    _py_random.seed(value)


def host_generator() -> np.random.Generator:
    return _gens["host"]


def device_generator() -> np.random.Generator:
    return _gens["device"]


def _framework_state():
    return _gens["device"].bit_generator.state


def _set_framework_state(state) -> None:
    _gens["device"].bit_generator.state = state


def get_state() -> dict:
    return {"framework": _framework_state(), "host": _gens["host"].bit_generator.state}


def set_state(state: dict) -> None:
    _set_framework_state(state["framework"])
    _gens["host"].bit_generator.state = state["host"]


_tracker = RNGStatesTracker(_framework_state, _set_framework_state, _device_seed)


def tracker() -> RNGStatesTracker:
    return _tracker


def implementation() -> str:
    return "emulated"


# ---- random draws of a compiled step (autograd.compiled_value_and_grad) -------------------
# Trace capture would freeze a host draw into the graph as a constant: the same dropout mask
# every step. So a compiled function's draws are recorded once (kind, tracker stream, shape)
# from an eager forward, drawn on the host before each call from the same streams in the same
# order (the numbers eager would draw), and passed in; while tracing, each draw takes the next.
_capture: dict = {"plan": None, "inputs": None}


def draw(kind: str, shape, p: float = 0.0) -> ms.Tensor:
    """A float32 tensor of ``kind`` draws: "random" (uniform on [0, 1)), "standard_normal", or
    "keep" (1 where a uniform draw is at least p, else 0: a dropout mask)."""
    shape = tuple(int(n) for n in shape)
    if _capture["inputs"] is not None:
        if not _capture["inputs"]:
            raise RuntimeError("a compiled step drew more random tensors than its eager forward")
        value = _capture["inputs"].pop(0)
        if tuple(value.shape) != shape:
            raise RuntimeError(f"a compiled step drew a random tensor of shape {shape} where its eager forward drew "
                               f"{tuple(value.shape)}")
        return value
    if _capture["plan"] is not None:
        _capture["plan"].append((kind, _tracker.active, shape, p))
    if kind == "keep":
        return ms.Tensor((_gens["device"].random(shape) >= p).astype(np.float32))
    return ms.Tensor(getattr(_gens["device"], kind)(shape).astype(np.float32))


@contextlib.contextmanager
def recording():
    """Yields the list that the draws made inside are appended to."""
    outer, _capture["plan"] = _capture["plan"], []
    try:
        yield _capture["plan"]
    finally:
        _capture["plan"] = outer


def draw_plan(plan) -> list:
    """The tensors a recorded forward would draw now (the generators advance as it would)."""
    out = []
    for kind, stream, shape, p in plan:
        with _tracker.fork(stream) if stream is not None else contextlib.nullcontext():
            out.append(draw(kind, shape, p))
    return out


@contextlib.contextmanager
def replaying(tensors: list):
    """Draws inside take ``tensors`` in order; yields a function: how many are left."""
    outer, _capture["inputs"] = _capture["inputs"], tensors
    try:
        yield lambda: len(tensors)
    finally:
        _capture["inputs"] = outer
