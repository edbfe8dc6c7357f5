"""Modules and parameters for the PyTorch backend."""

from __future__ import annotations

import numpy as np
import torch

from mindspeed_core.backends.initializers import make_init
from mindspeed_core.backends.state import check_state_dict

from . import ops, random


class Module(torch.nn.Module):
    """Base of every facade module: define ``__init__`` and ``forward``."""


ModuleList = torch.nn.ModuleList


def Parameter(data, requires_grad: bool = True, name: str | None = None):  # noqa: N802 - mirrors the class it builds
    value = data if isinstance(data, torch.Tensor) else ops.tensor(data)
    return torch.nn.Parameter(value.detach().clone(), requires_grad=requires_grad)


def is_parameter(x) -> bool:
    return isinstance(x, torch.nn.Parameter)


def named_parameters(module) -> list:
    return list(module.named_parameters())


def parameters(module) -> list:
    return [p for _, p in module.named_parameters()]


def set_requires_grad(param, flag: bool) -> None:
    param.requires_grad_(flag)


def requires_grad(param) -> bool:
    return param.requires_grad


def set_training(module, mode: bool = True) -> None:
    module.train(mode)


def is_training(module) -> bool:
    return module.training


def assign(param, value) -> None:
    """Copy a numpy array or tensor into a parameter in place, keeping its dtype."""
    src = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if tuple(src.shape) != tuple(param.shape):
        raise ValueError(f"cannot assign shape {tuple(src.shape)} to a parameter of shape {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(src.to(dtype=param.dtype, device=param.device))


def cast_parameters(module, dtype: str) -> None:
    """Change every parameter of the module to ``dtype`` in place (mixed-precision training)."""
    module.to(ops.DTYPES[dtype])


def state_dict(module) -> dict:
    """Parameters by dotted name, as numpy arrays (bfloat16 widened to float32, exactly)."""
    return {name: ops.to_numpy(p) for name, p in module.named_parameters()}


def load_state_dict(module, state: dict, strict: bool = True) -> None:
    params = dict(module.named_parameters())
    for name, value in check_state_dict(params, state, strict).items():
        assign(params[name], value)


init = make_init(assign, random.host_generator)


def forward_pre_hook(module, fn):
    """``fn(module)`` before each call of the module's forward; returns a handle with remove()."""
    return module.register_forward_pre_hook(lambda m, args: fn(m))
