"""DeepSeek sparse attention (models/dsa.py): the indexer's scores, its choice of keys and its
loss equal a float64 numpy model of DeepSeek-V3.2's equations, the loss's gradient reaches the
indexer alone (float64 differences), and in a whole model the indexer loss leaves every other
gradient as it was. The logits of whole models against transformers are test_hf's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import numeric
from mindspeed_core import autograd, nn, ops, random
from mindspeed_core.models import dsa, families
from mindspeed_core.models.gpt import Tokens

# 20 queries keeping 5 keys; 16 indexer heads, so that no key scores exactly 0 (every head's ReLU zero)
# at the 5th place, where numpy's and a framework's top-k may break the tie differently
S, HEADS, D, ROPE, LATENT, HIDDEN, N, DI, TOPK = 20, 4, 12, 4, 24, 32, 16, 8, 5


def _indexer(interleave: bool):
    cfg = families.preset("tiny-deepseek-v32", hidden_size=HIDDEN, num_attention_heads=HEADS,
                          mla=dict(kv_lora_rank=16, qk_nope_head_dim=D - ROPE, qk_rope_head_dim=ROPE, v_head_dim=8,
                                   q_lora_rank=LATENT),
                          dsa=dict(topk=TOPK, n_heads=N, head_dim=DI, loss_coeff=1.0, rope_interleave=interleave))
    random.seed(3)
    indexer = dsa.Indexer(cfg)
    rng = np.random.default_rng(4)
    for p in nn.parameters(indexer):  # weights of spread 0.3: scores of O(1), none of the k_norm's at 1 / 0
        nn.assign(p, rng.normal(0.0, 0.3, tuple(p.shape)).astype(np.float32) + (1.0 if len(p.shape) == 1 else 0.0))
    return indexer


def _inputs(seed=5):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (2, S, HIDDEN)).astype(np.float32)
    latent = rng.normal(0, 1, (2, S, LATENT)).astype(np.float32)
    q = rng.normal(0, 1, (2, S, HEADS, D)).astype(np.float32)
    k = rng.normal(0, 1, (2, S, HEADS, D)).astype(np.float32)
    cos, sin = numeric.rope_tables(S, ROPE)
    return x, latent, q, k, cos.astype(np.float32), sin.astype(np.float32)


def _numpy_rotate(x, cos, sin, interleave):
    rot, rest = x[..., :ROPE], x[..., ROPE:]
    if interleave:  # pairs regrouped as (even, odd): the dot products do not depend on the order
        rot = np.concatenate([rot[..., 0::2], rot[..., 1::2]], axis=-1)
    return np.concatenate([numeric.apply_rotary(rot, cos, sin), rest], axis=-1)


def _numpy_scores(w, x, latent, cos, sin, interleave):
    """DeepSeek-V3.2's index scores in float64: sum_h w_h / sqrt(H) * relu(q_h . k) / sqrt(d)."""
    x, latent = x.astype(np.float64), latent.astype(np.float64)
    q = (latent @ w["wq_b.weight"].T).reshape(2, S, N, DI)
    q = _numpy_rotate(q, cos, sin, interleave)
    k = numeric.layer_norm(x @ w["wk.weight"].T, w["k_norm.weight"], w["k_norm.bias"], eps=1e-6)
    k = _numpy_rotate(k[:, :, None], cos, sin, interleave)[:, :, 0]
    dots = np.maximum(np.einsum("bshd,btd->bsht", q, k) * DI ** -0.5, 0.0)
    weights = (x @ w["weights_proj.weight"].T) * N ** -0.5
    return np.einsum("bsh,bsht->bst", weights, dots)


def _numpy_choice(scores):
    causal = np.tril(np.ones((S, S), bool))
    masked = np.where(causal, scores, -np.inf)
    keep = np.zeros_like(causal, shape=scores.shape)
    order = np.argsort(-masked, axis=-1, kind="stable")[..., :TOPK]
    np.put_along_axis(keep, order, True, axis=-1)
    return keep & causal


def _numpy_loss(scores, keep, q, k):
    """KL(p || softmax(I)) over the kept keys, p the heads' summed attention probabilities normalised."""
    logits = np.einsum("bshd,bthd->bhst", q.astype(np.float64), k.astype(np.float64)) * D ** -0.5
    probs = numeric.softmax(np.where(keep[:, None], logits, -np.inf))
    p = probs.sum(axis=1)
    p = np.where(keep, p, 0.0) / p.sum(axis=-1, keepdims=True)
    log_q = numeric.log_softmax(np.where(keep, scores, -np.inf))
    terms = np.where(keep, p * (np.log(np.where(keep, p, 1.0)) - np.where(keep, log_q, 0.0)), 0.0)
    return terms.sum() / (2 * S)


