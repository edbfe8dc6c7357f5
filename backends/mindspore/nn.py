"""Modules and parameters for the MindSpore backend (mindspore.nn.Cell underneath)."""

from __future__ import annotations

import itertools

import mindspore as ms
import numpy as np

from mindspeed_core.backends.initializers import make_init
from mindspeed_core.backends.state import check_state_dict

from . import ops, random

_names = itertools.count()


class Module(ms.nn.Cell):
    """Base of every facade module: define ``__init__`` and ``forward`` as in PyTorch;
    MindSpore calls ``construct``, which forwards to ``forward``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_train(True)  # torch modules start in training mode; Cells start in eval mode

    def construct(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


ModuleList = ms.nn.CellList


def Parameter(data, requires_grad: bool = True, name: str | None = None):  # noqa: N802
    value = data if isinstance(data, ms.Tensor) else ops.tensor(data)
    # MindSpore refuses two parameters of one name in a gradient call; stand-alone
    # parameters get unique names (inside a Module the attribute path is what counts).
    return ms.Parameter(value.copy(), name=name or f"param_{next(_names)}", requires_grad=requires_grad)


def is_parameter(x) -> bool:
    return isinstance(x, ms.Parameter)


def named_parameters(module) -> list:
    return list(module.parameters_and_names())


def parameters(module) -> list:
    return [p for _, p in module.parameters_and_names()]


def set_requires_grad(param, flag: bool) -> None:
    param.requires_grad = flag


def requires_grad(param) -> bool:
    return param.requires_grad


def set_training(module, mode: bool = True) -> None:
    module.set_train(mode)


def is_training(module) -> bool:
    return bool(module.training)


def assign(param, value) -> None:
    if isinstance(value, ms.Tensor):  # stay on the device: no host round trip
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"cannot assign shape {tuple(value.shape)} to a parameter of shape {tuple(param.shape)}")
        param.set_data(value.astype(param.dtype))
        return
    value = np.asarray(value)
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"cannot assign shape {tuple(value.shape)} to a parameter of shape {tuple(param.shape)}")
    param.set_data(ops.tensor(value.astype(np.float32) if value.dtype == np.float64 else value,
                              dtype=ops.dtype_of(param)))


def cast_parameters(module, dtype: str) -> None:
    """Change every parameter of the module to ``dtype`` in place (mixed-precision training)."""
    for _, p in module.parameters_and_names():
        p.set_dtype(ops.DTYPES[dtype])


def state_dict(module) -> dict:
    return {name: ops.to_numpy(p) for name, p in module.parameters_and_names()}


def load_state_dict(module, state: dict, strict: bool = True) -> None:
    params = dict(module.parameters_and_names())
    for name, value in check_state_dict(params, state, strict).items():
        assign(params[name], value)


init = make_init(assign, random.host_generator)


def forward_pre_hook(module, fn):
    """``fn(module)`` before each call of the module's forward; returns a handle with remove()."""
    return module.register_forward_pre_hook(lambda cell, inputs: fn(cell))
