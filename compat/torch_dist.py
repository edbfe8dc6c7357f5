"""Megatron's distributed checkpoint format (``--ckpt-format torch_dist``: megatron-core's
dist_checkpointing on torch.distributed.checkpoint), read and written with numpy alone.

    <save>/latest_checkpointed_iteration.txt   the newest iteration
    <save>/iter_0000100/metadata.json          {"sharded_backend": "torch_dist", ...}
    <save>/iter_0000100/common.pt              torch.save of what is not sharded: args, iteration
    <save>/iter_0000100/.metadata              a pickled torch.distributed.checkpoint Metadata: per
                                               key its whole shape, dtype and chunks (offsets, sizes),
                                               and where each chunk's bytes lie (file, offset, length)
    <save>/iter_0000100/__R_T.distcp           rank R's chunks (writer T), each a torch.save archive

The keys are megatron-core's sharded keys (GPTModel.sharded_state_dict with the local layer
spec). A layer's tensor is stacked over the model's layers on a new leading axis
(``decoder.layers.self_attention.linear_qkv.weight`` [layers, rows, hidden]); the norms carry
Transformer Engine's names (``input_layernorm.weight`` -> ``self_attention.linear_qkv.layer_norm_weight``,
``pre_mlp_layernorm`` -> ``mlp.linear_fc1.layer_norm_``); experts are stacked on a second axis as
[out, in] matrices (``mlp.experts.experts.linear_fc1.weight`` [layers, experts, 2 ffn, hidden]),
where ours are [experts, in, out]. A tied output layer has no key of its own. Inside a tensor
the layout is the whole tensor's, as compat/mcore.py's (q/k/v per query group, gate rows then
up rows), so a chunk is a box of it wherever it came from.

``.metadata`` is a pickle: it is read through compat/torch_pickle's allow-list, the classes
of torch it names kept as inert records; anything else is refused in one line. Writing emits
the same classes by name, so neither direction needs torch.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np

from mindspeed_core import features
from mindspeed_core.compat import torch_pickle
from mindspeed_core.errors import CheckpointError
from mindspeed_core.tensor_files import HostTensor

METADATA, COMMON, CONFIG = ".metadata", "common.pt", "metadata.json"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
_DCP = "torch.distributed.checkpoint.metadata"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_NORMS = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
          ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
_EXPERTS = {"mlp.experts.weight1": "mlp.experts.experts.linear_fc1.weight",
            "mlp.experts.weight2": "mlp.experts.experts.linear_fc2.weight",
            "mlp.experts.bias1": "mlp.experts.experts.linear_fc1.bias",
            "mlp.experts.bias2": "mlp.experts.experts.linear_fc2.bias"}
_SWAPPED = ("mlp.experts.weight1", "mlp.experts.weight2")  # ours [E, in, out], theirs [E, out, in]
_SWAPPED_KEYS = tuple(_EXPERTS[k] for k in _SWAPPED)
# linear layers whose megatron-core modules carry an _extra_state object (None with the local spec)
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2",
            "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")


def is_torch_dist(folder: str) -> bool:
    """Whether ``folder`` (an iteration folder) holds a torch_dist checkpoint, or what is left of
    one (any of its files: a missing one is then named by :func:`check_files`)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(n in (METADATA, COMMON, CONFIG) or re.fullmatch(r"__\d+_\d+\.distcp", n) for n in names)


def check_files(folder: str) -> None:
    """The files megatron-core's dist_checkpointing reads before any tensor: metadata.json (JSON
    naming the torch_dist backend), .metadata and common.pt, each present."""
    for name in (CONFIG, METADATA, COMMON):
        if not os.path.isfile(os.path.join(folder, name)):
            raise CheckpointError(f"the torch_dist checkpoint in {folder} has no {name}: megatron-core cannot load it")
    path = os.path.join(folder, CONFIG)
    try:
        with open(path, "rb") as fh:
            config = json.loads(fh.read())
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError:  # UnicodeDecodeError included
        raise CheckpointError(f"{path} is corrupt (not JSON)") from None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if backend != BACKEND["sharded_backend"]:
        raise CheckpointError(f"{path} names the sharded backend {backend!r}, not 'torch_dist': this folder's "
                              f"files are torch_dist's, and only torch_dist is read")


