"""TensorBoard event files, written here: no TensorFlow, TensorBoard or torch at run time, so
a MindSpore-only install writes them too.

An event file is a sequence of TFRecords (length, masked CRC-32C of the length, the bytes, masked
CRC-32C of the bytes), each holding one serialised ``tensorflow.Event`` protocol buffer; the
first says the file's version, each later one carries scalar summaries (``Summary.Value`` with
a tag and a ``simple_value``) at a step. The few protobuf fields needed are encoded by hand
below; tests read the files back with TensorBoard's own reader.
"""

from __future__ import annotations

import os
import socket
import struct
import time


def _crc32c_table() -> list:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli, reflected
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's mask: a CRC of data that itself holds CRCs stays well distributed."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1  # negative int64 as protobuf writes it: two's complement, 10 bytes
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _length_delimited(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def event(wall_time: float, step: int = 0, *, file_version: str | None = None, scalars: dict | None = None) -> bytes:
    """A serialised Event: wall_time (1, double), step (2, int64), file_version (3) or a
    summary (5) of Value{tag (1), simple_value (2, float)} per scalar."""
    out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(int(step)))
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    if scalars:
        summary = b"".join(_length_delimited(1, _length_delimited(1, tag.encode()) +
                                             _field(2, 5, struct.pack("<f", float(value))))
                           for tag, value in scalars.items())
        out += _length_delimited(5, summary)
    return out


def record(data: bytes) -> bytes:
    """One TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


class EventWriter:
    """Scalars into ``logdir/events.out.tfevents.<time>.<host>.<pid>`` (TensorBoard's naming;
    each run a new file, so a resumed run adds to the same folder). Records are buffered and
    written every ``queue_size`` of them (Megatron's --tensorboard-queue-size), at flush() and
    at close()."""

    def __init__(self, logdir: str, queue_size: int = 1000):
        os.makedirs(logdir, exist_ok=True)
        now = time.time()
        self.path = os.path.join(logdir, f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}")
        self.queue_size = queue_size
        self._pending: list = []
        self._file = open(self.path, "ab")
        self._file.write(record(event(now, file_version="brain.Event:2")))
        self._file.flush()

    def scalars(self, step: int, values: dict) -> None:
        values = {tag: v for tag, v in values.items() if v is not None}
        if values:
            self._pending.append(record(event(time.time(), step, scalars=values)))
            if len(self._pending) >= self.queue_size:
                self.flush()

    def flush(self) -> None:
        if self._file is not None and self._pending:
            self._file.write(b"".join(self._pending))
            self._file.flush()
            self._pending = []

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None
