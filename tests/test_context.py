"""Context parallelism: attention across CP ranks equals single-device attention (outputs and
gradients of q, k, v), for every algorithm, C in {2, 4}, causal and packed documents, the ring
by point-to-point steps and by one all-gather; layout checks; and the load-balanced split."""

from __future__ import annotations

import dataclasses

import json
import pathlib

import numpy as np
import pytest

from launch import launch
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.parallel import context

HERE = pathlib.Path(__file__).parent


@pytest.mark.multiprocess
@pytest.mark.feature("ring-attention-cp", "ulysses-cp", "hybrid-cp", "collectives")
def test_context_parallel_attention_equals_single_device(framework, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, output = launch(framework, 4, str(HERE / "cp_worker.py"), [str(out_dir)], str(tmp_path / "logs"), timeout=600)
    assert code == 0, output[-6000:]
    results = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    assert len(results) == 4, output[-6000:]
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["failures"]]
    assert failures == [], "\n".join(failures)
    # 2 masks x (C=2: ring, Ulysses; C=4: ring, Ulysses, hybrid) x fused/composite, and the
    # ring's other form (all-gather or shift) for ring and hybrid
    assert all(len(res["checks"]) == 2 * (5 * 2 + 3) for res in results)
    assert any("ring by all-gather" in c for c in results[0]["checks"])
    assert any("ring by shift" in c for c in results[0]["checks"])


def test_load_balanced_columns():
    # 2C chunks, rank r holds chunks r and 2C-1-r: every rank the same causal work
    cols = [context.local_columns(16, 4, r) for r in range(4)]
    assert [c.tolist() for c in cols[:2]] == [[0, 1, 14, 15], [2, 3, 12, 13]]
    assert sorted(np.concatenate(cols).tolist()) == list(range(16))
    work = [int(np.sum(c + 1)) for c in cols]  # keys each rank's queries see
    assert len(set(work)) == 1


CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=64, max_position_embeddings=64)


@pytest.mark.parametrize("kwargs, message", [
    (dict(cp=2, algo="ulysses_cp_algo", degree_in_cp=None, tp=4, seq_length=32, sequence_parallel=False),
     "must divide the query heads"),
    # 3 key/value heads over Ulysses 2: neither divides the other, so no copy pattern fits
    (dict(cp=2, algo="ulysses_cp_algo", degree_in_cp=None, tp=1, seq_length=32, sequence_parallel=False,
          cfg=dataclasses.replace(CFG, hidden_size=48, num_attention_heads=12, num_query_groups=3, kv_channels=4)),
     "key/value heads \\(3\\)"),
    (dict(cp=4, algo="hybrid_cp_algo", degree_in_cp=3, tp=1, seq_length=32, sequence_parallel=False),
     "--ulysses-degree-in-cp dividing"),
    (dict(cp=4, algo="hybrid_cp_algo", degree_in_cp=None, tp=1, seq_length=32, sequence_parallel=False),
     "--ulysses-degree-in-cp dividing"),
    (dict(cp=2, algo="megatron_cp_algo", degree_in_cp=None, tp=1, seq_length=30, sequence_parallel=False),
     "multiple of 4"),
    (dict(cp=2, algo="megatron_cp_algo", degree_in_cp=None, tp=2, seq_length=36, sequence_parallel=True),
     "multiple of 8"),
])
def test_bad_context_parallel_layouts_are_refused(kwargs, message):
    kwargs = dict(kwargs)
    cfg = kwargs.pop("cfg", CFG)
    with pytest.raises(MindSpeedError, match=message):
        context.check_layout(cfg, **kwargs)
    # 2 key/value heads over Ulysses 4 (or 1 per TP rank over 2): copied, not refused
    context.check_layout(CFG, cp=4, algo="ulysses_cp_algo", degree_in_cp=None, tp=1, seq_length=32,
                         sequence_parallel=False)
    context.check_layout(CFG, cp=2, algo="ulysses_cp_algo", degree_in_cp=None, tp=2, seq_length=32,
                         sequence_parallel=False)
