"""Training checkpoints: Megatron's directory shape, framework-neutral files.

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_0000100/rank_00000.safetensors  each rank's pieces (sharded, the default:
                                                training/sharded_checkpoint.py), or
    <save>/iter_0000100/model.safetensors       parameters by dotted name, and
    <save>/iter_0000100/optimizer.safetensors   AdamW moments (and fp32 masters), whole
                                                (--save-whole, and checkpoints written before
                                                sharded saves)
    <save>/iter_0000100/trainer_state.json      RNG states per rank, fp16 loss scale
    <save>/iter_0000100/meta.json               iteration, model config, args, framework,
                                                the SHA-256 of each file above, and a sharded
                                                checkpoint's index

What the tracker names is always a complete checkpoint: a checkpoint is written (and
fsynced) in a temporary folder and renamed into place before the tracker moves; saving an
iteration that already exists swaps the two folders in one atomic rename (Linux
renameat2 RENAME_EXCHANGE) before the old one is deleted. Loading verifies every file
against its recorded digest (a sharded checkpoint's rank reading its slices: every piece
against its own). Safetensors carry no framework, so a run saved on PyTorch resumes on
MindSpore; both formats describe whole tensors, so a checkpoint saved at one parallel layout
loads at any other.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import threading

import numpy as np

from mindspeed_core import features, files, tensor_files
from mindspeed_core.compat import torch_dist
from mindspeed_core.errors import CheckpointError, MindSpeedError
from mindspeed_core.models.state import expert_bias_name
from mindspeed_core.training import sharded_checkpoint

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
# what a crashed save leaves behind: iter_N.tmp-PID, iter_N.old-PID, the tracker's .tmp-PID
_TEMPORARY = re.compile(r"^(?P<base>iter_\d+|" + re.escape(TRACKER) + r")\.(?P<kind>tmp|old)-(?P<pid>\d+)$")
_ITERATION = re.compile(rb"^\s*(\d{1,12})\s*$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _host(arrays: dict, dtypes: dict) -> dict:
    return {k: tensor_files.HostTensor(tensor_files.float32_to_bf16_bits(v), "bfloat16") if dtypes.get(k) == "bfloat16"
            else tensor_files.HostTensor(v, dtypes.get(k)) for k, v in arrays.items()}


def _write_json(path: str, value) -> str:
    blob = json.dumps(value, indent=2, sort_keys=True).encode()
    with open(path, "wb") as fh:
        fh.write(blob)
        fh.flush()
        os.fsync(fh.fileno())
    return hashlib.sha256(blob).hexdigest()


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, a.encode(), at_fdcwd, b.encode(), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), a)


def save(root: str, iteration: int, model_arrays: dict, optimizer_arrays: dict, steps: int, meta: dict,
         dtypes: dict | None = None, trainer_state: dict | None = None) -> str:
    """Write full numpy state in one folder (--save-whole: gathered on rank 0); ``dtypes`` names
    parameters kept in bfloat16 or float16; ``trainer_state`` (JSON) holds what exact
    resumption needs beyond the tensors."""
    tmp = _fresh(root, iteration, os.getpid())
    model_arrays = {k: v.astype(np.float16) if (dtypes or {}).get(k) == "float16" else v for k, v in model_arrays.items()}
    digests = {
        "model.safetensors": tensor_files.save(os.path.join(tmp, "model.safetensors"),
                                               _host(model_arrays, dtypes or {}), {"iteration": iteration}),
        "optimizer.safetensors": tensor_files.save(os.path.join(tmp, "optimizer.safetensors"),
                                                   _host(optimizer_arrays, {}), {"steps": steps}),
        STATE_FILE: _write_json(os.path.join(tmp, STATE_FILE), trainer_state or {}),
    }
    _write_json(os.path.join(tmp, "meta.json"), {**meta, "iteration": iteration, "sha256": digests})
    return _publish(root, iteration, tmp)


class ShardedSave:
    """A sharded save under way: this rank's file being written (by a thread with --async-save),
    the iteration not yet visible. ``finish`` (a collective) publishes it."""

    def __init__(self, root: str, iteration: int, rank: int, tmp: str, sections: dict, steps: int, meta: dict,
                 trainer_state: dict, background: bool, megatron=None):
        self.root, self.iteration, self.rank, self.tmp = root, iteration, rank, tmp
        self.steps, self.meta, self.trainer_state, self.megatron = steps, meta, trainer_state, megatron
        self.result, self.error = None, None
        if background:
            self.thread = threading.Thread(target=self._write, args=(sections,), daemon=True,
                                           name=f"save-iteration-{iteration}")
            self.thread.start()
        else:
            self.thread = None
            self._write(sections)

    def _write(self, sections: dict) -> None:
        try:
            part, fname, digest = sharded_checkpoint.write_rank_file(self.tmp, self.rank, sections)
            dist_part = None
            if self.megatron is not None:  # --ckpt-format torch_dist: the model's pieces as megatron-core's too
                dist_part, dist_file = self.megatron.write(self.tmp, self.rank, sections["model"])
                fname = fname or dist_file
            sharded_checkpoint.fsync_written(self.tmp, fname)
            self.result = [part, fname, digest, dist_part]
        except Exception as exc:  # carried to finish(), in the training thread (an interrupt stops it as it is)
            self.error = exc

    def written(self) -> bool:
        """Whether this rank's file is written (or its writing failed)."""
        return self.thread is None or not self.thread.is_alive()

    def finish(self, gather, barrier) -> str:
        """Wait for this rank's file; once every rank's is durable (``gather`` brings their parts
        of the index), rank 0 writes meta.json and publishes the iteration. A collective."""
        if self.thread is not None:
            self.thread.join()
        # every rank learns of any rank's failure, so that all raise and none waits alone
        failure = None if self.result is not None else repr(self.error or "its writer stopped")
        parts = gather(self.result if failure is None else {"failed": failure})
        failed = [(r, p["failed"]) for r, p in enumerate(parts) if isinstance(p, dict)]
        if failed:
            if self.error is not None and isinstance(self.error, MindSpeedError):
                raise self.error
            raise CheckpointError(f"saving iteration {self.iteration} failed on rank {failed[0][0]} "
                                  f"({failed[0][1]}); the last checkpoint in {self.root} is intact")
        index = sharded_checkpoint.merge_indices([p[0] for p in parts])  # every rank: the same verdict
        final = iteration_dir(self.root, self.iteration)
        if self.rank == 0:
            if self.megatron is not None:
                self.megatron.finish(self.tmp, [p[3] for p in parts])
            digests = {f: d for _, f, d, _ in parts if d is not None}
            digests[STATE_FILE] = _write_json(os.path.join(self.tmp, STATE_FILE), self.trainer_state)
            _write_json(os.path.join(self.tmp, "meta.json"),
                        {**self.meta, "iteration": self.iteration, "format": sharded_checkpoint.FORMAT,
                         "steps": self.steps, "index": index, "sha256": digests})
            final = _publish(self.root, self.iteration, self.tmp)
        barrier()
        return final