def _weights(indexer) -> dict:
    return {name: ops.to_numpy(p).astype(np.float64) for name, p in nn.named_parameters(indexer)}


def _ours(indexer, inputs):
    x, latent, q, k, cos, sin = (ops.tensor(a) for a in inputs)
    scores = indexer(x, latent, cos, sin)
    keep = dsa.choose(scores, dsa.allowed_keys(S, S, None), TOPK)
    return scores, keep, dsa.indexer_loss(q, k, D ** -0.5, scores, keep, lambda t: t)


@pytest.mark.feature("dsa-indexer")
@pytest.mark.feature("dsa-indexer-loss")
@pytest.mark.parametrize("interleave", [False, True], ids=["halves", "pairs"])
def test_scores_choice_and_loss_equal_a_float64_numpy_model(interleave):
    indexer = _indexer(interleave)
    inputs = _inputs()
    scores, keep, loss = _ours(indexer, inputs)
    w = _weights(indexer)
    want = _numpy_scores(w, *inputs[:2], *inputs[4:], interleave)
    scale = np.abs(want).max()
    assert scale > 1  # scores of O(1): a missing factor shows
    np.testing.assert_allclose(ops.to_numpy(scores), want, atol=2e-6 * scale)
    choice = _numpy_choice(want)
    np.testing.assert_array_equal(ops.to_numpy(keep)[:, 0], choice)
    assert choice.sum(-1).tolist() == [[min(i + 1, TOPK) for i in range(S)]] * 2  # exactly k where k are visible
    other = _numpy_scores(w, *inputs[:2], *inputs[4:], not interleave)
    assert (_numpy_choice(other) != choice).any()  # the other rotation chooses other keys
    want_loss = _numpy_loss(want, choice, *inputs[2:4])
    assert float(ops.to_numpy(loss)) == pytest.approx(want_loss, rel=2e-5)
    assert want_loss > 0.05  # far from its minimum: the gradients below are not noise


@pytest.mark.feature("dsa-indexer")
@pytest.mark.feature("dsa-indexer-loss")
def test_the_loss_gradient_reaches_the_indexer_alone_as_float64_differences():
    indexer = _indexer(False)
    inputs = _inputs(6)
    cos, sin = ops.tensor(inputs[4]), ops.tensor(inputs[5])
    given = [nn.Parameter(a) for a in inputs[:4]]  # the hidden state, query latent, attention's q and k
    params = list(nn.parameters(indexer))

    def loss_of():
        x, latent, q, k = given
        scores = indexer(x, latent, cos, sin)
        keep = dsa.choose(scores, dsa.allowed_keys(S, S, None), TOPK)
        return dsa.indexer_loss(q, k, D ** -0.5, scores, keep, lambda t: t)

    _, grads = autograd.value_and_grad(loss_of, params + given)()
    for grad in grads[len(params):]:  # the main model's tensors get none
        assert not np.abs(ops.to_numpy(grad)).any()
    names = [n for n, _ in nn.named_parameters(indexer)]
    w = _weights(indexer)
    choice = _numpy_choice(_numpy_scores(w, *inputs[:2], *inputs[4:], False))  # held: the choice has no gradient

    def numpy_loss(weights):
        return _numpy_loss(_numpy_scores(weights, *inputs[:2], *inputs[4:], False), choice, *inputs[2:4])

    rng = np.random.default_rng(7)
    for name, grad in zip(names, grads):
        grad = ops.to_numpy(grad)
        for flat in rng.choice(grad.size, size=min(grad.size, 12), replace=False):
            index = np.unravel_index(flat, grad.shape)
            plus, minus = dict(w), dict(w)
            plus[name], minus[name] = w[name].copy(), w[name].copy()
            plus[name][index] += 1e-6
            minus[name][index] -= 1e-6
            want = (numpy_loss(plus) - numpy_loss(minus)) / 2e-6
            assert grad[index] == pytest.approx(want, abs=2e-5 + 1e-3 * abs(want)), (name, index)
        assert np.abs(grad).max() > 1e-3, name  # every indexer weight learns


