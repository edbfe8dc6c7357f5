"""Megatron's torch_dist format without torch (compat/torch_dist.py): names, a round trip of
pieces written by several "ranks", what torch itself makes of the files, and damage. The
files megatron-core writes and reads are checked in test_parallel (its GPTModel, at TP2)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mindspeed_core.compat import torch_dist
from mindspeed_core.errors import CheckpointError

pytestmark = pytest.mark.framework_free
FEATURE = pytest.mark.feature("ckpt-format-torch-dist")  # on the tests that write or read the files


@pytest.mark.parametrize("stacked", [True, False])
def test_names_go_both_ways(stacked):
    for name in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight",
                 "decoder.layers.3.input_layernorm.weight", "decoder.layers.3.pre_mlp_layernorm.bias",
                 "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.1.mlp.experts.weight1",
                 "decoder.layers.1.mlp.experts.weight2", "decoder.layers.2.mlp.router.weight"):
        key = torch_dist.key_of(name, stacked)
        assert torch_dist.name_of(key.key, key.layer) == name
    k = torch_dist.key_of("decoder.layers.3.input_layernorm.weight", stacked)
    assert k.key.endswith("self_attention.linear_qkv.layer_norm_weight")  # Transformer Engine's name
    experts = torch_dist.key_of("decoder.layers.1.mlp.experts.weight1", stacked)  # ours [E, H, 2F]
    assert experts.swapped and experts.whole((4, 8, 32), 6) == ((6, 4, 32, 8) if stacked else (4, 32, 8))
    # a box of experts 2..3, the second half of their 2F columns
    assert experts.chunk((2, 0, 16), (2, 8, 16)) == (((1, 2, 16, 0), (1, 2, 16, 8)) if stacked
                                                     else ((2, 16, 0), (2, 16, 8)))


def _save(folder, chunks_per_rank, common):
    os.makedirs(folder)
    parts = []
    for rank, (chunks, objects) in enumerate(chunks_per_rank):
        part, _ = torch_dist.write_rank_file(str(folder), rank, chunks, objects)
        parts.append(part)
    torch_dist.write_metadata(str(folder), parts, common)


@pytest.fixture
def saved(tmp_path):
    """A two-layer model with stacked layers and experts, its tensors cut over two "ranks"
    (rows of qkv, experts 0-1 and 2-3), fp32 and bf16."""
    rng = np.random.default_rng(0)
    whole = {"embedding.word_embeddings.weight": rng.standard_normal((10, 8), np.float32),
             **{f"decoder.layers.{i}.self_attention.linear_qkv.weight": rng.standard_normal((12, 8), np.float32)
                for i in range(2)},
             **{f"decoder.layers.{i}.mlp.experts.weight1": rng.standard_normal((4, 8, 6), np.float32)
                for i in range(2)}}
    ranks = [([], []), ([], [])]
    for name, value in whole.items():
        if name.startswith("embedding"):
            ranks[0][0].append(torch_dist.model_chunks(name, value.shape, (0, 0), value, 2, True, "float32"))
            continue
        half = value.shape[0] // 2
        for r in range(2):
            off = (r * half,) + (0,) * (value.ndim - 1)
            dtype = "bfloat16" if "experts" in name else "float32"
            ranks[r][0].append(torch_dist.model_chunks(name, value.shape, off, value[r * half:(r + 1) * half], 2,
                                                       True, dtype))
            ranks[r][1].extend(torch_dist.extra_states(name, 2, True, range(r * half, (r + 1) * half), 4))
    args = __import__("argparse").Namespace(num_layers=2)
    _save(tmp_path / "iter", ranks, {"args": args, "iteration": 5, "checkpoint_version": 3.0})
    return tmp_path / "iter", whole


@FEATURE
def test_pieces_of_two_ranks_read_back_whole(saved):
    folder, whole = saved
    assert torch_dist.is_torch_dist(str(folder))
    common, state = torch_dist.load(str(folder))
    assert common["iteration"] == 5 and common["args"].num_layers == 2
    assert sorted(state) == sorted(whole)
    for name, value in whole.items():
        if "experts" in name:  # written as bf16: the values rounded to it
            assert np.abs(state[name] - value).max() <= np.abs(value).max() * 2 ** -8, name
        else:
            assert np.array_equal(state[name], value), name


@FEATURE
def test_torch_reads_the_metadata_and_the_chunks(saved):
    """torch's own classes come out of our pickle: a Metadata whose chunks and storage entries
    torch.load reads as tensors (torch_dist's reader of megatron-core is checked in test_parallel)."""
    torch = pytest.importorskip("torch")
    import io
    import pickle

    folder, whole = saved
    with open(folder / ".metadata", "rb") as fh:
        meta = pickle.load(fh)
    assert type(meta).__name__ == "Metadata"
    qkv = meta.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"]
    assert tuple(qkv.size) == (2, 12, 8) and qkv.properties.dtype == torch.float32
    assert sorted(tuple(c.offsets) for c in qkv.chunks) == [(0, 0, 0), (0, 6, 0), (1, 0, 0), (1, 6, 0)]
    for index, info in meta.storage_data.items():
        if index.fqn == "decoder.layers.self_attention.linear_qkv.weight" and tuple(index.offset) == (1, 6, 0):
            with open(folder / info.relative_path, "rb") as fh:
                fh.seek(info.offset)
                tensor = torch.load(io.BytesIO(fh.read(info.length)))
            assert np.array_equal(tensor.numpy()[0], whole["decoder.layers.1.self_attention.linear_qkv.weight"][6:])
    objects = [k for k, v in meta.state_dict_metadata.items() if type(v).__name__ == "BytesStorageMetadata"]
    assert "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.3_2.4" in objects
    assert "decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2" in objects


@FEATURE
def test_damage_is_one_line(saved, tmp_path):
    folder, _ = saved
    os.truncate(folder / "__1_0.distcp", 100)
    with pytest.raises(CheckpointError, match="__1_0.distcp"):
        torch_dist.load(str(folder))
    os.remove(folder / "__1_0.distcp")
    with pytest.raises(CheckpointError, match="cannot read .*__1_0.distcp"):
        torch_dist.load(str(folder))
    # a pickle that would run code: refused by name, nothing runs
    (folder / ".metadata").write_bytes(b"cos\nsystem\n(S'touch " + str(tmp_path / "ran").encode() + b"'\ntR.")
    with pytest.raises(CheckpointError, match="refusing to load it: its pickle calls os.system"):
        torch_dist.load(str(folder))
    assert not (tmp_path / "ran").exists()
    (folder / ".metadata").write_bytes(b"\x80\x02}q\x00.")  # a dict, not torch's Metadata
    with pytest.raises(CheckpointError, match="is not a Metadata"):
        torch_dist.load(str(folder))


@FEATURE
@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / ".metadata").unlink(), "has no .metadata: megatron-core cannot load it"),
    (lambda f: (f / "common.pt").unlink(), "has no common.pt: megatron-core cannot load it"),
    (lambda f: (f / "metadata.json").unlink(), "has no metadata.json: megatron-core cannot load it"),
    (lambda f: (f / "metadata.json").write_bytes(b"\xff{"), "metadata.json is corrupt \\(not JSON\\)"),
    (lambda f: (f / "metadata.json").write_text('{"sharded_backend": "zarr"}'), "sharded backend 'zarr'"),
    (lambda f: (f / "metadata.json").write_text("[1]"), "sharded backend None"),
], ids=["no-metadata", "no-common", "no-config", "config-not-json", "zarr", "config-list"])
def test_megatrons_own_files_are_checked_and_a_missing_one_named(saved, damage, message):
    """What megatron-core reads before any tensor (issue 59 items 6 and 12): a folder missing one
    of them is still seen as torch_dist, and the file is named (not a missing meta.json)."""
    folder, _ = saved
    damage(folder)
    assert torch_dist.is_torch_dist(str(folder))
    with pytest.raises(CheckpointError, match=message):
        torch_dist.load(str(folder))
