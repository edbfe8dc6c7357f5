"""The facade bound to PyTorch: CPU, CUDA, and Ascend NPU through torch_npu when present."""

import torch

from . import autograd, device, dist, io, nn, ops, profiler, random

NAME = "pytorch"
FRAMEWORK_VERSION = torch.__version__