# ---- names ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Key:
    """Where one of our tensors lies among megatron-core's: ``key``, the layer it is stacked at
    (None: not a layer's), whether its last two axes are swapped (experts)."""

    key: str
    layer: int | None = None
    swapped: bool = False

    def chunk(self, offset: tuple, shape: tuple) -> tuple[tuple, tuple]:
        """A box of our tensor as a box of megatron-core's."""
        offset, shape = tuple(offset), tuple(shape)
        if self.swapped:
            offset, shape = offset[:-2] + offset[:-3:-1], shape[:-2] + shape[:-3:-1]
        if self.layer is not None:
            offset, shape = (self.layer, *offset), (1, *shape)
        return offset, shape

    def whole(self, shape: tuple, layers: int) -> tuple:
        """Our whole tensor's shape as megatron-core's (``layers``: the model's layer count)."""
        shape = tuple(shape)
        if self.swapped:
            shape = shape[:-2] + shape[:-3:-1]
        return ((layers,) if self.layer is not None else ()) + shape


def _theirs(rest: str) -> str:
    """A layer's tensor name (inside the layer) in megatron-core's sharded keys."""
    if rest in _EXPERTS:
        return _EXPERTS[rest]
    for ours, theirs in _NORMS:
        if rest.startswith(ours):
            return theirs + rest[len(ours):]
    return rest


def _ours(rest: str) -> str:
    """The inverse of ``_theirs``."""
    for ours, theirs in _EXPERTS.items():
        if rest == theirs:
            return ours
    for ours, theirs in _NORMS:
        if rest.startswith(theirs):
            return ours + rest[len(theirs):]
    return rest


def key_of(name: str, stacked: bool) -> Key:
    """Our whole-model name -> its megatron-core sharded key. ``stacked``: the model's layers are
    alike, and megatron-core stacks them; a model whose layers differ (dense layers before MoE
    ones: --moe-layer-freq as a list, --first-k-dense-replace) keeps each layer's own keys."""
    m = _LAYER.match(name)
    if m is None:
        return Key(name)
    layer, rest = int(m.group(1)), m.group(2)
    if stacked:
        return Key("decoder.layers." + _theirs(rest), layer, rest in _SWAPPED)
    return Key(f"decoder.layers.{layer}.{_theirs(rest)}", None, rest in _SWAPPED)


def name_of(key: str, layer: int | None) -> str:
    """The inverse of ``key_of``: a megatron-core key (stacked: at ``layer``) -> our name."""
    m = _LAYER.match(key)
    if m is not None:
        return f"decoder.layers.{m.group(1)}.{_ours(m.group(2))}"
    if layer is None:
        return key
    return f"decoder.layers.{layer}.{_ours(key[len('decoder.layers.'):])}"


def extra_states(name: str, layers: int, stacked: bool, experts: range = range(0), num_experts: int = 0) -> list:
    """The keys of the _extra_state objects megatron-core pairs with our weight ``name``; for a
    stack of experts, those of ``experts`` (the ones this rank holds) of ``num_experts``. Each
    key ends in /shard_<offset>_<shape> of the object's place among its like."""
    m = _LAYER.match(name)
    if m is None:
        return []
    layer, rest = int(m.group(1)), m.group(2)
    prefix, at, among = ("decoder.layers.", [str(layer)], [str(layers)]) if stacked else \
        (f"decoder.layers.{layer}.", [], [])
    if rest in _SWAPPED:  # an expert weight (their biases have no _extra_state of their own)
        fc = _EXPERTS[rest].rsplit(".", 1)[0]
        return [f"{prefix}{fc}._extra_state/shard_{'.'.join(at + [str(e)])}_{'.'.join(among + [str(num_experts)])}"
                for e in experts]
    if rest.endswith(".weight") and rest[:-len(".weight")] in _LINEARS:
        return [f"{prefix}{rest[:-len('.weight')]}._extra_state/shard_{'.'.join(at or ['0'])}_"
                f"{'.'.join(among or ['1'])}"]
    return []