def start_sharded(root: str, iteration: int, rank: int, sections: dict, steps: int, meta: dict, trainer_state: dict,
                  gather, barrier, background: bool = False, megatron=None) -> ShardedSave:
    """Every rank writes its own pieces (sharded_checkpoint.write_rank_file: ``sections``) into
    one temporary folder, made here by rank 0; ``background``: in a thread, from host copies
    the caller made (--async-save). ``gather`` is a collective of JSON values in rank order,
    ``barrier`` a barrier. The iteration is published by the returned save's finish().
    ``megatron`` (--ckpt-format torch_dist): a sharded_checkpoint.TorchDistCopy that writes the
    model's pieces in megatron-core's format too, into the same folder."""
    features.note_used("sharded-checkpoints")
    pid = gather(os.getpid())[0]  # the folder is named after rank 0's process
    if rank == 0:
        _fresh(root, iteration, pid)
    barrier()
    tmp = f"{iteration_dir(root, iteration)}.tmp-{pid}"
    return ShardedSave(root, iteration, rank, tmp, sections, steps, meta, trainer_state, background, megatron)


def _fresh(root: str, iteration: int, pid: int) -> str:
    """An empty temporary folder for iteration's checkpoint."""
    os.makedirs(root, exist_ok=True)
    tmp = f"{iteration_dir(root, iteration)}.tmp-{pid}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def _publish(root: str, iteration: int, tmp: str) -> str:
    """Put the complete folder ``tmp`` in place of iteration's, then point the tracker at it."""
    final = iteration_dir(root, iteration)
    files.fsync_dir(tmp)
    if os.path.exists(final):
        # The tracker may name this very iteration: swap in one step, so that a complete
        # checkpoint stands at `final` at every instant, then delete the old one.
        if not _exchange(tmp, final):
            old = f"{final}.old-{os.getpid()}"
            os.replace(final, old)  # a crash before the next line leaves `old`: _folder finds it
            os.replace(tmp, final)
            tmp = old
        files.fsync_dir(root)
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, final)
    files.fsync_dir(root)
    tracker_tmp = os.path.join(root, f"{TRACKER}.tmp-{os.getpid()}")
    with open(tracker_tmp, "w") as fh:
        fh.write(str(iteration))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tracker_tmp, os.path.join(root, TRACKER))
    files.fsync_dir(root)
    return final


