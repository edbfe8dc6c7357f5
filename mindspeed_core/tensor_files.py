"""Framework-neutral tensor files: the safetensors format with JSON metadata.

Written and read with numpy alone, so a file saved under one framework loads under the
other (and in Hugging Face's ``safetensors`` library). bfloat16, which numpy lacks, travels
as its raw 16-bit patterns and is tagged ``BF16`` in the header as the format requires.
Writes go to a temporary name and are renamed into place, so an interrupted save never
destroys the previous file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np

from mindspeed_core import features
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


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounding to nearest even (exact for bf16 values)."""
    v = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = v + 0x7FFF + ((v >> 16) & 1)
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = 0x7FC0
    return out


class HostTensor:
    """A tensor on the host: numpy data plus the facade dtype name (keeps bfloat16 apart)."""

    __slots__ = ("array", "dtype")

    def __init__(self, array: np.ndarray, dtype: str | None = None):
        self.array = np.ascontiguousarray(array)
        self.dtype = dtype or str(self.array.dtype)

    @classmethod
    def of(cls, values: np.ndarray, dtype: str) -> "HostTensor":
        """Float values stored as ``dtype``: bfloat16 (rounded to nearest even), float16, else float32."""
        values = np.ascontiguousarray(values, np.float32)
        if dtype == "bfloat16":
            return cls(float32_to_bf16_bits(values), "bfloat16")
        return cls(values.astype(np.float16) if dtype == "float16" else values)

    def float32(self) -> np.ndarray:
        """The values widened to float32 (bfloat16's bits shifted into place)."""
        if self.dtype == "bfloat16":
            return (self.array.astype(np.uint32) << 16).view(np.float32)
        return self.array.astype(np.float32)


def save(path: str, tensors: dict[str, HostTensor], metadata: dict | None = None,
         raw_metadata: dict[str, str] | None = None) -> str:
    """``metadata`` travels as JSON under one key; ``raw_metadata`` are plain string entries
    other readers look for (Hugging Face transformers wants {"format": "pt"}). Returns the
    SHA-256 of the bytes written, for the caller to record and ``load`` to verify."""
    features.note_used("safetensors-io")
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
    digest = hashlib.sha256()
    with open(tmp, "wb") as fh:
        for chunk in (struct.pack("<Q", len(blob)), blob, *(raw_bytes(t.array) for _, t in ordered)):
            digest.update(chunk)
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return digest.hexdigest()


def raw_bytes(array: np.ndarray):
    """A contiguous array's own buffer as bytes, without a copy (tobytes() would make one)."""
    return memoryview(array).cast("B") if array.size else b""


def load(path: str, sha256: str | None = None) -> tuple[dict[str, HostTensor], dict | None]:
    """Read a file; with ``sha256`` (recorded by ``save``) a file whose bytes changed is refused."""
    features.note_used("safetensors-io")
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read tensor file {path}: {exc.strerror or exc}") from None
    header, base, metadata = _header(path, data[:8], lambda n: data[8:8 + n], len(data))
    tensors = {}
    for name, info in header.items():
        tag, shape, start, end = _entry(path, name, info, base, len(data))
        tensors[name] = _host(tag, shape, data[base + start:base + end])
    # after parsing, so that a truncated or garbled file is named as such; this catches the
    # rest, e.g. a flipped bit in the data that would otherwise load as a wild weight
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{path} is corrupt: its SHA-256 differs from the one recorded when it was saved")
    return tensors, metadata


