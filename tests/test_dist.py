"""Collectives in real multi-process runs (torch: gloo; MindSpore: mccl; the ranks started with
the environment torchrun / msrun give them, tests/launch.py), and the single-process
semantics with no launcher."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from launch import launch
from mindspeed_core import dist, ops

HERE = pathlib.Path(__file__).resolve().parent


@pytest.mark.multiprocess
@pytest.mark.feature("collectives")
# two ranks on the lowest torch too (.ci/run); four make the same calls on more ranks
@pytest.mark.parametrize("nproc", [pytest.param(2, marks=pytest.mark.every_torch), 4])
def test_collectives_on_several_ranks(framework, nproc, tmp_path):
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    code, output = launch(framework, nproc, str(HERE / "dist_worker.py"), [str(out_dir)], str(tmp_path / "logs"))
    results = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    failures = [f"rank {r['rank']}: {f}" for r in results for f in r["failures"]]
    assert failures == [], "\n".join(failures)
    assert code == 0, output[-6000:]
    assert sorted(r["rank"] for r in results) == list(range(nproc)), output[-6000:]
    assert all(r["world"] == nproc and r["checks"] >= 90 for r in results)
    kinds = results[0]["implementations"]
    assert set(kinds) == {"all_reduce", "all_reduce_async", "all_gather", "all_gather_async", "reduce_scatter",
                          "all_to_all", "shift", "shift_async", "broadcast", "send", "recv", "barrier"}
    if framework == "mindspore":
        assert kinds["all_reduce"] == "native" and kinds["all_to_all"] == "emulated"


def test_alone_every_collective_is_the_identity():
    assert not dist.is_initialized()
    dist.init()  # no launcher: stays a single process
    assert dist.launched_world_size() == 1 and dist.world_size() == 1 and dist.rank() == 0
    x = ops.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    group = dist.new_group([0])
    assert dist.world_size(group) == 1 and dist.rank(group) == 0
    for out in (dist.all_reduce(x), dist.all_reduce(x, "max", group), dist.all_gather(x, dim=1),
                dist.reduce_scatter(x), dist.all_to_all(x), dist.broadcast(x, 0), dist.shift(x, 1, group),
                dist.shift_async(x, 1, group).wait(),
                dist.all_reduce_async(x, group).wait(), dist.all_gather_async(x, group).wait()):
        np.testing.assert_array_equal(ops.to_numpy(out), ops.to_numpy(x))
    dist.barrier()
    dist.shutdown()
    assert set(dist.implementations()) >= {"all_reduce", "send", "recv"}


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="not supported"):
        dist.all_reduce(ops.zeros((2,)), op="product")
    with pytest.raises(ValueError, match="not a member"):
        dist.all_gather(ops.zeros((2,)), group=dist.new_group([3]))


# The front end checks a collective's arguments once for every backend (mindspeed_core.frontend);
# each case is a caller's mistake that would otherwise hang a job or fail deep in a framework.
@pytest.mark.parametrize("call, message", [
    (lambda x, g: dist.reduce_scatter(x, op="mean"), "reduce_scatter op 'mean' is not supported"),
    (lambda x, g: dist.all_to_all(x, input_splits=[2]), "also needs output_splits"),
    (lambda x, g: dist.all_to_all(x, output_splits=[2]), "also needs input_splits"),
    (lambda x, g: dist.all_to_all(x, input_splits=[1, 1], output_splits=[1, 1]), "one entry per rank"),
    (lambda x, g: dist.all_to_all(x, input_splits=[3], output_splits=[3]), "do not add up to the 2 rows"),
    (lambda x, g: dist.broadcast(x, 0, g), "broadcast: this process is not a member"),
    (lambda x, g: dist.shift(x, 1, g), "shift: this process is not a member"),
    (lambda x, g: dist.reduce_scatter(x, group=g), "reduce_scatter: this process is not a member"),
    (lambda x, g: ops.zeros((2,), dtype="float8"), "unknown dtype 'float8'; facade dtypes are float32"),
])
def test_the_front_end_checks_arguments_for_every_backend(call, message):
    with pytest.raises(ValueError, match=message):
        call(ops.zeros((2, 3)), dist.new_group([3]))
