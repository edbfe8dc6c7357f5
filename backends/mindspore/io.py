"""Tensor files for the MindSpore backend (format in mindspeed_core.tensor_files)."""

from __future__ import annotations

import mindspore as ms

from mindspeed_core import tensor_files

from . import ops


def _to_host(x) -> tensor_files.HostTensor:
    if x.dtype == ms.bfloat16:
        return tensor_files.HostTensor(tensor_files.float32_to_bf16_bits(x.astype(ms.float32).asnumpy()), "bfloat16")
    return tensor_files.HostTensor(x.asnumpy())


def save(path: str, tensors: dict, metadata: dict | None = None) -> None:
    tensor_files.save(path, {k: _to_host(v) for k, v in tensors.items()}, metadata)


def load(path: str) -> tuple[dict, dict | None]:
    return tensor_files.load_tensors(path, ops.tensor)
