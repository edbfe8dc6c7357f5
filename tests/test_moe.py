"""The mixture-of-experts MLP (models/moe.py) on one device: its output is each token's
weighted sum over its experts' MLPs (plus the shared expert) computed token by token in
numpy; the grouped-matmul and sequential expert paths agree in outputs and gradients,
also when an expert receives no token and when assignments are dropped over capacity."""

from __future__ import annotations

import numpy as np
import pytest

from mindspeed_core import autograd, nn, ops, random
from mindspeed_core.models.config import ModelConfig, MoEConfig
from mindspeed_core.models.moe import MoELayer

CFG = ModelConfig(hidden_size=16, num_layers=2, num_attention_heads=2, ffn_hidden_size=24)


def _silu(x):
    return x / (1 + np.exp(-x))


def reference(layer: MoELayer, x: np.ndarray) -> np.ndarray:
    """Token by token: sum over its kept assignments of weight x expert MLP, plus the shared."""
    r = layer.routing
    w1, w2 = (ops.to_numpy(p).astype(np.float64) for p in (layer.experts.weight1, layer.experts.weight2))
    weights = ops.to_numpy(r.weights).astype(np.float64)
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out = np.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j, e in enumerate(r.experts[t]):
            if r.kept[t, j]:
                h = flat[t] @ w1[e]
                gate, up = np.split(h, 2)
                out[t] += weights[t, j] * ((_silu(gate) * up) @ w2[e])
    if layer.shared_experts is not None:
        s = layer.shared_experts
        fc1, fc2 = (ops.to_numpy(p).astype(np.float64) for p in (s.linear_fc1.weight, s.linear_fc2.weight))
        gate, up = np.split(flat @ fc1.T, 2, axis=-1)
        y = (_silu(gate) * up) @ fc2.T
        if s.gate_weight is not None:
            y = y / (1 + np.exp(-(flat @ ops.to_numpy(s.gate_weight).astype(np.float64).T)))
        out += y
    return out.reshape(x.shape)


LAYERS = {
    "mixtral": MoEConfig(num_experts=4, topk=2),
    "qwen2-moe-shared-gated": MoEConfig(num_experts=4, topk=2, norm_topk_prob=False, shared_expert_size=20,
                                        shared_expert_gate=True),
    "capacity": MoEConfig(num_experts=4, topk=2, capacity_factor=0.5),
}


def _layer(name):
    random.seed(5)
    return MoELayer(CFG, LAYERS[name])


@pytest.mark.parametrize("name", list(LAYERS))
def test_moe_layer_equals_token_by_token_reference(name):
    layer = _layer(name)
    x = np.random.default_rng(0).standard_normal((2, 6, 16)).astype(np.float32)
    got = ops.to_numpy(layer(ops.tensor(x)))
    np.testing.assert_allclose(got, reference(layer, x), rtol=1e-4, atol=1e-5)
    if name == "capacity":
        assert layer.routing.dropped > 0


def _run(layer, x, grouped):
    layer.grouped = grouped
    params = nn.parameters(layer)
    loss, grads = autograd.value_and_grad(lambda: ops.sum(layer(ops.tensor(x)) ** 2), params)()
    return ops.to_numpy(layer(ops.tensor(x))), [ops.to_numpy(g) for g in grads]


@pytest.mark.parametrize("name", ["mixtral", "capacity"])
def test_grouped_and_sequential_experts_agree(name):
    layer = _layer(name)
    x = np.random.default_rng(1).standard_normal((2, 6, 16)).astype(np.float32)
    out_g, grads_g = _run(layer, x, True)
    out_s, grads_s = _run(layer, x, False)
    np.testing.assert_allclose(out_g, out_s, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_g, grads_s):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_an_expert_without_tokens_gets_zero_gradient():
    layer = _layer("mixtral")
    x = np.abs(np.random.default_rng(2).standard_normal((1, 8, 16))).astype(np.float32)
    # positive inputs and a router favouring experts 0 and 1 by a wide margin
    router_w = np.zeros((4, 16), np.float32)
    router_w[0], router_w[1] = 2.0, 1.0
    state = dict(nn.state_dict(layer))  # numpy arrays
    nn.load_state_dict(layer, {**state, "router.weight": router_w})
    for grouped in (True, False):
        out, grads = _run(layer, x, grouped)
        assert layer.routing.tokens_per_expert.tolist() == [8, 8, 0, 0]
        names = [n for n, _ in nn.named_parameters(layer)]
        g1 = grads[names.index("experts.weight1")]
        assert np.abs(g1[2:]).max() == 0 and np.abs(g1[:2]).max() > 0
        np.testing.assert_allclose(out, reference(layer, x), rtol=1e-4, atol=1e-5)