# ---- reading --------------------------------------------------------------------------------

@dataclass
class Chunk:
    offset: tuple
    shape: tuple
    file: str
    at: int
    length: int


@dataclass
class Tensor:
    shape: tuple
    dtype: str
    chunks: list


def _size(value, what: str) -> tuple:
    """A pickled torch.Size (an inert record of its tuple) as a tuple of ints."""
    args = getattr(value, "args", None)
    if isinstance(value, tuple):
        args = (value,)
    if not (isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], (tuple, list))
            and all(type(x) is int and x >= 0 for x in args[0])):
        raise CheckpointError(f"{what} is not a valid size")
    return tuple(args[0])


def _state(record, kind: str, what: str) -> dict:
    if not (isinstance(record, torch_pickle.Opaque) and record.qualified.endswith("." + kind)
            and isinstance(record.state, dict)):
        raise CheckpointError(f"{what} is not a {kind}")
    return record.state


def read_index(folder: str) -> dict:
    """{key: Tensor} of a torch_dist checkpoint's tensors (byte objects left out)."""
    path = os.path.join(folder, METADATA)
    meta = _state(torch_pickle.load_pickle(path), "Metadata", path)
    where = {}
    storage = meta.get("storage_data")
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path} holds no storage index")
    for index, info in storage.items():
        i, s = _state(index, "MetadataIndex", path), _state(info, "_StorageInfo", path)
        if s.get("transform_descriptors"):
            raise CheckpointError(f"{path}: {i.get('fqn')} is stored with transforms {s['transform_descriptors']} "
                                  f"(compression?): not supported")
        fname, at, length = s.get("relative_path"), s.get("offset"), s.get("length")
        if not (isinstance(fname, str) and re.fullmatch(r"__\d+_\d+\.distcp", fname) and type(at) is int
                and type(length) is int and at >= 0 and length > 0):
            raise CheckpointError(f"{path} has a malformed storage entry for {i.get('fqn')!r}")
        offset = None if i.get("offset") is None else _size(i["offset"], f"{path}: an offset of {i.get('fqn')}")
        where[i.get("fqn"), offset] = (fname, at, length)
    out = {}
    sdm = meta.get("state_dict_metadata")
    if not isinstance(sdm, dict):
        raise CheckpointError(f"{path} holds no tensor index")
    for key, record in sdm.items():
        if isinstance(record, torch_pickle.Opaque) and record.qualified.endswith(".BytesStorageMetadata"):
            continue
        t = _state(record, "TensorStorageMetadata", f"{path}: {key}")
        shape = _size(t.get("size"), f"{path}: the size of {key}")
        props = getattr(t.get("properties"), "state", None)
        dtype = props[0].name if isinstance(props, tuple) and isinstance(props[0], torch_pickle.TorchDType) else None
        chunks = []
        for c in t.get("chunks") or []:
            c = _state(c, "ChunkStorageMetadata", f"{path}: a chunk of {key}")
            offset, size = _size(c.get("offsets"), f"{path}: {key}"), _size(c.get("sizes"), f"{path}: {key}")
            if len(offset) != len(shape) or any(o + s > n for o, s, n in zip(offset, size, shape)):
                raise CheckpointError(f"{path}: a chunk of {key} at {offset} of {size} lies outside its {shape}")
            if (key, offset) not in where:
                raise CheckpointError(f"{path}: the chunk of {key} at {offset} has no storage entry")
            chunks.append(Chunk(offset, size, *where[key, offset]))
        # a layer's tensor that not every layer has (a dense layer's MLP among MoE layers) is covered in part
        if sum(int(np.prod(c.shape)) for c in chunks) > int(np.prod(shape)):
            raise CheckpointError(f"{path}: the chunks of {key} overlap")
        out[key] = Tensor(shape, dtype, chunks)
    return out


