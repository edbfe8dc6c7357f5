"""Sharded checkpoints without processes (training/sharded_checkpoint.py, the boxes of
parallel/sharding.py): where each rank's tensor lies in the whole one, every element written
once whatever the layout, any other layout reading back exactly its slices, and one clear
line for each kind of damage. The multi-rank saves and resumes: test_pipeline, test_parallel."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from mindspeed_core.errors import CheckpointError, MindSpeedError
from mindspeed_core.parallel.plan import ParamPlan
from mindspeed_core.parallel.sharding import flat_boxes, placement, region, shard
from mindspeed_core.parallel.state import ParallelState
from mindspeed_core.training import sharded_checkpoint as sc

pytestmark = pytest.mark.framework_free


def test_flat_slices_are_few_boxes_in_row_major_order():
    rng = random.Random(0)
    for _ in range(2000):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 4)))
        n = int(np.prod(shape))
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        boxes = flat_boxes(shape, lo, hi)
        whole = np.arange(n).reshape(shape)
        got = np.concatenate([whole[region(b)].reshape(-1) for b in boxes] + [np.zeros(0, int)])
        assert np.array_equal(got, np.arange(lo, hi)), (shape, lo, hi, boxes)
        assert len(boxes) <= max(2 * len(shape) - 1, 0), (shape, lo, hi, boxes)


SPECS = [(("split", 0), (8, 6)), (("split", 1), (4, 8)), (("swiglu", 0), (8, 3)), (("swiglu", 1), (3, 8)),
         (("qkv", 2, 2, 3), (24, 5)), (("qkv", 1, 4, 2), (12, 3)), (("qkv", 2, 4, 2), (24, 3))]


@pytest.mark.parametrize("spec,shape", SPECS, ids=[f"{s[0]}-{i}" for i, (s, _) in enumerate(SPECS)])
def test_each_ranks_pieces_are_its_cut_of_the_whole_tensor_and_cover_it_once(spec, shape):
    """placement() against shard(), the cut the model really makes, at TP 1, 2 and 4: every
    piece holds the whole tensor's values at its offset, and the primary pieces of all ranks
    tile it exactly once (key/value rows copied to several ranks: written by the first)."""
    full = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    for n in (1, 2, 4):
        if spec[0] == "qkv" and (n % spec[1] or spec[2] % (n // spec[1])):
            continue
        count = np.zeros(shape, int)
        for r in range(n):
            local = shard(full, spec, n, r)
            whole, pieces = placement(spec, local.shape, n, r)
            assert whole == shape
            for lo, go, size, primary in pieces:
                assert np.array_equal(local[region((lo, size))], full[region((go, size))])
                count[region((go, size))] += primary
        assert (count == 1).all(), (spec, n)


def ranks(tp=1, cp=1, dp=1, pp=1, ep=1):
    world = tp * cp * dp * pp
    return [ParallelState(world, r, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep) for r in range(world)]


# a small model's tensors: (name, whole shape, plan); the experts' dim 0 is cut over EP
TENSORS = [("qkv", (12, 6), ParamPlan("qkv", ("qkv", 1, 4, 2))), ("fc1", (8, 6), ParamPlan("fc1", ("swiglu", 0))),
           ("fc2", (6, 4), ParamPlan("fc2", ("split", 1))), ("norm", (6,), ParamPlan("norm")),
           ("experts", (4, 6, 8), ParamPlan("experts", ("split", 2), expert=True))]


def local_of(full, entry, ps):
    if entry.expert and ps.ep > 1:
        full = np.split(full, ps.ep, axis=0)[ps.local_rank("ep")]
    return shard(full, entry.shard, ps.tp, ps.local_rank("tp")) if entry.shard and ps.tp > 1 else full


def flat_slice(size, ps):
    """A distributed optimizer's slice of one tensor's flat elements for this rank (padded
    split over DP x CP, as the real one splits its buckets)."""
    n, i = ps.size("dp_cp"), ps.local_rank("dp_cp")
    per = -(-size // n)
    return min(i * per, size), min((i + 1) * per, size)


def save(folder, layout, values, distributed):
    """Every rank of ``layout`` writes the pieces it owns: parameters whole (the first replica
    writes), optimizer state as each DP rank's flat slice when ``distributed``."""
    os.makedirs(folder, exist_ok=True)
    parts, digests = [], {}
    for ps in layout:
        model, optimizer = [], []
        for name, _, entry in TENSORS:
            local = local_of(values[name], entry, ps)
            model.append((sc.held(name, local.shape, entry, ps), local, "float32"))
            state = local_of(values[f"exp_avg.{name}"], entry, ps)
            if distributed and not entry.expert:
                lo, hi = flat_slice(state.size, ps)
                optimizer.append((sc.held(f"exp_avg.{name}", state.shape, entry, ps, (lo, hi), True),
                                  state.reshape(-1)[lo:hi], "float32"))
            else:
                optimizer.append((sc.held(f"exp_avg.{name}", state.shape, entry, ps), state, "float32"))
        part, fname, digest = sc.write_rank_file(str(folder), ps.rank, {"model": model, "optimizer": optimizer})
        parts.append(part)
        if fname:
            digests[fname] = digest
    meta = {"format": sc.FORMAT, "steps": 3, "index": sc.merge_indices(parts), "sha256": digests}
    (folder / "meta.json").write_text(json.dumps(meta))
    return meta


