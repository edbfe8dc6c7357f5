"""Random state for the PyTorch backend.

Two generators: torch's own (dropout and the other random ops) and a numpy host generator
that the initializers draw from, so initial weights are identical across frameworks.
"""

from __future__ import annotations

import base64
import random as _py_random

import numpy as np
import torch

from mindspeed_core.rng_tracker import RNGStatesTracker

_host = {"gen": np.random.Generator(np.random.PCG64(0))}


def seed(value: int) -> None:
    """Seed every generator: torch (all devices), the host generator, numpy and Python."""
    value = int(value)
    torch.manual_seed(value)
    _host["gen"] = np.random.Generator(np.random.PCG64(value))
    np.random.seed(value % 2**32)
    _py_random.seed(value)


def host_generator() -> np.random.Generator:
    return _host["gen"]


def _framework_state():
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_framework_state(state) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _encode(state: dict) -> dict:
    """torch's generator states are uint8 tensors: base64 text, for checkpoints."""
    return {dev: base64.b64encode(t.numpy().tobytes()).decode("ascii") for dev, t in state.items()}


def _decode(state: dict) -> dict:
    return {dev: torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8) for dev, text in state.items()}


def get_state() -> dict:
    return {"framework": _encode(_framework_state()), "host": _host["gen"].bit_generator.state}


def set_state(state: dict) -> None:
    _set_framework_state(_decode(state["framework"]))
    _host["gen"].bit_generator.state = state["host"]


_tracker = RNGStatesTracker(_framework_state, _set_framework_state, torch.manual_seed, _encode, _decode)


def tracker() -> RNGStatesTracker:
    """The process's tracker of named RNG states (for tensor-parallel dropout)."""
    return _tracker


def implementation() -> str:
    return "native"
