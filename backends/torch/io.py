"""Tensor files for the PyTorch backend (format in mindspeed_core.tensor_files)."""

from __future__ import annotations

import numpy as np
import torch

from mindspeed_core import tensor_files

from . import ops


def _to_host(x) -> tensor_files.HostTensor:
    x = x.detach().cpu().contiguous()
    if x.dtype == torch.bfloat16:
        return tensor_files.HostTensor(x.view(torch.int16).numpy().view(np.uint16), "bfloat16")
    return tensor_files.HostTensor(x.numpy())


def save(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """Write tensors (name -> tensor) and JSON-serialisable metadata to a safetensors file."""
    tensor_files.save(path, {k: _to_host(v) for k, v in tensors.items()}, metadata)


def load(path: str) -> tuple[dict, dict | None]:
    """Read a safetensors file into (name -> tensor, metadata)."""
    return tensor_files.load_tensors(path, ops.tensor)
