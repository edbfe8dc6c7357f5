"""Sharded checkpoints: every rank writes the pieces it owns, in parallel; one index maps them.

    <save>/iter_0000100/rank_00003.safetensors   rank 3's pieces (a rank that owns none writes none)
    <save>/iter_0000100/trainer_state.json       RNG states per rank, loss scale (training/resume.py)
    <save>/iter_0000100/meta.json                as a whole checkpoint's (training/checkpoint.py), and
        "format": "sharded", "steps": the optimizer's step count, and "index": per section
        ("model", "optimizer"), per whole tensor its shape, dtype and pieces, each
        [file, entry, offset, shape, SHA-256 of its bytes]; "sha256" holds every file's digest

A piece is a box of the whole tensor (parallel/sharding.py). Each element is written once:
a parameter by the first data-parallel replica of its position (expert weights: the first
expert-data-parallel one), a tensor-parallel copy (the copied key/value rows) by the first
rank holding it, the last stage's copy of tied embeddings never; the distributed optimizer's
state by each rank for the flat slice it owns. Loading at any layout reads the index, then
only the entries that meet this rank's boxes, each checked against its own digest
(tensor_files.read_some), and counts the bytes it read. Readers that want the whole model
(conversion, generation, fine-tuning) read whole files, checked against the file digests.

The save is collective: the folder is made by rank 0, the files written and fsynced by
their ranks, the index gathered (a barrier: every file is durable by then), and only then
rank 0 writes meta.json, renames the folder into place and moves the tracker
(training/checkpoint.py publish).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from mindspeed_core import features, files, tensor_files
from mindspeed_core.compat import torch_dist
from mindspeed_core.errors import CheckpointError, MindSpeedError
from mindspeed_core.parallel.sharding import flat_boxes, intersect, placement, region, with_experts

FORMAT = "sharded"


@dataclass(frozen=True)
class Held:
    """A tensor of this rank as a checkpoint sees it. ``name``: its name in the index
    ("<parameter>" or "<exp_avg|exp_avg_sq|master>.<parameter>"); ``shape`` this rank's
    tensor's, ``whole``/``pieces`` where it lies in the whole one (parallel/sharding.py);
    ``flat``: (lo, hi) of its row-major elements this rank holds (the distributed optimizer's
    slice), None: all of them; ``writes``: whether this rank writes its primary pieces."""

    name: str
    shape: tuple
    whole: tuple
    pieces: tuple
    flat: tuple | None = None
    writes: bool = True

    def boxes(self) -> list:
        """(this rank's box, where its values start in the held data): the held elements as boxes."""
        if self.flat is None:
            return [(((0,) * len(self.shape), self.shape), 0)]
        out, at = [], 0
        for box in flat_boxes(self.shape, *self.flat):
            out.append((box, at))
            at += int(np.prod(box[1], dtype=np.int64))
        return out

    def parts(self, primary_only: bool):
        """(box of the held data, its place in the whole tensor) for every part of every box."""
        for box, at in self.boxes():
            for lo, go, shape, primary in self.pieces:
                if primary_only and not primary:
                    continue
                part = intersect(box, (lo, shape))
                if part is not None:
                    yield box, at, part, (tuple(g + p - q for g, p, q in zip(go, part[0], lo)), part[1])


def held(name: str, shape: tuple, plan_entry, ps, flat: tuple | None = None, writes: bool | None = None) -> Held:
    """``name``'s placement for this rank: its parameter's ParamPlan (parallel/plan.py) says how
    it is cut; ``writes`` None: the parameter's rule (the first replica writes)."""
    spec = plan_entry.shard if ps.tp > 1 else None
    whole, pieces = placement(spec, tuple(shape), ps.tp, ps.local_rank("tp"))
    if plan_entry.expert:
        whole, pieces = with_experts(whole, pieces, ps.ep, ps.local_rank("ep"))
    if writes is None:
        writes = (ps.local_rank("edp") == 0 and (ps.local_rank("cp") == 0 or ps.ep_over_tp) if plan_entry.expert
                  else ps.local_rank("dp_cp") == 0)
    if spec is None and ps.local_rank("tp") > 0 and not (plan_entry.expert and ps.ep_over_tp):
        writes = False  # replicated over the tensor-parallel group: its first rank's (EP across TP: other experts)
    return Held(name, tuple(shape), whole, tuple(pieces), flat, writes and not plan_entry.tied_copy)


def _dtype_tag(dtype: str) -> str:
    return dtype if dtype in ("bfloat16", "float16") else "float32"


def write_rank_file(folder: str, rank: int, sections: dict) -> tuple[dict, str | None, str | None]:
    """Write this rank's pieces: ``sections`` {"model"|"optimizer": [(Held, values, dtype)]}
    (values: numpy, the held data: the rank's tensor, or its flat slice). Returns (its part of
    the index, its file's name, the file's SHA-256); no file when it writes nothing."""
    entries, index, fname = {}, {}, f"rank_{rank:05d}.safetensors"
    for section, items in sections.items():
        part = index.setdefault(section, {})
        for h, values, dtype in items:
            values = np.asarray(values)
            record = part.setdefault(h.name, {"shape": list(h.whole), "dtype": _dtype_tag(dtype), "pieces": []})
            if not h.writes:
                continue
            for box, at, local, whole in h.parts(primary_only=True):
                data = values if h.flat is None else values[at:at + int(np.prod(box[1]))].reshape(box[1])
                stored = tensor_files.HostTensor.of(data[region(local, within=box)], dtype)
                key = f"{section}/{h.name}/{len(record['pieces'])}"
                entries[key] = stored
                record["pieces"].append([fname, key, list(whole[0]), list(whole[1]),
                                         hashlib.sha256(tensor_files.raw_bytes(stored.array)).hexdigest()])
    if not entries:
        return index, None, None
    return index, fname, tensor_files.save(os.path.join(folder, fname), entries, {"rank": rank})


def merge_indices(parts: list) -> dict:
    """Every rank's part of the index as one; refuses a tensor whose pieces do not add up to it
    (each element is written once: a bug in who writes what must not pass as a checkpoint)."""
    out: dict = {}
    for part in parts:
        for section, tensors in part.items():
            for name, record in tensors.items():
                merged = out.setdefault(section, {}).setdefault(
                    name, {"shape": record["shape"], "dtype": record["dtype"], "pieces": []})
                merged["pieces"] += record["pieces"]
    for section, tensors in out.items():
        for name, record in tensors.items():
            covered = sum(int(np.prod(p[3], dtype=np.int64)) for p in record["pieces"])
            if covered != int(np.prod(record["shape"], dtype=np.int64)):
                raise MindSpeedError(f"internal error: the ranks wrote {covered} elements of {section} tensor {name} "
                                     f"of shape {tuple(record['shape'])}; not saving")
    return out


class Reader:
    """What one rank reads of a sharded checkpoint: its boxes of named tensors."""

    def __init__(self, folder: str, meta: dict):
        self.folder, self.meta = folder, meta
        index = meta.get("index")
        if not isinstance(index, dict):
            raise CheckpointError(f"{folder}/meta.json holds no valid index of its shards")
        self.index = index
        for section, tensors in index.items():
            if not isinstance(tensors, dict):
                raise CheckpointError(f"{folder}/meta.json holds no valid index of its shards")
            for name, record in tensors.items():
                _check_tiling(record, folder, section, name)
        self.steps = meta.get("steps")
        if type(self.steps) is not int or self.steps < 0:
            raise CheckpointError(f"{folder}/meta.json holds no valid step count ({self.steps!r})")
        self.bytes_read = 0
        self._headers = {}  # file name -> its parsed safetensors header, read once

    def names(self, section: str) -> set:
        return set(self.index.get(section) or {})

    def total_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.folder, f)) for f in self.meta.get("sha256", {})
                   if f.startswith("rank_"))

    def elements(self, section: str, name: str) -> int:
        """The whole tensor's element count, from the index."""
        return int(np.prod(self._record(section, name)["shape"], dtype=np.int64))

    def section_bytes(self, section: str) -> int:
        """The stored bytes of one section's tensors (every piece), from the index."""
        return sum(int(np.prod(_piece(piece, self.folder, name)[3], dtype=np.int64))
                   * (2 if record.get("dtype") in ("bfloat16", "float16") else 4)
                   for name, record in (self.index.get(section) or {}).items() for piece in record["pieces"])

    def _record(self, section: str, name: str) -> dict:
        record = (self.index.get(section) or {}).get(name)
        if not isinstance(record, dict) or not isinstance(record.get("pieces"), list):
            raise CheckpointError(f"the checkpoint in {self.folder} holds no {section} tensor {name}")
        return record

    def read(self, section: str, h: Held) -> np.ndarray:
        """The values of ``h`` (float32): this rank's tensor, or its flat slice."""
        features.note_used("sharded-checkpoints")
        record = self._record(section, h.name)
        if tuple(record["shape"]) != h.whole:
            raise CheckpointError(f"{section} tensor {h.name} has shape {tuple(record['shape'])} in the checkpoint in "
                                  f"{self.folder}; this model's is {h.whole}")
        # (held box, its start in the output, part of it, the same part in the whole tensor)
        needed = list(h.parts(primary_only=False))
        wanted: dict = {}
        for piece in record["pieces"]:
            fname, key, offset, shape, sha = _piece(piece, self.folder, h.name)
            if any(intersect(whole, (tuple(offset), tuple(shape))) for *_, whole in needed):
                wanted.setdefault(fname, {})[key] = sha
        values = {}
        for fname, keys in wanted.items():
            got, nbytes, self._headers[fname] = tensor_files.read_some(self._path(fname), keys,
                                                                        self._headers.get(fname))
            self.bytes_read += nbytes
            for k, t in got.items():
                _check_dtype(t, record, self._path(fname), k, section, h.name)
            values.update({(fname, k): t.float32() for k, t in got.items()})
        for piece in record["pieces"]:
            fname, key, _, shape, _ = _piece(piece, self.folder, h.name)
            if (fname, key) in values:
                _check_stored(values[(fname, key)], shape, self._path(fname), key, section, h.name)
        size = int(np.prod(h.shape)) if h.flat is None else h.flat[1] - h.flat[0]
        out, filled = np.zeros(size, np.float32), 0
        for box, at, local, whole in needed:
            target = out[at:at + int(np.prod(box[1]))].reshape(box[1])
            for piece in record["pieces"]:
                fname, key, offset, shape, _ = _piece(piece, self.folder, h.name)
                both = intersect(whole, (tuple(offset), tuple(shape)))
                if both is None:
                    continue
                source = values[(fname, key)].reshape(shape)
                into = (tuple(lo + b - w for lo, b, w in zip(local[0], both[0], whole[0])), both[1])
                target[region(into, within=box)] = source[region(both, within=tuple(offset))]
                filled += int(np.prod(both[1]))
        if filled != sum(int(np.prod(whole[1])) for *_, whole in needed):
            raise CheckpointError(f"the checkpoint in {self.folder} lacks part of {section} tensor {h.name} "
                                  f"(a rank's pieces are missing from its index)")
        return out.reshape(h.shape) if h.flat is None else out

    def whole(self, section: str) -> dict:
        """{name: float32 array} of every tensor of ``section``, whole (every file read whole and
        checked against its recorded SHA-256)."""
        digests, out, loaded = self.meta.get("sha256", {}), {}, {}
        for name, record in (self.index.get(section) or {}).items():
            array = np.zeros(tuple(record["shape"]), np.float32)
            for piece in record["pieces"]:
                fname, key, offset, shape, _ = _piece(piece, self.folder, name)
                if fname not in loaded:
                    if not isinstance(digests.get(fname), str):
                        raise CheckpointError(f"the checkpoint's meta.json records no valid SHA-256 for {fname}")
                    loaded[fname] = tensor_files.load(self._path(fname), digests[fname])[0]
                if key not in loaded[fname]:
                    raise CheckpointError(f"{self._path(fname)} holds no tensor {key!r}: the checkpoint's index names "
                                          f"one it lacks")
                _check_dtype(loaded[fname][key], record, self._path(fname), key, section, name)
                stored = loaded[fname][key].float32()
                _check_stored(stored, shape, self._path(fname), key, section, name)
                array[region((tuple(offset), tuple(shape)))] = stored.reshape(shape)
            out[name] = array
        return out

    def _path(self, fname: str) -> str:
        return os.path.join(self.folder, fname)


