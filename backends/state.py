"""Checks shared by both backends when a state dict is loaded into a module."""

from __future__ import annotations

import numpy as np

from mindspeed_core.errors import CheckpointError


def check_state_dict(params: dict, state: dict, strict: bool = True) -> dict:
    """Return the entries of ``state`` to copy into ``params`` (both keyed by dotted name).

    Raises CheckpointError naming every missing or unexpected name (when strict) and every
    shape that does not fit, before anything is copied, so a failed load changes nothing.
    """
    problems = []
    if strict:
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params))
        if missing:
            problems.append(f"missing: {', '.join(missing)}")
        if unexpected:
            problems.append(f"unexpected: {', '.join(unexpected)}")
    wanted = {}
    for name, value in state.items():
        if name not in params:
            continue
        shape = tuple(np.shape(value))
        if shape != tuple(params[name].shape):
            problems.append(f"{name}: checkpoint shape {shape} != model shape {tuple(params[name].shape)}")
        else:
            wanted[name] = value
    if problems:
        raise CheckpointError("state dict does not fit the model: " + "; ".join(problems))
    return wanted
