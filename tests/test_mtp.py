"""Multi-token prediction (models/mtp.py): the depths' losses equal a float64 numpy model
(DeepSeek-V3's equations written out), their gradient reaches the shared embedding, the
modules and the output layer, and the trainer logs them apart from the language-model loss."""

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