def values_of():
    rng = np.random.default_rng(1)
    out = {}
    for name, shape, _ in TENSORS:
        out[name] = rng.standard_normal(shape).astype(np.float32)
        out[f"exp_avg.{name}"] = rng.standard_normal(shape).astype(np.float32)
    return out


LAYOUTS = {"tp2-dp2": dict(tp=2, dp=2), "tp2-cp2-ep2": dict(tp=2, cp=2, dp=2, ep=2), "dp4-ep4": dict(dp=4, ep=4),
           "tp4": dict(tp=4), "one": {}}


@pytest.mark.parametrize("saved", sorted(LAYOUTS))
@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distopt"])
def test_any_layout_reads_back_exactly_its_slices(tmp_path, saved, distributed):
    values = values_of()
    meta = save(tmp_path / "ckpt", ranks(**LAYOUTS[saved]), values, distributed)
    everything = sc.Reader(str(tmp_path / "ckpt"), meta)
    names = [n for n, _, _ in TENSORS]
    for section, names in (("model", names), ("optimizer", [f"exp_avg.{n}" for n in names])):
        got = everything.whole(section)
        assert sorted(got) == sorted(names) and all(np.array_equal(got[n], values[n]) for n in names)
    for target in sorted(LAYOUTS):
        for ps in ranks(**LAYOUTS[target]):
            reader, meeting = sc.Reader(str(tmp_path / "ckpt"), meta), 0
            for name, shape, entry in TENSORS:
                local = local_of(values[name], entry, ps)
                assert np.array_equal(reader.read("model", sc.held(name, local.shape, entry, ps)), local)
                lo, hi = flat_slice(local.size, ps)
                got = reader.read("optimizer", sc.held(f"exp_avg.{name}", local.shape, entry, ps, (lo, hi)))
                assert np.array_equal(got, local_of(values[f"exp_avg.{name}"], entry, ps).reshape(-1)[lo:hi])
                # the oracle, from the real cut: which whole-tensor elements this rank needs
                index = local_of(np.arange(int(np.prod(shape))).reshape(shape), entry, ps)
                for section, key, wanted in (("model", name, index.reshape(-1)),
                                             ("optimizer", f"exp_avg.{name}", index.reshape(-1)[lo:hi])):
                    mask = np.zeros(shape, bool)
                    mask.reshape(-1)[wanted] = True
                    meeting += sum(4 * int(np.prod(p[3])) for p in meta["index"][section][key]["pieces"]
                                   if mask[region((tuple(p[2]), tuple(p[3])))].any())
            # exactly the pieces its slices meet are read, each once (headers apart)
            headers = sum(_header_bytes(tmp_path / "ckpt", f) for f in reader._headers)
            assert reader.bytes_read - headers == meeting, (saved, target, ps.rank)


def _header_bytes(folder, fname):
    with open(folder / fname, "rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")


def test_each_kind_of_damage_is_one_line(tmp_path):
    values = values_of()
    meta = save(tmp_path / "ckpt", ranks(tp=2, dp=2), values, True)
    folder = tmp_path / "ckpt"
    ps = ranks()[0]
    entry = TENSORS[0][2]

    def read(meta=meta):
        return sc.Reader(str(folder), meta).read("model", sc.held("qkv", (12, 6), entry, ps))

    path = folder / meta["index"]["model"]["qkv"]["pieces"][0][0]
    good = path.read_bytes()
    damaged = bytearray(good)
    damaged[-5] ^= 0x10  # inside the last entry: the pieces of optimizer tensors come last
    path.write_bytes(bytes(damaged))
    reader = sc.Reader(str(folder), meta)
    reader.read("model", sc.held("qkv", (12, 6), entry, ps))  # an undamaged piece of the same file reads
    with pytest.raises(CheckpointError, match=f"{path.name} is corrupt: tensor 'optimizer/"):
        for name, _, e in TENSORS:
            reader.read("optimizer", sc.held(f"exp_avg.{name}", values[name].shape, e, ps))
    with pytest.raises(CheckpointError, match=f"{path.name} is corrupt: its SHA-256"):
        sc.Reader(str(folder), meta).whole("optimizer")
    path.write_bytes(good[:100])
    with pytest.raises(CheckpointError, match="truncated"):
        read()
    path.unlink()
    with pytest.raises(CheckpointError, match=f"cannot read tensor file .*{path.name}"):
        read()
    path.write_bytes(good)
    lacking = json.loads(json.dumps(meta))
    lacking["index"]["model"]["qkv"]["pieces"].pop()
    with pytest.raises(CheckpointError, match="leaves a hole in model tensor qkv"):
        read(lacking)
    wrong = json.loads(json.dumps(meta))
    wrong["index"]["model"]["qkv"]["pieces"][0][0] = "../elsewhere"
    with pytest.raises(CheckpointError, match="malformed index entry for qkv"):
        read(wrong)
    with pytest.raises(CheckpointError, match="holds no model tensor fc9"):
        sc.Reader(str(folder), meta).read("model", sc.held("fc9", (3,), ParamPlan("fc9"), ps))
    with pytest.raises(CheckpointError, match="holds no valid index"):
        sc.Reader(str(folder), {"steps": 1})