def read_tensor(folder: str, key: str, tensor: Tensor) -> np.ndarray:
    """The whole of ``key`` (a model's tensor) as float32, from its chunks."""
    if tensor.dtype not in ("float32", "bfloat16", "float16"):
        raise CheckpointError(f"{folder}: {key} has dtype {tensor.dtype}; a model's tensors are float32, bfloat16 or "
                              f"float16")
    out = np.zeros(tensor.shape, np.float32)
    for c in tensor.chunks:
        path = os.path.join(folder, c.file)
        try:
            with open(path, "rb") as fh:
                data = os.pread(fh.fileno(), c.length, c.at)
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
        if len(data) != c.length:
            raise CheckpointError(f"{path} ends before the chunk of {key} at {c.offset} (truncated)")
        value = torch_pickle.loads(data, f"{path} (the chunk of {key} at {c.offset})")
        if not isinstance(value, HostTensor) or value.array.shape != c.shape:
            raise CheckpointError(f"{path}: the chunk of {key} at {c.offset} is not a tensor of {c.shape}")
        out[tuple(slice(o, o + s) for o, s in zip(c.offset, c.shape))] = value.float32()
    return out


def read_common(folder: str) -> dict:
    path = os.path.join(folder, COMMON)
    common = torch_pickle.load(path)
    if not isinstance(common, dict):
        raise CheckpointError(f"{path} holds a {type(common).__name__}, not Megatron's common state")
    return common


def load(folder: str) -> tuple[dict, dict]:
    """(common state, {our name: float32 array}) of the torch_dist checkpoint in ``folder``: the
    model whole (what Megatron saves besides it, its optimizer's state, is not read)."""
    features.note_used("ckpt-format-torch-dist")
    check_files(folder)
    out = {}
    for key, tensor in read_index(folder).items():
        if not (key.startswith(("embedding.", "decoder.", "output_layer.", "rm_head.", "mtp."))):
            continue  # the optimizer's and other states
        whole = read_tensor(folder, key, tensor)
        if not key.startswith("decoder.layers.") or _LAYER.match(key):  # not a stack of layers
            out[name_of(key, None)] = np.ascontiguousarray(np.swapaxes(whole, -1, -2)) \
                if key.endswith(_SWAPPED_KEYS) else whole
            continue
        swapped = key.endswith(_SWAPPED_KEYS)
        per_layer = int(np.prod(tensor.shape[1:]))
        for layer, values in enumerate(whole):
            held = sum(int(np.prod(c.shape[1:])) for c in tensor.chunks
                       if c.offset[0] <= layer < c.offset[0] + c.shape[0])
            if held == 0:
                continue  # a layer without this tensor (a dense layer's experts)
            if held != per_layer:
                raise CheckpointError(f"{folder}: the chunks of {key} hold {held} of layer {layer}'s {per_layer} "
                                      f"elements (a rank's file is missing from its metadata)")
            out[name_of(key, layer)] = np.ascontiguousarray(np.swapaxes(values, -1, -2) if swapped else values)
    return read_common(folder), out


# ---- writing --------------------------------------------------------------------------------

def _torch_size(values) -> torch_pickle.Call:
    return torch_pickle.Call(torch_pickle.Global("torch", "Size"), (tuple(int(v) for v in values),))


def _dcp(name: str, state) -> torch_pickle.Instance:
    return torch_pickle.Instance(torch_pickle.Global(_DCP, name), state)


