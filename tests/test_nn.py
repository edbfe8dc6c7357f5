"""Modules, parameters, names, state dicts and initializers."""

from __future__ import annotations

import numpy as np
import pytest

from mindspeed_core import autograd, nn, ops, random
from mindspeed_core.errors import CheckpointError


class Dense(nn.Module):
    def __init__(self, n_in, n_out, bias=True):
        super().__init__()
        self.weight = nn.Parameter(np.zeros((n_out, n_in), np.float32))
        self.bias = nn.Parameter(np.zeros(n_out, np.float32)) if bias else None
        nn.init.xavier_uniform_(self.weight)

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(np.ones(3, np.float32))
        self.inp = Dense(4, 3)
        self.layers = nn.ModuleList([Dense(3, 3), Dense(3, 3, bias=False)])

    def forward(self, x, double=False):
        x = self.inp(x) * self.scale
        for layer in self.layers:
            x = ops.relu(layer(x))
        return x * 2 if double else x


EXPECTED_NAMES = ["scale", "inp.weight", "inp.bias", "layers.0.weight", "layers.0.bias", "layers.1.weight"]


def test_dotted_names_are_identical_on_both_frameworks():
    net = Net()
    assert [n for n, _ in nn.named_parameters(net)] == EXPECTED_NAMES
    assert len(nn.parameters(net)) == len(EXPECTED_NAMES)
    assert all(nn.is_parameter(p) for p in nn.parameters(net))
    assert list(nn.state_dict(net)) == EXPECTED_NAMES


def test_forward_with_keyword_arguments():
    net = Net()
    x = ops.tensor(np.ones((2, 4), np.float32))
    np.testing.assert_allclose(ops.to_numpy(net(x, double=True)), 2 * ops.to_numpy(net(x)), rtol=1e-6)


def test_initializers_give_the_same_weights_on_both_frameworks():
    # The values come from numpy's PCG64 seeded with the facade seed, so they can be
    # predicted here without any framework: equal to this, equal across frameworks.
    random.seed(1234)
    p = nn.Parameter(np.zeros((6, 4), np.float32))
    nn.init.normal_(p, std=0.02)
    q = nn.Parameter(np.zeros((6, 4), np.float32))
    nn.init.xavier_uniform_(q)
    gen = np.random.Generator(np.random.PCG64(1234))
    np.testing.assert_array_equal(ops.to_numpy(p), gen.normal(0.0, 0.02, (6, 4)).astype(np.float32))
    bound = np.sqrt(6.0 / (4 + 6))
    np.testing.assert_array_equal(ops.to_numpy(q), gen.uniform(-bound, bound, (6, 4)).astype(np.float32))
    random.seed(1234)
    again = nn.Parameter(np.zeros((6, 4), np.float32))
    nn.init.normal_(again, std=0.02)
    np.testing.assert_array_equal(ops.to_numpy(again), ops.to_numpy(p))


def test_constant_initializers():
    p = nn.Parameter(np.full((2, 3), 5.0, np.float32))
    nn.init.zeros_(p)
    np.testing.assert_array_equal(ops.to_numpy(p), 0)
    nn.init.ones_(p)
    np.testing.assert_array_equal(ops.to_numpy(p), 1)
    nn.init.constant_(p, 0.5)
    np.testing.assert_array_equal(ops.to_numpy(p), 0.5)
    nn.init.uniform_(p, -1, 1)
    assert np.all(np.abs(ops.to_numpy(p)) <= 1) and len(np.unique(ops.to_numpy(p))) == 6
    nn.init.xavier_normal_(p)
    assert np.std(ops.to_numpy(p)) > 0
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        nn.init.xavier_uniform_(nn.Parameter(np.zeros(3, np.float32)))


def test_state_dict_round_trip_and_errors():
    random.seed(1)
    a, b = Net(), Net()
    state = nn.state_dict(a)
    nn.load_state_dict(b, state)
    for (n1, p1), (n2, p2) in zip(nn.named_parameters(a), nn.named_parameters(b)):
        assert n1 == n2
        np.testing.assert_array_equal(ops.to_numpy(p1), ops.to_numpy(p2))
    before = nn.state_dict(b)
    bad = dict(state)
    bad["inp.weight"] = np.zeros((9, 9), np.float32)
    bad.pop("scale")
    bad["extra"] = np.zeros(1, np.float32)
    with pytest.raises(CheckpointError) as info:
        nn.load_state_dict(b, bad)
    text = str(info.value)
    assert "missing: scale" in text and "unexpected: extra" in text and "inp.weight" in text
    for name, value in nn.state_dict(b).items():  # a failed load changes nothing
        np.testing.assert_array_equal(value, before[name])
    partial = {"scale": np.full(3, 7.0, np.float32)}
    nn.load_state_dict(b, partial, strict=False)
    np.testing.assert_array_equal(nn.state_dict(b)["scale"], 7.0)


def test_assign_checks_shape_and_keeps_dtype():
    p = nn.Parameter(ops.tensor(np.zeros((2, 2)), dtype="float32"))
    nn.assign(p, np.arange(4, dtype=np.float64).reshape(2, 2))
    assert ops.dtype_of(p) == "float32"
    np.testing.assert_array_equal(ops.to_numpy(p), np.arange(4).reshape(2, 2))
    nn.assign(p, ops.tensor(np.ones((2, 2))))
    np.testing.assert_array_equal(ops.to_numpy(p), 1)
    with pytest.raises(ValueError, match="cannot assign"):
        nn.assign(p, np.zeros(3))


def test_frozen_parameters_and_training_mode():
    net = Net()
    nn.set_requires_grad(net.scale, False)
    assert not nn.requires_grad(net.scale) and nn.requires_grad(net.inp.weight)
    trainable = [p for p in nn.parameters(net) if nn.requires_grad(p)]
    assert len(trainable) == len(EXPECTED_NAMES) - 1
    x = ops.tensor(np.ones((2, 4)))
    loss, grads = autograd.value_and_grad(lambda: ops.sum(net(x)), trainable)()
    assert len(grads) == len(trainable)
    assert nn.is_training(net) and nn.is_training(net.inp)  # modules start in training mode
    nn.set_training(net, False)
    assert not nn.is_training(net) and not nn.is_training(net.inp)
    nn.set_training(net, True)
    assert nn.is_training(net)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_cast_parameters_in_place(dtype):
    net = Net()
    before = nn.state_dict(net)
    nn.cast_parameters(net, dtype)
    assert {ops.dtype_of(p) for p in nn.parameters(net)} == {dtype}
    assert [n for n, _ in nn.named_parameters(net)] == EXPECTED_NAMES
    for name, value in nn.state_dict(net).items():
        np.testing.assert_allclose(value, before[name], rtol=1e-2, atol=1e-3)


def test_forward_pre_hook_runs_before_each_forward_until_removed():
    net = Net()
    seen = []
    handle = nn.forward_pre_hook(net.layers[1], lambda module: seen.append(module is net.layers[1]))
    x = ops.tensor(np.ones((2, 4), np.float32))
    net(x)
    # what the hook writes into the parameters is what the forward uses (--overlap-param-gather)
    nn.forward_pre_hook(net.layers[0], lambda module: nn.assign(module.weight, np.zeros((3, 3), np.float32)))
    out = ops.to_numpy(net(x))
    assert seen == [True, True]
    np.testing.assert_array_equal(out, np.zeros_like(out))  # relu(0 * x + 0 bias) then layer 1: zeros
    handle.remove()
    net(x)
    assert seen == [True, True]
