"""Parameter initializers whose values come from the facade's host generator.

Values are drawn with numpy from ``random.host_generator()`` and then copied into the
parameter, so the same seed gives bit-identical weights on PyTorch and MindSpore (their own
random kernels differ, and MindSpore's CPU kernels cannot be replayed from a saved state).
Each backend builds its ``nn.init`` namespace with :func:`make_init`.
"""

from __future__ import annotations

import math
import types

import numpy as np


def _fans(shape) -> tuple[int, int]:
    if len(shape) < 2:
        raise ValueError(f"xavier initialisation needs at least 2 dimensions, got shape {tuple(shape)}")
    receptive = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    # Weights are stored [out, in, ...] as in torch.nn.Linear.
    return shape[1] * receptive, shape[0] * receptive


def make_init(assign, host_generator):
    """An ``init`` namespace; ``assign(param, array)`` copies a numpy array into a parameter."""

    def normal_(param, mean: float = 0.0, std: float = 1.0):
        shape = tuple(param.shape)
        assign(param, host_generator().normal(mean, std, size=shape).astype(np.float32))
        return param

    def uniform_(param, low: float = 0.0, high: float = 1.0):
        shape = tuple(param.shape)
        assign(param, host_generator().uniform(low, high, size=shape).astype(np.float32))
        return param

    def xavier_uniform_(param, gain: float = 1.0):
        fan_in, fan_out = _fans(tuple(param.shape))
        bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
        return uniform_(param, -bound, bound)

    def xavier_normal_(param, gain: float = 1.0):
        fan_in, fan_out = _fans(tuple(param.shape))
        return normal_(param, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))

    def constant_(param, value: float):
        assign(param, np.full(tuple(param.shape), value, dtype=np.float32))
        return param

    return types.SimpleNamespace(
        normal_=normal_,
        uniform_=uniform_,
        xavier_uniform_=xavier_uniform_,
        xavier_normal_=xavier_normal_,
        zeros_=lambda p: constant_(p, 0.0),
        ones_=lambda p: constant_(p, 1.0),
        constant_=constant_,
    )