def _piece(piece, folder: str, name: str) -> tuple:
    try:
        fname, key, offset, shape, sha = piece
        if not (isinstance(fname, str) and fname.startswith("rank_") and os.sep not in fname and isinstance(key, str)
                and all(type(x) is int and x >= 0 for x in [*offset, *shape]) and len(offset) == len(shape)
                and isinstance(sha, str)):
            raise ValueError
    except (TypeError, ValueError):
        raise CheckpointError(f"{folder}/meta.json has a malformed index entry for {name}") from None
    return fname, key, offset, shape, sha


def _check_dtype(stored, record: dict, path: str, key: str, section: str, name: str) -> None:
    """A piece's stored dtype must be the one meta.json's index records for its tensor."""
    if stored.dtype != record.get("dtype"):
        raise CheckpointError(f"{path} holds {key!r} as {stored.dtype}, but meta.json's index records {section} "
                              f"tensor {name} as {record.get('dtype')!r}")


def _check_stored(array: np.ndarray, shape: list, path: str, key: str, section: str, name: str) -> None:
    """A piece's stored tensor must have the shape the index gives it (an edited index would
    otherwise fail to reshape, or place values where they do not belong)."""
    if tuple(array.shape) != tuple(shape):
        raise CheckpointError(f"{path} holds {key!r} of shape {list(array.shape)}, but meta.json's index gives this "
                              f"piece of {section} tensor {name} the shape {list(shape)}")


