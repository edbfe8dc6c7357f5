"""Random state for the MindSpore backend.

MindSpore's CPU random kernels (dropout, rand, uniform, ...) draw from hidden per-operator
counters: ``get_rng_state``/``set_rng_state`` do not replay them, and the Generator-taking
``mint`` kernels are not registered on CPU. A tracker of named states needs exact replay,
so this backend's random ops draw from a numpy generator of its own (the "device"
generator) and copy the result to the device; ``implementation()`` says so. Initializers
use a second host generator, as on PyTorch, so weights match across frameworks.
"""

from __future__ import annotations

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