@pytest.mark.feature("dsa-indexer")
@pytest.mark.feature("dsa-indexer-loss")
@pytest.mark.feature("dsa-shared-topk")
def test_in_a_model_the_indexer_loss_trains_the_indexers_and_changes_no_other_gradient():
    """The step's objective (training/losses.py) with --indexer-loss-coeff 1 against 0: every
    gradient outside the indexers is the same, the indexers' are zero without it; with GLM-5's
    shared layer (no indexer) and a multi-token prediction layer (its own indexer)."""
    from mindspeed_core.models import registry
    from mindspeed_core.training.loss_scale import LossScaler
    from mindspeed_core.training.losses import StepLoss

    rng = np.random.default_rng(8)
    ids = ops.tensor(rng.integers(0, 64, (2, 24)))  # 24 positions, 16 keys kept
    labels = ops.tensor(rng.integers(0, 64, (2, 24)))
    grads = {}
    for coeff in (1.0, 0.0):
        base = families.preset("tiny-glm5", vocab_size=64, max_position_embeddings=32, mtp_num_layers=1)
        cfg = dataclasses.replace(base, dsa=dataclasses.replace(base.dsa, loss_coeff=coeff))
        random.seed(11)
        model = registry.for_config(cfg).build(cfg)
        nn.set_training(model, True)
        trained = [(n, p) for n, p in nn.named_parameters(model) if not n.endswith("expert_bias")]  # no gradient
        names = [n for n, _ in trained]
        objective = StepLoss(None, LossScaler(False, 1.0)).of_model(model)
        _, values = autograd.value_and_grad(lambda: objective(ids, labels, Tokens()), [p for _, p in trained])()
        grads[coeff] = dict(zip(names, (ops.to_numpy(g) for g in values)))
    indexers = [n for n in names if ".dsa_indexer." in n]
    assert any(n.startswith("mtp.") for n in indexers) and not any(".2.self_attention.dsa_indexer" in n for n in indexers)
    for name in names:
        if name in indexers:
            assert not grads[0.0][name].any() and np.abs(grads[1.0][name]).max() > 1e-6, name
        else:
            np.testing.assert_array_equal(grads[1.0][name], grads[0.0][name], err_msg=name)


@pytest.mark.feature("dsa-dense-warmup")
def test_the_dense_warmup_attends_to_every_key_and_its_loss_covers_them():
    """--indexer-dense-warmup: the logits are those of the same weights without an indexer (every
    key seen) and far from the sparse model's; each indexer's loss is the KL over every visible
    key (the float64 numpy model's with the causal mask for the choice)."""
    from mindspeed_core.models import registry
    from mindspeed_core.models.gpt import load_whole_state, whole_state

    rng = np.random.default_rng(12)
    ids = ops.tensor(rng.integers(0, 64, (2, 24)))  # 24 positions, 4 keys kept when sparse
    base = families.preset("tiny-deepseek-v32", vocab_size=64, max_position_embeddings=32)
    sparse = dataclasses.replace(base, dsa=dataclasses.replace(base.dsa, topk=4))
    logits, states, losses = {}, {}, {}
    for name, cfg in (("sparse", sparse), ("warmup", dataclasses.replace(sparse, dsa=dataclasses.replace(
            sparse.dsa, dense_warmup=True))), ("every key", dataclasses.replace(sparse, dsa=dataclasses.replace(
            sparse.dsa, topk=24))), ("dense", dataclasses.replace(base, dsa=None))):
        random.seed(11)
        model = registry.for_config(cfg).build(cfg)
        if states:  # the sparse model's weights (the dense one has no indexers)
            load_whole_state(model, {k: v for k, v in states["sparse"].items() if k in whole_state(model)})
        states[name] = whole_state(model)
        nn.set_training(model, True)  # no dropout: the indexer losses are computed
        logits[name] = ops.to_numpy(model(ids))
        losses[name] = None if cfg.dsa is None else float(ops.to_numpy(model.indexer_losses()))
    top = np.abs(logits["dense"]).max()
    assert top > 0.5  # logits of O(1)
    np.testing.assert_allclose(logits["warmup"], logits["dense"], atol=1e-6 * top, rtol=0)
    assert np.abs(logits["sparse"] - logits["dense"]).max() > 0.05 * top  # the choice matters at this length
    # the warm-up's loss is the one over every key (a top-k past the sequence), not over the choice's
    assert losses["warmup"] == pytest.approx(losses["every key"], rel=1e-5)
    assert abs(losses["sparse"] - losses["every key"]) > 0.1 * losses["every key"]

    indexer = _indexer(False)
    inputs = _inputs(9)
    x, latent, q, k, cos, sin = (ops.tensor(a) for a in inputs)
    scores = indexer(x, latent, cos, sin)
    loss = dsa.indexer_loss(q, k, D ** -0.5, scores, dsa.allowed_keys(S, S, None), lambda t: t)
    causal = np.broadcast_to(np.tril(np.ones((S, S), bool)), (2, S, S))
    want = _numpy_loss(_numpy_scores(_weights(indexer), *inputs[:2], *inputs[4:], False), causal, *inputs[2:4])
    assert float(ops.to_numpy(loss)) == pytest.approx(want, rel=2e-5)