def _check_tiling(record, folder: str, section: str, name: str) -> None:
    """Refuse a tensor whose pieces do not tile it exactly (a piece outside it, two pieces
    overlapping, or a hole no piece covers), before any of its pieces is read."""
    shape = record.get("shape") if isinstance(record, dict) else None
    if not (isinstance(shape, list) and all(type(x) is int and x >= 0 for x in shape)
            and isinstance(record.get("pieces"), list)):
        raise CheckpointError(f"{folder}/meta.json has a malformed index entry for {name}")
    boxes = []
    for piece in record["pieces"]:
        _, key, offset, size, _ = _piece(piece, folder, name)
        if not key.startswith(f"{section}/{name}/"):  # write_rank_file names each entry after its tensor
            raise CheckpointError(f"{folder}/meta.json gives {section} tensor {name} a piece of another tensor "
                                  f"({key!r})")
        if len(offset) != len(shape) or any(o + s > n for o, s, n in zip(offset, size, shape)):
            raise CheckpointError(f"{folder}/meta.json places a piece of {section} tensor {name} outside it "
                                  f"(offset {offset}, shape {size}; the tensor's shape is {shape})")
        if all(size):
            boxes.append((tuple(offset), tuple(size)))
    boxes.sort()
    for i, a in enumerate(boxes):  # sorted by first offset: only the boxes starting before a ends can meet it
        for b in boxes[i + 1:]:
            if len(shape) and b[0][0] >= a[0][0] + a[1][0]:
                break
            if intersect(a, b) is not None:
                raise CheckpointError(f"{folder}/meta.json has overlapping pieces of {section} tensor {name} "
                                      f"(offsets {list(a[0])} and {list(b[0])})")
    covered = sum(int(np.prod(b[1], dtype=np.int64)) for b in boxes)
    if covered != int(np.prod(shape, dtype=np.int64)):
        raise CheckpointError(f"{folder}/meta.json leaves a hole in {section} tensor {name}: its pieces cover "
                              f"{covered} of its {int(np.prod(shape, dtype=np.int64))} elements")