@pytest.mark.parametrize("layout", ["one", "tp2-dp2"])
def test_pieces_must_tile_each_tensor_before_any_is_read(tmp_path, layout):
    """A piece moved (a hole and an overlap), moved off the tensor's end, or shrunk (a hole)
    is refused when the index is read, whatever layout reads it and whichever slice it wants;
    the message names the problem (issue 59 items 2 and 12)."""
    values = values_of()
    meta = save(tmp_path / "ckpt", ranks(**LAYOUTS[layout]), values, False)
    folder = str(tmp_path / "ckpt")

    def edited(change):
        copy = json.loads(json.dumps(meta))
        change(copy["index"]["model"]["fc1"]["pieces"])
        return copy

    def moved(pieces, to):
        pieces[-1][2][0] = to

    def shrunk(pieces):
        pieces[-1][3][0] -= 1

    single = len(meta["index"]["model"]["fc1"]["pieces"]) == 1
    cases = [(lambda p: moved(p, 1), "outside it" if single else "overlapping pieces"),
             (lambda p: moved(p, 8), "outside it"), (shrunk, "leaves a hole in model tensor fc1")]
    if not single:
        cases.append((lambda p: p.pop(), "leaves a hole in model tensor fc1"))
    for change, message in cases:
        damaged = edited(change)
        with pytest.raises(CheckpointError, match=message) as info:
            sc.Reader(folder, damaged)
        assert "\n" not in str(info.value)
    # a hole in rows nobody at TP1 would notice missing: refused all the same
    holed = edited(lambda p: p.__setitem__(slice(None), [[*q[:2], q[2], [q[3][0] - 2, *q[3][1:]], q[4]] for q in p]))
    with pytest.raises(CheckpointError, match="leaves a hole"):
        sc.Reader(folder, holed).read("model", sc.held("fc1", (8, 6), TENSORS[1][2], ranks()[0]))


def test_a_pieces_shape_edited_in_the_index_is_one_line_naming_the_tensor_and_the_file(tmp_path):
    """fc2's two TP pieces ([6, 2] at columns 0 and 2) edited to [6, 1] and [6, 3]: they still
    tile the tensor, but no longer match what the files hold (issue 59 item 8: a reshape
    ValueError before)."""
    meta = save(tmp_path / "ckpt", ranks(tp=2), values_of(), False)
    folder = str(tmp_path / "ckpt")
    edited = json.loads(json.dumps(meta))
    first, second = edited["index"]["model"]["fc2"]["pieces"]
    first[3], second[2], second[3] = [6, 1], [0, 1], [6, 3]
    message = r"rank_0000\d.safetensors holds 'model/fc2/0' of shape \[6, 2\], but meta.json's index gives this piece " \
              r"of model tensor fc2 the shape \[6, 1\]"
    with pytest.raises(CheckpointError, match=message):
        sc.Reader(folder, edited).whole("model")
    with pytest.raises(CheckpointError, match="gives this piece of model tensor fc2 the shape"):
        sc.Reader(folder, edited).read("model", sc.held("fc2", (6, 4), TENSORS[2][2], ranks()[0]))


def test_pieces_that_do_not_add_up_are_never_saved():
    """Two ranks both writing a replicated tensor (or none writing it) is a bug in who writes
    what: merge_indices refuses it before any meta.json names the files."""
    ps = ranks(dp=2)
    entry = ParamPlan("norm")
    twice = [{"model": {"norm": {"shape": [4], "dtype": "float32", "pieces": [[f"rank_0000{r}.safetensors", "k", [0],
                                                                               [4], "0"]]}}} for r in range(2)]
    with pytest.raises(MindSpeedError, match="wrote 8 elements of model tensor norm"):
        sc.merge_indices(twice)
    assert sc.held("norm", (4,), entry, ps[1]).writes is False and sc.held("norm", (4,), entry, ps[0]).writes


def test_writing_a_ranks_file_holds_about_one_piece_at_a_time(tmp_path):
    """The writer streams each piece from the rank's own arrays: the memory it allocates on top
    stays near the largest piece, not the rank's state (32 tensors of 1 MiB here; measured with
    tracemalloc, which numpy reports its buffers to)."""
    import tracemalloc

    ps = ranks()[0]
    rng = np.random.default_rng(0)
    items = [(sc.held(f"w{i}", (512, 512), ParamPlan(f"w{i}"), ps), rng.standard_normal((512, 512), np.float32),
              "float32") for i in range(32)]
    piece = 512 * 512 * 4
    tracemalloc.start()
    try:
        sc.write_rank_file(str(tmp_path), 0, {"model": items})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * piece, (peak, piece, 32 * piece)
