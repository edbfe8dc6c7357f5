"""Mixture-of-experts routing (models/router.py) against an independent numpy reference:
softmax and sigmoid scores, top-k with and without renormalisation, group-limited choice
with the aux-loss-free bias, scaling, both drop policies over capacity, the aux, sequence
aux and z losses, their gradients, and the bias update."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mindspeed_core import autograd, nn, ops, random
from mindspeed_core.models import router
from mindspeed_core.models.config import MoEConfig


def reference(logits, moe: MoEConfig, bias=None, sequences=1):
    """(weights [T, k], experts [T, k], kept, aux, z) in float64, token by token."""
    x = logits.astype(np.float64)
    t, e = x.shape
    if moe.score_function == "softmax":
        scores = np.exp(x - x.max(1, keepdims=True))
        scores /= scores.sum(1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-x))
    experts = np.zeros((t, moe.topk), np.int64)
    for i in range(t):
        choice = scores[i] + (0 if bias is None else bias)
        allowed = np.arange(e)
        if moe.num_groups:
            size = e // moe.num_groups
            group_score = [np.sort(choice[g * size:(g + 1) * size])[-2:].sum() for g in range(moe.num_groups)]
            best = sorted(range(moe.num_groups), key=lambda g: -group_score[g])[:moe.group_topk]
            allowed = np.array(sorted(j for g in best for j in range(g * size, (g + 1) * size)))
        experts[i] = sorted(allowed, key=lambda j: -choice[j])[:moe.topk]
    weights = np.take_along_axis(scores, experts, 1)
    if moe.norm_topk_prob and moe.topk > 1:
        weights = weights / weights.sum(1, keepdims=True)
    weights = weights * moe.scaling_factor
    kept = np.ones(experts.shape, bool)
    if moe.capacity_factor is not None:
        cap = math.ceil(t * moe.topk / e * moe.capacity_factor)
        for j in range(e):
            slots = [(i, s) for i in range(t) for s in range(moe.topk) if experts[i, s] == j]
            if moe.drop_policy == "probs":
                slots.sort(key=lambda p: (-weights[p], p[0]))
            for p in slots[cap:]:
                kept[p] = False
    weights = weights * kept
    probs = scores if moe.score_function == "softmax" else scores / scores.sum(1, keepdims=True)
    groups = sequences if moe.load_balancing_type == "seq_aux_loss" else 1
    per = t // groups
    aux = 0.0
    for g in range(groups):
        rows = slice(g * per, (g + 1) * per)
        f = np.bincount(experts[rows].reshape(-1), minlength=e) / per
        aux += (f * probs[rows].mean(0)).sum() * e / moe.topk
    aux = aux / groups * moe.aux_loss_coeff if moe.load_balancing_type != "none" else 0.0
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    z = (lse ** 2).mean() * moe.z_loss_coeff
    return weights, experts, kept, aux, z


CASES = {
    "mixtral": (16, MoEConfig(num_experts=8, topk=2, aux_loss_coeff=0.01, z_loss_coeff=1e-3), None, 1),
    "qwen2-moe": (16, MoEConfig(num_experts=8, topk=4, norm_topk_prob=False, aux_loss_coeff=0.001), None, 1),
    "qwen3-moe": (12, MoEConfig(num_experts=8, topk=2, load_balancing_type="seq_aux_loss", aux_loss_coeff=0.01), None,
                  3),
    "deepseek-v3": (16, MoEConfig(num_experts=16, topk=3, score_function="sigmoid", num_groups=4, group_topk=2,
                                  scaling_factor=2.5, enable_expert_bias=True, load_balancing_type="seq_aux_loss",
                                  aux_loss_coeff=1e-3), "bias", 2),
    "capacity-probs": (16, MoEConfig(num_experts=4, topk=2, capacity_factor=0.5, drop_policy="probs",
                                     aux_loss_coeff=0.01), None, 1),
    "capacity-position": (16, MoEConfig(num_experts=4, topk=2, capacity_factor=0.75, drop_policy="position"), None,
                          1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_routing_equals_the_numpy_reference(case):
    tokens, moe, bias, sequences = CASES[case]
    g = np.random.default_rng(len(case))
    logits = g.standard_normal((tokens, moe.num_experts)).astype(np.float32)
    bias = g.standard_normal(moe.num_experts).astype(np.float32) * 0.1 if bias else None
    got = router.route(ops.tensor(logits), moe, None if bias is None else ops.tensor(bias), sequences)
    weights, experts, kept, aux, z = reference(logits, moe, bias, sequences)
    np.testing.assert_array_equal(got.experts, experts)
    np.testing.assert_array_equal(got.kept, kept)
    np.testing.assert_allclose(ops.to_numpy(got.weights), weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(ops.to_numpy(got.aux_loss)), aux, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(float(ops.to_numpy(got.z_loss)), z, rtol=1e-5, atol=1e-9)
    assert got.tokens_per_expert.tolist() == np.bincount(experts[kept], minlength=moe.num_experts).tolist()
    if moe.capacity_factor is not None:
        assert got.dropped > 0 and got.tokens_per_expert.max() <= router.capacity(tokens, moe)
    if bias is not None:  # the bias moved the choice but not the weights
        plain = router.route(ops.tensor(logits), moe, None, sequences)
        assert (plain.experts != got.experts).any()


@pytest.mark.parametrize("case", ["mixtral", "deepseek-v3", "capacity-probs"])
def test_routing_gradients_equal_finite_differences(case):
    """d/dlogits of sum(weights * c) + aux + z, against central differences of the reference
    (the choice does not move for a small step)."""
    tokens, moe, bias, sequences = CASES[case]
    moe = MoEConfig(**{**moe.__dict__, "z_loss_coeff": 0.01})
    g = np.random.default_rng(3)
    logits = g.standard_normal((tokens, moe.num_experts)).astype(np.float32)
    c = g.standard_normal((tokens, moe.topk))
    bias = g.standard_normal(moe.num_experts).astype(np.float32) * 0.1 if bias else None

    def objective(x):
        w, _, _, aux, z = reference(x, moe, bias, sequences)
        return (w * c).sum() + aux + z

    param = nn.Parameter(ops.tensor(logits))

    def loss():
        r = router.route(param, moe, None if bias is None else ops.tensor(bias), sequences)
        return ops.sum(r.weights * ops.tensor(c.astype(np.float32))) + r.aux_loss + r.z_loss

    _, (grad,) = autograd.value_and_grad(loss, [param])()
    eps, want = 1e-4, np.zeros(logits.shape)
    for idx in np.ndindex(*logits.shape):
        up, down = logits.astype(np.float64), logits.astype(np.float64)
        up[idx] += eps
        down[idx] -= eps
        want[idx] = (objective(up) - objective(down)) / (2 * eps)
    np.testing.assert_allclose(ops.to_numpy(grad), want, rtol=1e-3, atol=1e-5)


def test_expert_bias_moves_towards_the_mean_load():
    bias = np.zeros(4, np.float32)
    new = router.updated_expert_bias(bias, np.array([10, 2, 4, 4]), 1e-3)
    np.testing.assert_allclose(new, [-1e-3, 1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("bad, message", [
    (dict(topk=9), "topk must be between 1 and the"),
    (dict(num_groups=3, group_topk=1), "do not split into 3 groups"),
    (dict(num_groups=4, group_topk=1, topk=3), "fewer than topk"),
    (dict(num_groups=4), "needs both num_groups and group_topk"),
    (dict(score_function="relu"), "score_function must be one of"),
    (dict(pad_to_capacity=True), "pad_to_capacity needs a capacity_factor"),
    # LongCat-Flash's zero-computation experts: k distinct slots among the real and zero ones
    (dict(zero_experts=2, topk=11), r"the 10 experts \(8 real, 2 of zero computation\), got 11"),
    (dict(zero_experts=-1), "zero_experts must be a non-negative integer"),
    (dict(zero_experts=2, num_groups=4, group_topk=2), "zero-computation experts with group-limited routing"),
])
def test_bad_router_configs_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{"num_experts": 8, **bad})


@pytest.mark.feature("sparsemixer-training")
def test_sparsemixer_samples_each_choice_by_the_softmax_of_its_candidates():
    """Training's draws (sparsemixer_draws, from the framework's stream): the first choice falls on
    each candidate (the logits within the threshold of the top one) as often as its softmax says
    (the Gumbel-max property), never on an expert set aside; a non-top choice takes 1/3 of its
    weight unless its uniform draw passes 0.75 (a quarter of the time). 4,000 tokens of one row:
    within 5 standard deviations."""
    random.seed(11)
    moe = MoEConfig(num_experts=4, topk=2, load_balancing_type="sparsemixer_topk", norm_topk_prob=False,
                    sparsemixer_eps=0.5)
    # three candidates (within 2 x 0.5 of the top, relatively), the last far below it (set aside); spread
    # enough that noise other than Gumbel's (say, exponential) moves the frequencies by 3 tolerances
    row = np.array([2.0, 1.0, 0.2, -9.0], np.float32)
    tokens = 4000
    r = router.route(ops.tensor(np.tile(row, (tokens, 1))), moe, training=True)
    p = np.exp(row[:3] - row[:3].max())
    p /= p.sum()
    freq = np.bincount(r.experts[:, 0], minlength=4) / tokens
    assert freq[3] == 0
    np.testing.assert_allclose(freq[:3], p, atol=5 * np.sqrt(p * (1 - p) / tokens).max())
    weights = ops.to_numpy(r.weights)[:, 0]
    off_top = r.experts[:, 0] != 0
    full = np.isclose(weights[off_top], p[r.experts[off_top, 0]], rtol=1e-5)
    third = np.isclose(weights[off_top], p[r.experts[off_top, 0]] * 0.3333, rtol=1e-5)
    assert (full | third).all()
    assert abs(full.mean() - 0.25) < 5 * np.sqrt(0.25 * 0.75 / off_top.sum())
    # in evaluation the top two candidates, without draws
    r = router.route(ops.tensor(row[None]), moe)
    assert r.experts.tolist() == [[0, 1]]


@pytest.mark.feature("moe-zero-experts")
def test_zero_computation_experts_return_their_token_times_its_weight():
    """An MoE layer whose router prefers its two zero-computation experts (LongCat-Flash's): a token that
    chooses one gets itself times the weight beside its real experts' output; with every choice a zero
    expert the layer is the identity scaled by the summed weights; the real experts' gradients stay zero."""
    from mindspeed_core import autograd, nn
    from mindspeed_core.models.config import ModelConfig
    from mindspeed_core.models.moe import MoELayer

    moe = MoEConfig(num_experts=4, zero_experts=2, topk=2, score_function="softmax", norm_topk_prob=False,
                    scaling_factor=6.0, load_balancing_type="none")
    cfg = ModelConfig(hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, moe=moe)
    random.seed(2)
    layer = MoELayer(cfg, moe)
    weight = np.zeros((6, 16), np.float32)
    weight[4:] = 5.0  # both zero experts far ahead for a positive input
    nn.assign(layer.router.weight, weight)
    x = np.abs(np.random.default_rng(3).normal(1.0, 0.5, (1, 5, 16))).astype(np.float32)
    out, (grad,) = autograd.value_and_grad(lambda: ops.sum(layer(ops.tensor(x))), [layer.experts.weight1])()
    logits = (x @ weight.T).astype(np.float64)
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    want = x * 6.0 * scores[..., 4:].sum(-1, keepdims=True)  # the two zero experts' weights, scaled
    np.testing.assert_allclose(ops.to_numpy(layer(ops.tensor(x))), want, rtol=1e-5)
    assert layer.routing.tokens_per_expert[4:].tolist() == [5, 5] and not ops.to_numpy(grad).any()