def write_rank_file(folder: str, rank: int, chunks: list, objects: list) -> tuple[list, str | None]:
    """Write this rank's ``chunks`` (model_chunks' tuples: megatron-core key, its whole shape,
    the box's offset and values, dtype) and ``objects`` (keys of _extra_state objects, None
    each) as ``__<rank>_0.distcp``. Returns (its part of the index, the file's name or None),
    the index JSON-able: [key, whole shape, dtype, offset, sizes, file, at, length] per chunk,
    [key, file, at, length] per object."""
    fname, index, at = f"__{rank}_0.distcp", [], 0
    if not chunks and not objects:
        return index, None
    path = os.path.join(folder, fname)
    with open(path, "wb") as fh:
        for key, whole, offset, values, dtype in chunks:
            data = torch_pickle.dumps(HostTensor.of(values, dtype))
            fh.write(data)
            index.append([key, list(whole), dtype, list(offset), list(np.shape(values)), fname, at, len(data)])
            at += len(data)
        for key in objects:
            data = torch_pickle.dumps([None])  # megatron-core packs each key's objects as a list
            fh.write(data)
            index.append([key, fname, at, len(data)])
            at += len(data)
        fh.flush()
        os.fsync(fh.fileno())
    return index, fname


def model_chunks(name: str, whole: tuple, offset: tuple, values: np.ndarray, layers: int, stacked: bool,
                 dtype: str) -> tuple:
    """(megatron-core key, its whole shape, the box's offset, the box's values, ``dtype``) of a
    box of our tensor ``name`` of shape ``whole`` (``layers``: the model's, the stacked axis;
    ``stacked``: as key_of)."""
    k = key_of(name, stacked)
    off, shape = k.chunk(offset, values.shape)
    data = np.swapaxes(values, -1, -2) if k.swapped else values
    return k.key, k.whole(tuple(whole), layers), off, np.ascontiguousarray(data).reshape(shape), dtype


def write_metadata(folder: str, parts: list, common: dict) -> None:
    """Rank 0, once every rank's file is durable: ``.metadata`` from every rank's part of the
    index, ``common.pt`` (``common``: Megatron's args, iteration, ...) and metadata.json."""
    features.note_used("ckpt-format-torch-dist")
    tensors, storage = {}, {}
    for part in parts:
        for entry in part:
            if len(entry) == 8:
                key, whole, dtype, offset, sizes, fname, at, length = entry
                record = tensors.setdefault(key, (whole, dtype, []))
                record[2].append(_dcp("ChunkStorageMetadata", {"offsets": _torch_size(offset),
                                                               "sizes": _torch_size(sizes)}))
                index = _dcp("MetadataIndex", {"fqn": key, "offset": _torch_size(offset), "index": None})
            else:
                key, fname, at, length = entry
                tensors[key] = None
                index = _dcp("MetadataIndex", {"fqn": key, "offset": None, "index": None})
            storage[index] = torch_pickle.Instance(
                torch_pickle.Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                {"relative_path": fname, "offset": at, "length": length})
    layout = torch_pickle.Call(torch_pickle.Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = torch_pickle.Call(torch_pickle.Global(_DCP, "_MEM_FORMAT_ENCODING"), (0,))
    described = {}
    for key, record in tensors.items():
        if record is None:
            described[key] = _dcp("BytesStorageMetadata", {})
            continue
        whole, dtype, chunks = record
        properties = _dcp("TensorProperties", (torch_pickle.TorchDType(dtype), layout, False, contiguous, False))
        described[key] = _dcp("TensorStorageMetadata", {"properties": properties, "size": _torch_size(whole),
                                                        "chunks": chunks})
    metadata = _dcp("Metadata", {"state_dict_metadata": described, "planner_data": None, "storage_data": storage,
                                 "storage_meta": None, "version": "1.0.0"})
    _write(os.path.join(folder, METADATA), torch_pickle.pickled(metadata))
    torch_pickle.save(os.path.join(folder, COMMON), common)
    _write(os.path.join(folder, CONFIG), json.dumps(BACKEND).encode())


def _write(path: str, data: bytes) -> None:
    """Written and fsynced (inside the temporary folder the save publishes whole)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
