"""The facade bound to PyTorch: the module the runtime binds (the package's own module declares
the backend without importing torch)."""

import torch

from . import NAME, autograd, device, dist, io, nn, ops, profiler, random  # noqa: F401

FRAMEWORK_VERSION = torch.__version__