# a small DeepSeek-V3.2 layer from MindSpeed-LLM's flags (dense MLPs): 32 positions, 8 keys kept
DSA_RUN = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "16",
           "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--enable-dsa-indexer",
           "--index-topk", "8", "--index-n-heads", "4", "--index-head-dim", "16", "--num-layers", "2",
           "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--swiglu",
           "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
           "--position-embedding-type", "rope", "--seq-length", "32", "--max-position-embeddings", "32",
           "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2", "--init-method-std", "0.2",
           "--eval-iters", "0",
           "--sample-tokens", "0", "--no-progress", "--log-interval", "1"]


@pytest.mark.feature("dsa-dense-warmup")
@pytest.mark.feature("dsa-indexer-loss")
def test_the_dense_warmup_trains_the_indexers_alone_and_the_sparse_stage_starts_from_it(tmp_path, capsys):
    """Four warm-up steps move every indexer weight and no other (the others have no optimizer
    state), the indexer loss is logged each step and falls; the sparse stage then trains from the
    warm-up's checkpoint with --finetune, and without it is told so in one line."""
    import json

    from mindspeed_core import cli
    from mindspeed_core.training import checkpoint

    warm, metrics = tmp_path / "warm", tmp_path / "m.jsonl"
    assert cli.main(["train", *DSA_RUN, "--indexer-dense-warmup", "--train-iters", "4", "--save", str(warm),
                     "--save-interval", "1", "--metrics-file", str(metrics)]) == 0
    first, last = checkpoint.load_model_arrays(str(warm), 1), checkpoint.load_model_arrays(str(warm), 4)
    indexers = [n for n in first if dsa.is_indexer(n)]
    assert len(indexers) == 2 * 5  # wq_b, wk, k_norm's weight and bias, weights_proj in each layer
    for name in first:
        if name in indexers:
            assert np.abs(last[name] - first[name]).max() > 1e-4, name
        else:
            np.testing.assert_array_equal(last[name], first[name], err_msg=name)
    records = [r for r in map(json.loads, open(metrics)) if "loss" in r]
    kl = [r["indexer_loss"] for r in records]
    assert len(kl) == 4 and kl[-1] < kl[0], kl
    sparse = ["train", *DSA_RUN, "--train-iters", "6", "--load", str(warm)]
    assert cli.main([*sparse, "--finetune", "--save", str(tmp_path / "sparse")]) == 0
    capsys.readouterr()
    assert cli.main([*sparse, "--save", str(tmp_path / "resumed")]) == 2
    assert "trained other parameters" in capsys.readouterr().err


def test_bad_sparse_attention_input_is_one_clear_line(tmp_path):
    """A top-k of zero, GLM-5's shared layer without an indexer before it, sparse attention on latent
    attention without a query latent, and a DeepSeek-V4 folder (its mechanisms not built): each
    refused naming what is wrong."""
    import json

    from mindspeed_core.compat import hf
    from mindspeed_core.errors import CheckpointError
    from mindspeed_core.models.config import DSAConfig, ModelConfig

    with pytest.raises(ValueError, match="topk must be a positive integer"):
        DSAConfig(topk=0)
    with pytest.raises(ValueError, match="the first layer shares the top-k of an earlier layer"):
        DSAConfig(layer_types=("shared", "full"))
    with pytest.raises(ValueError, match="needs multi-latent attention with --q-lora-rank"):
        ModelConfig(mla=dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8), dsa=dict(topk=4))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "hidden_size": 64}))
    with pytest.raises(CheckpointError, match="hyper-connections, compressed sparse attention and hash routing"):
        hf.load_config(str(tmp_path))