def latest_iteration(root: str, flag: str = "--load") -> int | None:
    """The iteration the tracker names (None: no tracker); ``flag`` names ``root`` in errors."""
    path = os.path.join(root, TRACKER)
    if not os.path.isdir(root):
        raise CheckpointError(f"{flag} {root} does not exist" if not os.path.exists(root)
                              else f"{flag} {root} is a file: give the checkpoint's folder")
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as fh:
            raw = fh.read(64)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    match = _ITERATION.match(raw)  # ASCII digits only: int() would also take "١٢" or "1_0"
    if not match:
        raise CheckpointError(f"{path} does not hold an iteration number ({raw[:40]!r})")
    return int(match.group(1))


def is_ours(root: str) -> bool:
    """Whether the iteration the tracker in ``root`` names is one of our checkpoints (its
    meta.json), whatever else its folder holds (a torch_dist copy: --ckpt-format torch_dist)."""
    try:
        it = latest_iteration(root)
    except CheckpointError:
        return False
    return it is not None and os.path.isfile(os.path.join(_folder(root, it), "meta.json"))


def _folder(root: str, iteration: int) -> str:
    """The folder of that iteration; if a save on a filesystem without atomic exchange was
    killed between its two renames, the complete previous copy set aside under .old-PID."""
    final = iteration_dir(root, iteration)
    if not os.path.isdir(final):
        prefix = os.path.basename(final) + ".old-"
        for name in sorted(os.listdir(root)):
            if name.startswith(prefix) and os.path.isfile(os.path.join(root, name, "meta.json")):
                return os.path.join(root, name)
    return final


def read_meta(root: str, iteration: int) -> dict:
    path = os.path.join(_folder(root, iteration), "meta.json")
    meta = _read_json(path)
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path} is corrupt (not a JSON object)")
    _check_meta(path, meta, iteration)
    return meta


LAYOUT_SIZES = ("tp", "dp", "pp", "cp")


def _check_meta(path: str, meta: dict, iteration: int) -> None:
    """meta.json's own fields against what else names them: its iteration against the folder's
    name and the tracker (which chose ``iteration``), its layout's sizes (positive whole
    numbers) against the rank files it names."""
    saved = meta.get("iteration", iteration)
    if type(saved) is not int or saved != iteration:
        raise CheckpointError(f"{path} says iteration {saved!r}, but its folder and the tracker say {iteration}: the "
                              f"folder holds another iteration's checkpoint")
    layout = meta.get("parallel", {})
    if not isinstance(layout, dict) or any(k in layout and (type(layout[k]) is not int or layout[k] < 1)
                                           for k in LAYOUT_SIZES):
        raise CheckpointError(f"{path} records no valid layout ('parallel': {layout!r})")
    world = int(np.prod([layout.get(k, 1) for k in LAYOUT_SIZES]))
    digests = meta.get("sha256")
    ranks = [int(f[5:10]) for f in (digests if isinstance(digests, dict) else {})
             if f.startswith("rank_") and f[5:10].isdigit()]
    if "parallel" in meta and ranks and max(ranks) >= world:
        raise CheckpointError(f"{path} records a layout of {world} ranks "
                              f"({', '.join(f'{k.upper()}={layout.get(k, 1)}' for k in LAYOUT_SIZES)}), but names the "
                              f"file of rank {max(ranks)}")


def check_megatron_copy(root: str, iteration: int) -> None:
    """--ckpt-format torch_dist put Megatron's files beside ours: a folder we load must be one
    megatron-core can load too, so they are read as it reads them (metadata.json, .metadata,
    common.pt, every chunk of every .distcp named), whatever we then read of our own files."""
    folder = _folder(root, iteration)
    if torch_dist.is_torch_dist(folder):
        torch_dist.load(folder)


def _read_json(path: str, sha256: str | None = None):
    try:
        with open(path, "rb") as fh:
            blob = fh.read()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc.strerror or exc}") from None
    if sha256 is not None and hashlib.sha256(blob).hexdigest() != sha256:
        raise CheckpointError(f"{path} is corrupt: its SHA-256 differs from the one recorded when it was saved")
    try:
        return json.loads(blob)
    except ValueError:  # UnicodeDecodeError included
        raise CheckpointError(f"checkpoint {path} is corrupt (not JSON)") from None


def _digest(meta: dict, name: str) -> str | None:
    """The recorded SHA-256 of a file (checkpoints written before digests existed have none)."""
    digests = meta.get("sha256", {})
    value = digests.get(name) if isinstance(digests, dict) else None
    if "sha256" in meta and not isinstance(value, str):
        raise CheckpointError(f"the checkpoint's meta.json records no valid SHA-256 for {name}")
    return value


