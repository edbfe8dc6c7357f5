"""Training checkpoints: Megatron's directory shape, framework-neutral files.

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_0000100/model.safetensors       parameters by dotted name
    <save>/iter_0000100/optimizer.safetensors   AdamW moments (and fp32 masters)
    <save>/iter_0000100/meta.json               iteration, model config, args, framework

A checkpoint is written into a temporary folder and renamed into place, and the tracker
file is replaced last, so an interrupted save leaves the previous checkpoint as it was.
Safetensors carry no framework, so a run saved on PyTorch resumes on MindSpore.
"""

from __future__ import annotations

import json
import os
import shutil

from mindspeed_core import io, nn, ops
from mindspeed_core.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def save(root: str, iteration: int, model, optimizer, meta: dict) -> str:
    os.makedirs(root, exist_ok=True)
    final = iteration_dir(root, iteration)
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    io.save(os.path.join(tmp, "model.safetensors"), dict(nn.named_parameters(model)), {"iteration": iteration})
    io.save(os.path.join(tmp, "optimizer.safetensors"), optimizer.state(), {"steps": optimizer.steps})
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


def load(root: str, iteration: int, model, optimizer) -> dict:
    """Load parameters and optimizer state; returns the checkpoint's meta.json."""
    folder = iteration_dir(root, iteration)
    meta = read_meta(root, iteration)
    tensors, _ = io.load(os.path.join(folder, "model.safetensors"))
    nn.load_state_dict(model, {k: ops.to_numpy(v) for k, v in tensors.items()})
    if optimizer is not None:
        opt, opt_meta = io.load(os.path.join(folder, "optimizer.safetensors"))
        optimizer.load_state(opt, int((opt_meta or {}).get("steps", iteration)))
    return meta
