"""Framework-neutral tensor files: safetensors + JSON metadata."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from mindspeed_core import io, ops
from mindspeed_core.errors import CheckpointError

pytestmark = pytest.mark.feature("safetensors-io")

ARRAYS = {
    "layers.0.weight": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    "layers.0.bias": np.array([1.5, -2.25], np.float64),
    "tokens": np.array([[1, 2], [3, 4]], np.int64),
    "mask": np.array([True, False, True]),
    "half": np.array([0.5, 1.25], np.float16),
}
BF16 = np.array([1.0, -2.5, 3.140625, 1e-3], np.float32)  # bf16-representable except 1e-3


def _tensors():
    out = {k: ops.tensor(v, dtype=str(v.dtype)) for k, v in ARRAYS.items()}
    out["bf16"] = ops.tensor(BF16, dtype="bfloat16")
    return out


def test_round_trip_keeps_values_dtypes_and_metadata(tmp_path):
    path = str(tmp_path / "model.safetensors")
    meta = {"iteration": 7, "framework": "any", "nested": {"tp": 2}}
    io.save(path, _tensors(), meta)
    loaded, got_meta = io.load(path)
    assert got_meta == meta
    for name, value in ARRAYS.items():
        assert ops.dtype_of(loaded[name]) == str(value.dtype)
        np.testing.assert_array_equal(ops.to_numpy(loaded[name]), value)
    assert ops.dtype_of(loaded["bf16"]) == "bfloat16"
    np.testing.assert_array_equal(ops.to_numpy(loaded["bf16"]), ops.to_numpy(_tensors()["bf16"]))


def test_files_are_readable_by_huggingface_safetensors(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path = str(tmp_path / "m.safetensors")
    io.save(path, {k: v for k, v in _tensors().items() if k != "bf16"}, {"a": 1})
    loaded = safetensors_numpy.load_file(path)
    for name, value in ARRAYS.items():
        np.testing.assert_array_equal(loaded[name], value)
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    assert json.loads(header["__metadata__"]["mindspeed"]) == {"a": 1}


def test_reads_files_written_by_huggingface_safetensors(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path = str(tmp_path / "hf.safetensors")
    safetensors_numpy.save_file({"w": ARRAYS["layers.0.weight"]}, path)
    loaded, meta = io.load(path)
    assert meta is None
    np.testing.assert_array_equal(ops.to_numpy(loaded["w"]), ARRAYS["layers.0.weight"])


def test_corrupt_and_truncated_files_are_clear_errors(tmp_path):
    path = str(tmp_path / "ok.safetensors")
    io.save(path, _tensors())
    data = open(path, "rb").read()
    cases = {"truncated": data[:-5], "tiny": data[:4], "bad-header": data[:8] + b"{" * (len(data) - 8),
             "huge-header-length": struct.pack("<Q", 10 ** 12) + data[8:]}
    for name, blob in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(blob)
        with pytest.raises(CheckpointError):
            io.load(str(bad))
    with pytest.raises(CheckpointError, match="cannot read"):
        io.load(str(tmp_path / "missing.safetensors"))


def test_interrupted_save_keeps_the_previous_file(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.safetensors")
    io.save(path, {"w": ops.tensor(np.ones(3, np.float32))}, {"step": 1})

    class Boom(Exception):
        pass

    def fail(*args, **kwargs):
        raise Boom()

    monkeypatch.setattr(os, "fsync", fail)  # dies after writing the temporary file
    with pytest.raises(Boom):
        io.save(path, {"w": ops.tensor(np.zeros(3, np.float32))}, {"step": 2})
    monkeypatch.undo()
    loaded, meta = io.load(path)
    assert meta == {"step": 1}
    np.testing.assert_array_equal(ops.to_numpy(loaded["w"]), 1)