class TorchDistCopy:
    """--ckpt-format torch_dist: the model's pieces this rank writes, written a second time as
    megatron-core's dist_checkpointing writes them (compat/torch_dist.py), into the same
    folder; rank 0 adds the metadata once every rank's file is durable. ``common``: Megatron's
    args and iteration for common.pt."""

    def __init__(self, layers: int, stacked: bool, num_experts: int, tp_rank: int, common: dict,
                 experts_apart: bool = False):
        self.layers, self.stacked, self.num_experts = layers, stacked, num_experts
        self.tp_rank, self.common = tp_rank, common
        self.experts_apart = experts_apart  # EP across TP: each TP rank holds other experts

    def write(self, folder: str, rank: int, model: list) -> tuple[list, str | None]:
        """``model``: [(Held, values, dtype)] as write_rank_file takes them."""
        chunks, objects = [], []
        for h, values, dtype in model:
            if not h.writes:
                continue
            values = np.asarray(values)
            for box, _, local, whole in h.parts(primary_only=True):
                chunks.append(torch_dist.model_chunks(h.name, h.whole, whole[0], values[region(local, within=box)],
                                                      self.layers, self.stacked, _dtype_tag(dtype)))
            # the objects megatron-core keeps beside a linear layer's weight (None here), once
            if self.tp_rank == 0 or (self.experts_apart and ".mlp.experts." in h.name):
                first = min(go[0] for _, go, _, _ in h.pieces) if h.pieces else 0
                objects += torch_dist.extra_states(h.name, self.layers, self.stacked,
                                                   range(first, first + h.shape[0]), self.num_experts)
        return torch_dist.write_rank_file(folder, rank, chunks, objects)

    def finish(self, folder: str, parts: list) -> None:
        torch_dist.write_metadata(folder, [p or [] for p in parts], self.common)


def fsync_written(folder: str, fname: str | None) -> None:
    """tensor_files.save fsyncs each file; the folder entry too, before the index says it exists."""
    if fname is not None:
        files.fsync_dir(folder)
