"""The facade bound to PyTorch: CPU, CUDA, and Ascend NPU through torch_npu when present."""

import torch

from . import autograd, device, dist, io, nn, ops, random

NAME = "pytorch"
FRAMEWORK_VERSION = torch.__version__


def activate(wanted_device: str = "auto") -> str:
    """Select the device and bind the fused ops to its kernels (called once, by binding)."""
    chosen = device.select(wanted_device)
    ops.bind_fused(chosen)
    return chosen


def implementations() -> dict:
    return {"ops": ops.implementations(), "dist": dist.implementations(), "random": random.implementation()}
