"""Megatron's indexed dataset: a .bin of token ids and a .idx describing it (MMIDIDX v1).

Layout of the .idx, little-endian, as megatron-core's IndexedDataset reads it:
    b"MMIDIDX\\x00\\x00", version <Q> = 1, dtype code <B>, sequence count <Q>,
    document count <Q>, sequence lengths int32[count], sequence byte offsets int64[count],
    document indices int64[documents] (sequence index where each document starts, plus the end).
Here a document is one sequence, or none when it has no tokens (as Megatron's builder
writes it: the empty document repeats its neighbour's entry in the document indices); a
pack (``mindspeed preprocess --pack``) is one document of several sequences, each a whole
document of the corpus or a piece of a long one.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from mindspeed_core import files
from mindspeed_core.errors import MindSpeedError

MAGIC = b"MMIDIDX\x00\x00"
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDatasetWriter:
    """Append documents, then ``finalize()``; files appear only when complete (temporary
    names renamed into place)."""

    def __init__(self, prefix: str, dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        self._tmp = self.temp_prefix = f"{prefix}.tmp-{os.getpid()}"
        self._bin = open(self._tmp + ".bin", "wb")
        self._lengths: list[int] = []
        self._documents: list[int] = [0]

    def add_document(self, tokens) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        if arr.size:
            self._bin.write(arr.tobytes())
            self._lengths.append(int(arr.size))
        self._documents.append(len(self._lengths))

    def add_pack(self, parts) -> None:
        """One document made of several sequences (their order kept)."""
        for part in parts:
            arr = np.asarray(part, dtype=self.dtype)
            if arr.size:
                self._bin.write(arr.tobytes())
                self._lengths.append(int(arr.size))
        self._documents.append(len(self._lengths))

    def abort(self) -> None:
        """Drop what was written (the temporary files); the final names are untouched."""
        self._bin.close()
        for ext in (".bin", ".idx"):
            if os.path.exists(self._tmp + ext):
                os.remove(self._tmp + ext)

    def finalize(self, publish: bool = True) -> list:
        """Complete the files; ``publish``: move them onto the prefix's names now. Otherwise they
        stay at ``temp_prefix`` (readable there) and the (temporary, final) renames are
        returned, to be published with others as one step (files.publish_together)."""
        self._bin.close()
        lengths = np.asarray(self._lengths, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        documents = np.asarray(self._documents, np.int64)
        with open(self._tmp + ".idx", "wb") as fh:
            fh.write(MAGIC)
            fh.write(struct.pack("<Q", 1))
            fh.write(struct.pack("<B", CODES[self.dtype]))
            fh.write(struct.pack("<Q", len(lengths)))
            fh.write(struct.pack("<Q", len(documents)))
            fh.write(lengths.tobytes())
            fh.write(pointers.tobytes())
            fh.write(documents.tobytes())
        renames = [(self._tmp + ext, self.prefix + ext) for ext in (".bin", ".idx")]
        if publish:
            for temporary, final in renames:
                os.replace(temporary, final)
            return []
        return renames


class IndexedDataset:
    """Read-only view of a .bin/.idx pair (memory-mapped)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        # a preprocessing run killed while it published its outputs is completed first, so the
        # keys of one output are all of one run
        files.finish_publishing(os.path.dirname(os.path.abspath(prefix)))
        idx, binf = prefix + ".idx", prefix + ".bin"
        for path in (idx, binf):
            if not os.path.isfile(path):
                raise MindSpeedError(f"data file {path} does not exist (--data-path takes the prefix, without .bin/.idx)")
        try:
            with open(idx, "rb") as fh:
                if fh.read(9) != MAGIC:
                    raise MindSpeedError(f"{idx} is not a Megatron indexed dataset index (bad magic)")
                (version,) = struct.unpack("<Q", fh.read(8))
                (code,) = struct.unpack("<B", fh.read(1))
                (count,) = struct.unpack("<Q", fh.read(8))
                (doc_count,) = struct.unpack("<Q", fh.read(8))
                offset = fh.tell()
            if version != 1 or code not in DTYPE_CODES:
                raise MindSpeedError(f"{idx}: unsupported index version {version} or dtype code {code}")
            self.dtype = np.dtype(DTYPE_CODES[code])
            raw = np.memmap(idx, mode="r", dtype=np.uint8)
            self.lengths = np.frombuffer(raw, np.int32, count, offset)
            self.pointers = np.frombuffer(raw, np.int64, count, offset + 4 * count)
            self.document_indices = np.frombuffer(raw, np.int64, doc_count, offset + 12 * count)
        except (struct.error, ValueError) as exc:
            raise MindSpeedError(f"{idx} is truncated or corrupt ({exc})") from None
        size = os.path.getsize(binf)
        expected = int(self.lengths.sum()) * self.dtype.itemsize
        if size != expected:
            raise MindSpeedError(f"{binf} has {size} bytes but its index describes {expected}")
        self._bin = np.memmap(binf, mode="r", dtype=self.dtype) if size else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return np.asarray(self._bin[start : start + int(self.lengths[i])])

    def tokens(self, first: int = 0, last: int | None = None) -> np.ndarray:
        """The sequences [first, last) concatenated (documents already end with EOD)."""
        last = len(self) if last is None else last
        if first >= last:
            return np.zeros(0, self.dtype)
        start = int(self.pointers[first]) // self.dtype.itemsize
        end = start + int(self.lengths[first:last].sum())
        return np.asarray(self._bin[start:end])

    @property
    def document_count(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    def document(self, i: int) -> np.ndarray:
        """Document i's tokens (all its sequences: a whole pack)."""
        return self.tokens(int(self.document_indices[i]), int(self.document_indices[i + 1]))
