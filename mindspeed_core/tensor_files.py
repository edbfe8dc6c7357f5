"""Framework-neutral tensor files: the safetensors format with JSON metadata.

Written and read with numpy alone, so a file saved under one framework loads under the
other (and in Hugging Face's ``safetensors`` library). bfloat16, which numpy lacks, travels
as its raw 16-bit patterns and is tagged ``BF16`` in the header as the format requires.
Writes go to a temporary name and are renamed into place, so an interrupted save never
destroys the previous file.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from mindspeed_core.errors import CheckpointError

# safetensors dtype tag <-> numpy dtype; BF16 is carried as uint16 bit patterns.
_TAGS = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_NUMPY_TO_TAG = {np.dtype(v): k for k, v in _TAGS.items() if k != "BF16"}
METADATA_KEY = "mindspeed"
_MAX_HEADER = 100 * 1024 * 1024


class HostTensor:
    """A tensor on the host: numpy data plus the facade dtype name (keeps bfloat16 apart)."""

    __slots__ = ("array", "dtype")

    def __init__(self, array: np.ndarray, dtype: str | None = None):
        self.array = np.ascontiguousarray(array)
        self.dtype = dtype or str(self.array.dtype)


def save(path: str, tensors: dict[str, HostTensor], metadata: dict | None = None,
         raw_metadata: dict[str, str] | None = None) -> None:
    """``metadata`` travels as JSON under one key; ``raw_metadata`` are plain string entries
    other readers look for (Hugging Face transformers wants {"format": "pt"})."""
    header: dict = {}
    entries = dict(raw_metadata or {})
    if metadata is not None:
        entries[METADATA_KEY] = json.dumps(metadata, sort_keys=True)
    if entries:
        header["__metadata__"] = entries
    offset = 0
    ordered = sorted(tensors.items())
    for name, t in ordered:
        tag = "BF16" if t.dtype == "bfloat16" else _NUMPY_TO_TAG.get(t.array.dtype)
        if tag is None:
            raise CheckpointError(f"tensor {name!r} has dtype {t.array.dtype}, which safetensors cannot store")
        size = t.array.nbytes
        header[name] = {"dtype": tag, "shape": list(t.array.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data section to 8 bytes
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for _, t in ordered:
            fh.write(t.array.tobytes())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load(path: str) -> tuple[dict[str, HostTensor], dict | None]:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read tensor file {path}: {exc.strerror or exc}") from None
    if len(data) < 8:
        raise CheckpointError(f"{path} is not a safetensors file (only {len(data)} bytes)")
    (hlen,) = struct.unpack("<Q", data[:8])
    if hlen > min(_MAX_HEADER, len(data) - 8):
        raise CheckpointError(f"{path} is truncated or not a safetensors file (header length {hlen})")
    try:
        header = json.loads(data[8 : 8 + hlen])
    except ValueError:
        raise CheckpointError(f"{path} has a corrupt safetensors header") from None
    base = 8 + hlen
    meta = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        tag = info["dtype"]
        if tag not in _TAGS:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {tag}")
        if base + end > len(data):
            raise CheckpointError(f"{path} is truncated: tensor {name!r} ends past the end of the file")
        array = np.frombuffer(data, dtype=_TAGS[tag], count=(end - start) // np.dtype(_TAGS[tag]).itemsize,
                              offset=base + start).reshape(info["shape"])
        tensors[name] = HostTensor(array.copy(), "bfloat16" if tag == "BF16" else None)
    metadata = json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else None
    return tensors, metadata


def load_tensors(path: str, make_tensor) -> tuple[dict, dict | None]:
    """Load a file into framework tensors; ``make_tensor(array, dtype=name)`` is the
    backend's ``ops.tensor``. bfloat16 arrives exactly (its bits widened to float32)."""
    host, metadata = load(path)
    out = {}
    for name, t in host.items():
        if t.dtype == "bfloat16":
            out[name] = make_tensor((t.array.astype(np.uint32) << 16).view(np.float32), dtype="bfloat16")
        else:
            out[name] = make_tensor(t.array, dtype=str(t.array.dtype))
    return out, metadata
