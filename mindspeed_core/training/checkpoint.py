"""Training checkpoints: Megatron's directory shape, framework-neutral files.

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_0000100/model.safetensors       parameters by dotted name
    <save>/iter_0000100/optimizer.safetensors   AdamW moments (and fp32 masters)
    <save>/iter_0000100/meta.json               iteration, model config, args, framework

A checkpoint is written into a temporary folder and renamed into place, and the tracker
file is replaced last, so an interrupted save leaves the previous checkpoint as it was.
Safetensors carry no framework, so a run saved on PyTorch resumes on MindSpore. Values are
always full (unsharded), so a checkpoint saved at one parallel layout loads at any other.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from mindspeed_core import tensor_files
from mindspeed_core.backends.common import float32_to_bf16_bits
from mindspeed_core.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _host(arrays: dict, dtypes: dict) -> dict:
    return {k: tensor_files.HostTensor(float32_to_bf16_bits(v), "bfloat16") if dtypes.get(k) == "bfloat16"
            else tensor_files.HostTensor(v, dtypes.get(k)) for k, v in arrays.items()}


def save(root: str, iteration: int, model_arrays: dict, optimizer_arrays: dict, steps: int, meta: dict,
         dtypes: dict | None = None) -> str:
    """Write full numpy state; ``dtypes`` names parameters kept in bfloat16."""
    os.makedirs(root, exist_ok=True)
    final = iteration_dir(root, iteration)
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model_arrays = {k: v.astype(np.float16) if (dtypes or {}).get(k) == "float16" else v for k, v in model_arrays.items()}
    tensor_files.save(os.path.join(tmp, "model.safetensors"), _host(model_arrays, dtypes or {}), {"iteration": iteration})
    tensor_files.save(os.path.join(tmp, "optimizer.safetensors"), _host(optimizer_arrays, {}), {"steps": steps})
    with open(os.path.join(tmp, "meta.json"), "w") as fh:
        json.dump({**meta, "iteration": iteration}, fh, indent=2, sort_keys=True)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    tracker_tmp = os.path.join(root, f"{TRACKER}.tmp-{os.getpid()}")
    with open(tracker_tmp, "w") as fh:
        fh.write(str(iteration))
    os.replace(tracker_tmp, os.path.join(root, TRACKER))
    return final


def latest_iteration(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isdir(root):
        raise CheckpointError(f"--load {root} does not exist")
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} does not hold an iteration number ({text[:40]!r})")
    return int(text)


def read_meta(root: str, iteration: int) -> dict:
    path = os.path.join(iteration_dir(root, iteration), "meta.json")
    try:
        with open(path) as fh:
            return json.load(fh)
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc.strerror or exc}") from None
    except ValueError:
        raise CheckpointError(f"checkpoint {path} is corrupt (not JSON)") from None


def _arrays(path: str) -> tuple[dict, dict | None]:
    host, meta = tensor_files.load(path)
    return {k: (t.array.astype(np.uint32) << 16).view(np.float32) if t.dtype == "bfloat16"
            else t.array.astype(np.float32) for k, t in host.items()}, meta


def load(root: str, iteration: int) -> tuple[dict, dict, int]:
    """Full float32 arrays of the model and the optimizer, and the optimizer's step count."""
    folder = iteration_dir(root, iteration)
    model, _ = _arrays(os.path.join(folder, "model.safetensors"))
    optimizer, opt_meta = _arrays(os.path.join(folder, "optimizer.safetensors"))
    return model, optimizer, int((opt_meta or {}).get("steps", iteration))