def _arrays(path: str, sha256: str | None) -> tuple[dict, dict | None]:
    host, meta = tensor_files.load(path, sha256)
    return {k: t.float32() for k, t in host.items()}, meta


def load_model_arrays(root: str, iteration: int) -> dict:
    """Full float32 arrays of the model only (generation), checked against meta.json's digest."""
    return _model_arrays(_folder(root, iteration), read_meta(root, iteration))


def reader(root: str, iteration: int) -> "sharded_checkpoint.Reader | None":
    """A reader of this rank's slices when the checkpoint is sharded; None for a whole one."""
    meta = read_meta(root, iteration)
    if meta.get("format") != sharded_checkpoint.FORMAT:
        return None
    return sharded_checkpoint.Reader(_folder(root, iteration), meta)


def _model_arrays(folder: str, meta: dict) -> dict:
    if meta.get("format") == sharded_checkpoint.FORMAT:
        arrays = sharded_checkpoint.Reader(folder, meta).whole("model")
    else:
        arrays = _arrays(os.path.join(folder, "model.safetensors"), _digest(meta, "model.safetensors"))[0]
    path = os.path.join(folder, STATE_FILE)
    moe = (meta.get("model") or {}).get("moe") or {}
    if moe.get("enable_expert_bias") and os.path.exists(path):
        # written before the expert biases were model state: they were run state
        for number, bias in legacy_expert_biases(_read_json(path, _digest(meta, STATE_FILE))).items():
            arrays.setdefault(expert_bias_name(number), bias)
    return arrays


def legacy_expert_biases(state: dict) -> dict:
    """{MoE layer number: float32 bias} from a trainer state written before the routers'
    expert biases were model state (each rank kept its stages' layers' under "expert_bias")."""
    ranks = state.get("rng") if isinstance(state, dict) else None
    return {int(n): np.asarray(b, np.float32) for r in (ranks if isinstance(ranks, list) else [])
            for n, b in (r.get("expert_bias") or {}).items()}


def load(root: str, iteration: int) -> tuple[dict, dict, int]:
    """Full float32 arrays of the model and the optimizer, and the optimizer's step count;
    every file checked against the digest recorded in meta.json."""
    folder, meta = _folder(root, iteration), read_meta(root, iteration)
    model = _model_arrays(folder, meta)
    if meta.get("format") == sharded_checkpoint.FORMAT:
        shards = sharded_checkpoint.Reader(folder, meta)
        return model, shards.whole("optimizer"), shards.steps
    optimizer, opt_meta = _arrays(os.path.join(folder, "optimizer.safetensors"), _digest(meta, "optimizer.safetensors"))
    steps = (opt_meta or {}).get("steps", iteration) if isinstance(opt_meta, dict) else None
    if type(steps) is not int or steps < 0:
        raise CheckpointError(f"{folder}/optimizer.safetensors holds no valid step count ({steps!r})")
    return model, optimizer, steps


def load_trainer_state(root: str, iteration: int) -> dict:
    """RNG states and loss scale ({} for checkpoints written before they were saved)."""
    folder, meta = _folder(root, iteration), read_meta(root, iteration)
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path) and _digest(meta, STATE_FILE) is None:
        return {}
    state = _read_json(path, _digest(meta, STATE_FILE))
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is corrupt (not a JSON object)")
    saved, layout = state.get("layout"), meta.get("parallel")
    if isinstance(saved, dict) and isinstance(layout, dict):
        differ = [k for k in LAYOUT_SIZES if k in saved and k in layout and saved[k] != layout[k]]
        if differ:
            raise CheckpointError(f"{folder}/meta.json records {differ[0].upper()}={layout[differ[0]]}, but its "
                                  f"{STATE_FILE} was saved at {differ[0].upper()}={saved[differ[0]]}")
    return state


def remove_stale_temporaries(root: str) -> list[str]:
    """Delete what saves of processes that no longer run left behind; returns the names.
    An .old copy whose iteration folder is missing (a save died between its two renames
    on a filesystem without atomic exchange) is the only copy of that iteration: kept."""
    return files.remove_stale(root, _TEMPORARY, keep=lambda m: m.group("kind") == "old"
                              and not os.path.exists(os.path.join(root, m.group("base"))))


def holds_checkpoints(root: str) -> int | None:
    """The latest iteration saved in ``root`` (None when it holds no checkpoint)."""
    if not os.path.isdir(root):
        return None
    found = latest_iteration(root)
    if found is None and any(re.match(r"^iter_\d+$", n) for n in os.listdir(root)):
        return -1  # iteration folders without a tracker
    return found