def read_some(path: str, wanted: dict[str, str],
              parsed: tuple | None = None) -> tuple[dict[str, HostTensor], int, tuple]:
    """Only the tensors ``wanted`` names ({name: SHA-256 of its bytes, as recorded}), each read
    from its own byte range and checked against its digest. Returns them, the bytes read and
    the parsed header, which a later call on the same file passes back as ``parsed`` (its bytes
    then are not read again). A sharded checkpoint's rank reads its slices this way, not the
    whole file."""
    features.note_used("safetensors-io")
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            read = 0
            if parsed is None:
                header, base, _ = _header(path, os.pread(fh.fileno(), 8, 0), lambda n: os.pread(fh.fileno(), n, 8),
                                          size)
                parsed, read = (header, base), base
            header, base = parsed
            out = {}
            for name, sha256 in wanted.items():
                if name not in header:
                    raise CheckpointError(f"{path} holds no tensor {name!r}: the checkpoint's index names one it lacks")
                tag, shape, start, end = _entry(path, name, header[name], base, size)
                data = os.pread(fh.fileno(), end - start, base + start)
                read += len(data)
                if len(data) != end - start:
                    raise CheckpointError(f"{path} is truncated: tensor {name!r} ends past the end of the file")
                if hashlib.sha256(data).hexdigest() != sha256:
                    raise CheckpointError(f"{path} is corrupt: tensor {name!r} differs from the SHA-256 recorded when "
                                          f"it was saved")
                out[name] = _host(tag, shape, data)
    except OSError as exc:
        raise CheckpointError(f"cannot read tensor file {path}: {exc.strerror or exc}") from None
    return out, read, parsed


def _header(path: str, head: bytes, read_header, size: int) -> tuple[dict, int, dict | None]:
    """(the tensors' header entries, where the data starts, the JSON metadata): ``head`` is
    the file's first 8 bytes, ``read_header(n)`` its next n."""
    if len(head) < 8:
        raise CheckpointError(f"{path} is not a safetensors file (only {size} bytes)")
    (hlen,) = struct.unpack("<Q", head[:8])
    if hlen > min(_MAX_HEADER, size - 8):
        raise CheckpointError(f"{path} is truncated or not a safetensors file (header length {hlen})")
    try:
        header = json.loads(read_header(hlen))
    except ValueError:  # UnicodeDecodeError included
        raise CheckpointError(f"{path} has a corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (__metadata__ is not an object)")
    try:
        metadata = json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else None
    except (TypeError, ValueError):
        raise CheckpointError(f"{path} has corrupt metadata (not JSON)") from None
    return header, 8 + hlen, metadata


def _entry(path: str, name: str, info, base: int, size: int) -> tuple[str, list, int, int]:
    """One header entry (dtype tag, shape, data offsets), checked field by field: a flipped bit
    anywhere in the header is a clear error, never a KeyError, a negative shape or a read past
    the data."""
    def bad(what: str):
        return CheckpointError(f"{path} has a corrupt safetensors header: tensor {name!r} {what}")

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise bad("lacks dtype, shape or data_offsets")
    tag, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(tag, str) or tag not in _TAGS:
        raise bad(f"has unsupported dtype {tag!r}")
    ints = (lambda v: isinstance(v, list) and all(type(x) is int and x >= 0 for x in v))
    if not ints(shape) or not ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise bad(f"has an invalid shape {shape!r} or data_offsets {offsets!r}")
    start, end = offsets
    if base + end > size:
        raise CheckpointError(f"{path} is truncated: tensor {name!r} ends past the end of the file")
    if end - start != int(np.prod(shape, dtype=np.int64)) * np.dtype(_TAGS[tag]).itemsize:
        raise bad(f"of shape {shape} does not fit its {end - start} bytes")
    return tag, shape, start, end


def _host(tag: str, shape: list, data: bytes) -> HostTensor:
    array = np.frombuffer(data, dtype=_TAGS[tag]).reshape(shape)
    return HostTensor(array.copy(), "bfloat16" if tag == "BF16" else None)


def load_tensors(path: str, make_tensor) -> tuple[dict, dict | None]:
    """Load a file into framework tensors; ``make_tensor(array, dtype=name)`` is the
    backend's ``ops.tensor``. bfloat16 arrives exactly (its bits widened to float32)."""
    host, metadata = load(path)
    out = {}
    for name, t in host.items():
        if t.dtype == "bfloat16":
            out[name] = make_tensor(t.float32(), dtype="bfloat16")
        else:
            out[name] = make_tensor(t.array, dtype=str(t.array.dtype))
    return out, metadata
