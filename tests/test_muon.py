"""Muon (training/muon.py) against torch.optim.Muon and megatron-core's split of fused q/k/v
weights, on the selected framework (the references run in torch, which every suite installs)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from mindspeed_core import nn, ops
from mindspeed_core.training.muon import Muon, logical_rows, uses_muon
from mindspeed_core.training.optimizer import no_weight_decay
from test_training import corpus  # noqa: F401  (a fixture)

# GQA: 4 query heads in 2 groups of width 8 over hidden 32; fused q/k/v rows = 2 x (2 + 1 + 1) x 8
CFG = types.SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=8, attention_output_gate=False)
SHAPES = {
    "decoder.layers.0.self_attention.linear_qkv.weight": (64, 32),
    "decoder.layers.0.self_attention.linear_qkv.bias": (64,),
    "decoder.layers.0.self_attention.linear_proj.weight": (32, 32),
    "decoder.layers.0.mlp.linear_fc1.weight": (96, 32),  # a gated MLP's gate and up: tall, one matrix
    "decoder.layers.0.mlp.linear_fc2.weight": (32, 48),  # wide
    "decoder.layers.0.mlp.router.weight": (4, 32),  # megatron-core updates the router with Muon too
    "decoder.layers.1.mlp.experts.weight1": (4, 32, 24),  # [E, in, out]: four matrices
    "decoder.layers.1.mlp.experts.bias1": (4, 24),  # GPT-OSS's expert biases: AdamW's, undecayed
    "decoder.layers.0.input_layernorm.weight": (32,),
    "embedding.word_embeddings.weight": (50, 32),
    "output_layer.weight": (50, 32),
}
STEPS = 20


def test_which_parameters_muon_updates():
    muon = {name for name, shape in SHAPES.items() if uses_muon(name, np.zeros(shape))}
    assert muon == {"decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_proj.weight",
                    "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
                    "decoder.layers.0.mlp.router.weight", "decoder.layers.1.mlp.experts.weight1"}


def test_the_qkv_split_is_megatron_cores():
    """megatron-core's own split (TensorParallelMuon.orthogonalize, its emerging-optimizers
    orthogonalisation replaced by a recorder) cuts a fused q/k/v gradient into the row groups
    logical_rows gives."""
    torch = pytest.importorskip("torch")
    from megatron.core.optimizer.muon import TensorParallelMuon

    rows, hidden = SHAPES["decoder.layers.0.self_attention.linear_qkv.weight"]
    grad = torch.arange(rows * hidden, dtype=torch.float32).reshape(rows, hidden)
    seen = []

    def record(g, tp_group, partition_dim):
        seen.append(g.clone())
        return g

    per_group = CFG.num_attention_heads // CFG.num_query_groups
    stub = types.SimpleNamespace(pg_collection=None, mode="blockwise", split_qkv=True, is_qkv_fn=lambda p: True,
                                 qkv_split_shapes=[per_group * CFG.kv_channels, CFG.kv_channels, CFG.kv_channels],
                                 scaled_orthogonalize_fn=record)
    # the whole weight, and (--muon-tp-mode blockwise) a TP2 rank's shard: its own query groups' rows
    for local in (grad, grad[: rows // 2]):
        seen.clear()
        out = TensorParallelMuon.orthogonalize(stub, local, local)
        assert torch.equal(out, local)  # the pieces go back where they came from
        ours = logical_rows("decoder.layers.0.self_attention.linear_qkv.weight", local.shape[0], CFG)
        assert len(seen) == len(ours) == 3
        for piece, index in zip(seen, ours):
            assert torch.equal(piece, local[torch.tensor(index)])


def _reference(nesterov: bool, adjust: str, lrs: list, grads: list, start: dict, cfg) -> dict:
    """torch.optim.Muon (and torch.optim.AdamW for the rest) over the same steps: the q/k/v weight
    as its three logical matrices, each expert as its [out, in] matrix. torch.optim.Muon runs its
    Newton-Schulz iteration in bfloat16; here in float32 (MindSpore's CPU has no bfloat16 matmul,
    and ours is float32): its own code, its cast made a no-op."""
    import torch

    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    experts = "decoder.layers.1.mlp.experts.weight1"
    pieces = {}  # torch parameter -> (name, how to cut a whole array into it)
    for name, value in start.items():
        if name == qkv:
            for r in logical_rows(name, value.shape[0], cfg):
                pieces[torch.nn.Parameter(torch.tensor(value[r]))] = (name, lambda a, r=r: a[r])
        elif name == experts:
            for e in range(value.shape[0]):
                pieces[torch.nn.Parameter(torch.tensor(value[e].T.copy()))] = (name, lambda a, e=e: a[e].T)
        else:
            pieces[torch.nn.Parameter(torch.tensor(value))] = (name, lambda a: a)
    muon = [p for p, (n, _) in pieces.items() if uses_muon(n, start[n])]
    rest = [p for p, (n, _) in pieces.items() if not uses_muon(n, start[n])]
    decayed = [p for p in rest if not no_weight_decay(pieces[p][0], p)]
    flat = [p for p in rest if no_weight_decay(pieces[p][0], p)]
    opt_m = torch.optim.Muon(muon, lr=lrs[0], weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_steps=5,
                             adjust_lr_fn=adjust)
    opt_a = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": flat, "weight_decay": 0.0}],
                              lr=lrs[0], betas=(0.9, 0.95), eps=1e-8)
    float32 = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = lambda self: self.float().clone()  # a copy, as the cast makes
    try:
        for lr, step in zip(lrs, grads):
            for p, (name, cut) in pieces.items():
                p.grad = torch.tensor(np.ascontiguousarray(cut(step[name])))
            for opt in (opt_m, opt_a):
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
    finally:
        torch.Tensor.bfloat16 = float32
    out = {name: np.array(value, copy=True) for name, value in start.items()}
    for p, (name, cut) in pieces.items():  # each piece back where cut() took it from
        index = np.arange(out[name].size).reshape(out[name].shape)
        out[name].reshape(-1)[cut(index).reshape(-1)] = p.detach().numpy().reshape(-1)
    return out


@pytest.mark.feature("muon")
@pytest.mark.parametrize("nesterov, mode, extra, adjust", [(False, "shape_scaling", 1.0, "original"),
                                                           (True, "spectral", 0.2, "match_rms_adamw")],
                         ids=["shape-scaling", "spectral-0.2-nesterov"])
def test_twenty_steps_equal_torch_optim_muon(nesterov, mode, extra, adjust):
    """Every parameter after each of 20 steps (a learning rate that changes, weight decay 0.1)
    equals torch.optim.Muon's for the matrices and torch.optim.AdamW's for the rest within float32
    rounding. torch's "original" lr adjustment is the shape_scaling rule; its "match_rms_adamw" is
    the spectral rule times 0.2."""
    rng = np.random.default_rng(0)
    start = {name: (rng.standard_normal(shape) * 0.5).astype(np.float32) for name, shape in SHAPES.items()}
    lrs = [0.02 * (1 - t / (2 * STEPS)) for t in range(STEPS)]
    grads = [{name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
             for _ in range(STEPS)]
    params = {name: nn.Parameter(value) for name, value in start.items()}
    opt = Muon(list(params.items()), lrs[0], weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, momentum=0.9,
               nesterov=nesterov, ns_steps=5, scale_mode=mode, extra_scale=extra, cfg=CFG)
    # fp32: a matrix keeps its momentum (4 bytes an element), the rest Adam's two moments (8)
    assert opt.state_bytes() == sum((4 if uses_muon(n, v) else 8) * v.size for n, v in start.items())
    want = _reference(nesterov, adjust, lrs, grads, start, CFG)
    for lr, step in zip(lrs, grads):
        opt.step([ops.tensor(step[name]) for name in params], lr)
    for name, p in params.items():
        got = ops.to_numpy(p)
        assert not np.allclose(got, start[name], atol=1e-3), name  # every parameter moved
        worst = float(np.max(np.abs(got - want[name]))) / float(np.max(np.abs(want[name])))
        assert worst < 2e-6, (name, worst)


@pytest.mark.feature("muon")
def test_training_with_muon_resumes_its_momentum_exactly(capsys, corpus, tmp_path):  # noqa: F811
    """`mindspeed train --optimizer muon` (Nesterov, a MoE layer: the router and the experts through
    Muon): the loss falls, the log says which optimizer updates how many parameters, and a run
    resumed from its iteration-3 checkpoint continues the 6-step curve bit for bit (the momentum
    and the fallback's moments saved and loaded); without the momentum the checkpoint is refused."""
    from test_training import SMALL, losses, train

    flags = [*SMALL, "--data-path", corpus, "--optimizer", "muon", "--muon-nesterov", "--num-experts", "4",
             "--moe-ffn-hidden-size", "64", "--lr", "2e-2", "--min-lr", "2e-3", "--weight-decay", "0.1"]
    whole, ckpt = tmp_path / "whole.jsonl", tmp_path / "ckpt"
    code, out, err = train(capsys, *flags, "--train-iters", "6", "--save", str(ckpt), "--save-interval", "3",
                           "--metrics-file", str(whole))
    assert code == 0, err
    curve = losses(whole)
    assert curve[6] < curve[1] - 0.5, curve
    assert "optimizer: Muon for 10 matrices (" in out and "AdamW for 7 others" in out, out  # 2 x (qkv, proj, router, experts x 2)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = tmp_path / "resumed.jsonl"
    code, out, err = train(capsys, *flags, "--train-iters", "6", "--load", str(ckpt), "--metrics-file", str(resumed))
    assert code == 0, err
    assert losses(resumed) == {i: curve[i] for i in (4, 5, 6)}
    # an AdamW checkpoint has moments, not the momentum: refused in one line
    adam = tmp_path / "adam"
    assert train(capsys, *[f for f in flags if f not in ("--optimizer", "muon", "--muon-nesterov")],
                 "--train-iters", "1", "--save", str(adam))[0] == 0
    code, out, err = train(capsys, *flags, "--train-iters", "2", "--load", str(adam))
    assert code == 2 and "is AdamW's: it was saved without --optimizer muon" in err, err
    # a conversion writes the weights: it says the momentum stays behind, and where it is
    from mindspeed_core import cli

    assert cli.main(["convert", "--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", str(ckpt),
                     "--save-dir", str(tmp_path / "pp2"), "--target-pipeline-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "the optimizer state" in out and "exp_avg, exp_avg_sq, momentum) is not converted" in out, out


@pytest.mark.parametrize("spec", [("split", 0), ("split", 1), ("swiglu", 0), ("sections", (8, 4, 4)),
                                  ("qkv", 1, 2, 2)], ids=lambda s: s[0] + "-" + str(s[1]))
def test_tp_shards_join_and_cut_on_facade_tensors_as_on_numpy(spec):
    """Muon's --muon-tp-mode duplicated joins a matrix from its TP shards and cuts this rank's part
    back with parallel/sharding's rules on facade tensors: the same elements as the numpy rules
    the checkpoints use, for every kind of cut (a key/value head copied to both ranks included)."""
    from mindspeed_core.parallel.sharding import shard, unshard
    from mindspeed_core.training.muon import FacadeTensors

    rows = 8 if spec[0] == "qkv" else 16  # one query group of 2 heads and its key and value head, width 2
    full = np.arange(rows * 6, dtype=np.float32).reshape(rows, 6)
    parts = [ops.tensor(shard(full, spec, 2, r)) for r in range(2)]
    assert np.array_equal(ops.to_numpy(unshard(parts, spec, FacadeTensors)), full)
    for r in range(2):
        assert np.array_equal(ops.to_numpy(shard(ops.tensor(full), spec, 2, r, FacadeTensors)), shard(full, spec, 2, r))
