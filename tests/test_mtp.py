"""Multi-token prediction (models/mtp.py): the depths' losses equal a float64 numpy model
(DeepSeek-V3's equations written out), their gradient reaches the shared embedding, the
modules and the output layer, the trainer logs them apart from the language-model loss, and its
first step's gradients are those of the whole objective (LM loss + the scaled depths' losses)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import numeric
from mindspeed_core import autograd, nn, ops, random
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.gpt import GPTModel, Tokens, whole_state
from test_training import SMALL, corpus, train  # noqa: F401  (corpus is a fixture)

pytestmark = pytest.mark.feature("multi-token-prediction")

CFG = ModelConfig(vocab_size=48, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48, max_position_embeddings=16, mtp_num_layers=2, mtp_loss_scaling_factor=0.3,
                  init_method_std=0.2)


def _batch(seed=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CFG.vocab_size, (2, 12))
    labels = np.concatenate([ids[:, 1:], rng.integers(0, CFG.vocab_size, (2, 1))], axis=1)
    mask = (rng.random((2, 12)) > 0.25).astype(np.float32)
    return ids, labels, mask


def _model(cfg):
    random.seed(5)
    model = GPTModel(cfg)
    nn.set_training(model, True)
    return model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_depth_losses_equal_a_float64_numpy_model(tied):
    cfg = dataclasses.replace(CFG, untie_embeddings_and_output_weights=not tied)
    model = _model(cfg)
    ids, labels, mask = _batch()
    tokens = Tokens(loss_mask=mask)
    model(ops.tensor(ids), tokens)
    total = float(ops.to_numpy(model.mtp_loss(ops.tensor(labels), tokens)))
    got = model.mtp.take_losses()
    want = numeric.mtp_losses(whole_state(model), cfg, ids, labels, mask)
    np.testing.assert_allclose(got, want, rtol=2e-5)
    assert total == pytest.approx(0.3 / 2 * sum(want), rel=2e-5)
    assert got[1] != pytest.approx(got[0], rel=1e-3)  # two depths, two different predictions


def test_the_gradient_reaches_embedding_modules_and_head_as_float64_differences():
    cfg = CFG
    model = _model(cfg)
    ids, labels, mask = _batch(4)
    tokens = Tokens(loss_mask=mask)
    names = [n for n, _ in nn.named_parameters(model)]
    params = [p for _, p in nn.named_parameters(model)]

    def mtp_only(ids_t, labels_t):
        model(ids_t, tokens)
        return model.mtp_loss(labels_t, tokens)

    _, grads = autograd.value_and_grad(mtp_only, params)(ops.tensor(ids), ops.tensor(labels))
    grads = dict(zip(names, (ops.to_numpy(g) for g in grads)))
    state = whole_state(model)
    rng = np.random.default_rng(0)
    for name in ("embedding.word_embeddings.weight", "mtp.layers.0.eh_proj.weight",
                 "mtp.layers.1.transformer_layer.mlp.linear_fc1.weight", "mtp.final_layernorms.1.weight",
                 "output_layer.weight", "decoder.layers.1.self_attention.linear_qkv.weight"):
        flat = np.abs(grads[name]).reshape(-1)
        for index in [int(np.argmax(flat)), int(rng.integers(flat.size))]:
            def loss_at(delta, name=name, index=index):
                changed = {k: np.asarray(v, np.float64) for k, v in state.items()}
                changed[name].reshape(-1)[index] += delta
                return 0.3 / 2 * sum(numeric.mtp_losses(changed, cfg, ids, labels, mask))

            want = (loss_at(1e-5) - loss_at(-1e-5)) / 2e-5
            got = grads[name].reshape(-1)[index]
            assert got == pytest.approx(want, rel=2e-3, abs=2e-6), (name, index)
    assert np.abs(grads["embedding.word_embeddings.weight"][labels[:, :-1].reshape(-1)]).sum() > 0


def test_the_main_head_is_unchanged_and_each_forward_serves_one_loss():
    model = _model(CFG)
    ids, labels, _ = _batch()
    logits = ops.to_numpy(model(ops.tensor(ids)))
    want = numeric.gpt_logits(whole_state(model), CFG, ids[0])
    np.testing.assert_allclose(logits[0], want, rtol=1e-4, atol=1e-5)  # the main head as without modules
    model.mtp_loss(ops.tensor(labels))
    with pytest.raises(RuntimeError, match="forward"):  # each forward's hidden states serve one loss
        model.mtp_loss(ops.tensor(labels))


def test_training_logs_each_depth_apart(capsys, corpus, tmp_path):  # noqa: F811
    log = tmp_path / "m.jsonl"
    code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "4", "--mtp-num-layers", "2",
                           "--metrics-file", str(log), "--log-interval", "1")
    assert code == 0, err
    assert "mtp_1 loss" in out and "mtp_2 loss" in out
    records = [json.loads(line) for line in log.read_text().splitlines() if '"mtp_losses"' in line]
    assert len(records) == 4 and all(len(r["mtp_losses"]) == 2 for r in records)
    first, last = records[0], records[-1]
    assert np.all(np.isfinite(first["mtp_losses"])) and last["mtp_losses"][0] < first["mtp_losses"][0]
    assert first["loss"] != pytest.approx(first["mtp_losses"][0], rel=1e-3)  # the reported loss is the LM loss


# a tiny dense model (logits O(1) at std 0.2), one step of two micro-batches of 2 x 16 tokens
TRAINED = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
           "--ffn-hidden-size", "48", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--lr", "3e-3", "--eval-iters", "0", "--log-interval", "1", "--make-vocab-size-divisible-by", "8",
           "--no-progress", "--seed", "7", "--sample-tokens", "0", "--init-method-std", "0.2", "--train-iters", "1",
           "--mtp-loss-scaling-factor", "0.3"]


def _f64(array):
    return ops.tensor(np.asarray(array, np.float64), dtype="float64")


def _objective64(w: dict, cfg, ids: np.ndarray, labels: np.ndarray):
    """One micro-batch's whole objective in float64 facade ops on the parameters ``w`` {name:
    tensor}, written out apart from models/ (whose norms compute in float32): the dense model of
    numeric._dense_model, then LM loss + mtp_loss_scaling_factor / D * sum over depths k = 1..D
    of depth k's mean cross entropy. Depth k joins enorm_k(embedding of t_{i+k}) with
    hnorm_k(h_{k-1}) through eh_proj_k and its transformer layer, and predicts t_{i+k+1} (where
    it exists) through final_layernorms_k and the shared output layer; h_0 is the decoder's
    output before its final norm. Returns (objective tensor, [LM, depth 1, ...] floats)."""
    b, s = ids.shape
    d, groups = cfg.kv_channels, cfg.num_query_groups
    per_group = cfg.num_attention_heads // groups
    cos, sin = (_f64(t.reshape(1, s, 1, d)) for t in numeric.rope_tables(s, d, cfg.rotary_base))
    future = _f64(np.triu(np.full((s, s), -1e30), 1))  # causal: exp() of these scores is 0
    # scalars as float64 tensors: MindSpore takes a Python float as float32
    eps, scale = _f64(cfg.norm_epsilon), _f64(1.0 / np.sqrt(d))
    weight = _f64(cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers)

    def norm(x, name):
        return x * ops.rsqrt(ops.mean(x * x, dim=-1, keepdim=True) + eps) * w[name + ".weight"]

    def rotate(x):
        first, second = ops.split(x, [d // 2, d // 2], dim=-1)
        return x * cos + ops.cat([-second, first], dim=-1) * sin

    def layer(x, p):
        qkv = ops.reshape(ops.linear(norm(x, p + "input_layernorm"), w[p + "self_attention.linear_qkv.weight"]),
                          (b, s, groups, per_group + 2, d))
        q, k, v = ops.split(qkv, [per_group, 1, 1], dim=3)
        q = ops.reshape(rotate(ops.reshape(q, (b, s, groups * per_group, d))), (b, s, groups, per_group, d))
        k = rotate(ops.reshape(k, (b, s, groups, d)))
        q = ops.permute(q, (0, 2, 3, 1, 4))  # [b, g, per_group, s, d]: each group's heads share k, v
        k = ops.permute(ops.reshape(k, (b, s, groups, 1, d)), (0, 2, 3, 4, 1))  # [b, g, 1, d, s]
        v = ops.permute(v, (0, 2, 3, 1, 4))  # [b, g, 1, s, d]
        scores = ops.exp(ops.matmul(q, k) * scale + future)
        out = ops.matmul(scores / ops.sum(scores, dim=-1, keepdim=True), v)
        out = ops.reshape(ops.permute(out, (0, 3, 1, 2, 4)), (b, s, groups * per_group * d))
        x = x + ops.linear(out, w[p + "self_attention.linear_proj.weight"])
        gate, up = ops.chunk(ops.linear(norm(x, p + "pre_mlp_layernorm"), w[p + "mlp.linear_fc1.weight"]), 2, dim=-1)
        return x + ops.linear(gate / (1.0 + ops.exp(-gate)) * up, w[p + "mlp.linear_fc2.weight"])

    def cross_entropy(x, final_norm, targets, keep):  # logits are O(1): exp() needs no shift
        logits = ops.linear(norm(x, final_norm), w["output_layer.weight"])
        log_p = logits - ops.log(ops.sum(ops.exp(logits), dim=-1, keepdim=True))
        picked = np.eye(cfg.vocab_size)[targets] * (keep / keep.sum())[..., None]
        return -ops.sum(log_p * _f64(picked))

    embed = w["embedding.word_embeddings.weight"]
    hidden = ops.embedding(ops.tensor(ids), embed)
    for n in range(cfg.num_layers):
        hidden = layer(hidden, f"decoder.layers.{n}.")
    losses = [cross_entropy(hidden, "decoder.final_layernorm", labels, np.ones((b, s)))]
    for k in range(1, cfg.mtp_num_layers + 1):
        p = f"mtp.layers.{k - 1}."
        ahead, target, keep = np.zeros_like(labels), np.zeros_like(labels), np.zeros((b, s))
        ahead[:, :s - k + 1] = labels[:, k - 1:]  # t_{i+k}
        target[:, :s - k], keep[:, :s - k] = labels[:, k:], 1.0  # t_{i+k+1}
        joined = ops.cat([norm(ops.embedding(ops.tensor(ahead), embed), p + "enorm"), norm(hidden, p + "hnorm")],
                         dim=-1)
        hidden = layer(ops.linear(joined, w[p + "eh_proj.weight"]), p + "transformer_layer.")
        losses.append(cross_entropy(hidden, f"mtp.final_layernorms.{k - 1}", target, keep))
    total = losses[0]
    for depth in losses[1:]:
        total = total + depth * weight
    return total, [float(ops.to_numpy(v)) for v in losses]


@pytest.mark.parametrize("depths", [1, 2])
def test_trainer_first_step_gradients_are_the_whole_objectives(depths, corpus, tmp_path, monkeypatch):  # noqa: F811
    """The first step's gradients as the optimizer takes them (parity_worker.train_case) equal
    the float64 gradient of LM loss + 0.3 / D * the depths' losses (the mean over the step's
    micro-batches), so a detached or mis-scaled MTP term, which still lets the MTP loss fall,
    shows here. The float64 objective's values are anchored to the numpy model (numeric.py)."""
    from parity_worker import train_case
    from test_parallel import gradient_difference

    from mindspeed_core.training import batches
    from mindspeed_core.training.trainer import Trainer

    seen = {"batches": []}
    build, micro_batch = Trainer.build, batches.Batches.micro_batch

    def recording_build(self):  # the starting weights (copied: the optimizer updates them in place)
        build(self)
        seen["cfg"] = self.cfg
        seen["state"] = {k: np.array(v, copy=True) for k, v in whole_state(self.model).items()}

    def recording_micro_batch(self, split, samples):
        out = micro_batch(self, split, samples)
        assert out[2] is None  # plain sequences: no packing, positions or loss mask to mirror
        seen["batches"].append((ops.to_numpy(out[0]), ops.to_numpy(out[1])))
        return out

    monkeypatch.setattr(Trainer, "build", recording_build)
    monkeypatch.setattr(batches.Batches, "micro_batch", recording_micro_batch)
    train_case(str(tmp_path), "mtp", [*TRAINED, "--mtp-num-layers", str(depths), "--data-path", corpus])
    got = dict(np.load(tmp_path / "mtp-grads.npz"))
    cfg, state = seen["cfg"], seen["state"]
    assert cfg.mtp_num_layers == depths and len(seen["batches"]) == 2

    assert cfg.normalization == "rmsnorm" and cfg.activation == "swiglu" and cfg.untie_embeddings_and_output_weights
    names = list(state)
    params = [nn.Parameter(_f64(state[name])) for name in names]

    values = []  # each micro-batch's [LM, depth 1, ...]

    def step_objective():  # the trainer's step: the mean over its micro-batches
        totals = [_objective64(dict(zip(names, params)), cfg, ids, labels) for ids, labels in seen["batches"]]
        values.extend(parts for _, parts in totals)
        return sum((t for t, _ in totals[1:]), totals[0][0]) * (1.0 / len(totals))

    _, grads = autograd.value_and_grad(step_objective, params)()
    want = dict(zip(names, (ops.to_numpy(g).astype(np.float64) for g in grads)))
    want["grad_norm"] = np.sqrt(sum(float(np.sum(v ** 2)) for v in want.values()))

    # the float64 objective is the numpy model's
    for (ids, labels), parts in zip(seen["batches"], values):
        lm = np.mean([-numeric.log_softmax(numeric.gpt_logits(state, cfg, row))[np.arange(len(row)), target].mean()
                      for row, target in zip(ids, labels)])
        np.testing.assert_allclose(parts, [lm, *numeric.mtp_losses(state, cfg, ids, labels)], rtol=1e-12)

    worst, where = gradient_difference(got, want)  # per tensor: max |got - want| / max |want|
    print(f"MTP depth {depths}: worst gradient error {worst:.2e} of the tensor's largest entry ({where})")
    assert worst < 1e-5, (where, worst)
