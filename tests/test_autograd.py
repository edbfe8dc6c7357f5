"""value_and_grad, vjp, custom Function, no_grad, detach and recompute."""

from __future__ import annotations

import numpy as np
import pytest

from mindspeed_core import autograd, nn, ops

W0 = np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)
X0 = np.array([[1.0, 2.0], [-1.0, 0.5], [2.0, 2.0]], np.float32)


def test_value_and_grad_matches_hand_derivation():
    w = nn.Parameter(W0)
    x = ops.tensor(X0)
    # loss = sum((x @ w)^2): d/dw = 2 x^T (x @ w)
    loss, (grad,) = autograd.value_and_grad(lambda x: ops.sum(ops.matmul(x, w) ** 2), [w])(x)
    np.testing.assert_allclose(float(ops.to_numpy(loss)), np.sum((X0 @ W0) ** 2), rtol=1e-6)
    np.testing.assert_allclose(ops.to_numpy(grad), 2 * X0.T @ (X0 @ W0), rtol=1e-5)


def test_value_and_grad_with_aux_and_unused_parameter():
    w, unused = nn.Parameter(W0), nn.Parameter(np.ones(3, np.float32))

    def fn(x):
        y = ops.matmul(x, w)
        return ops.sum(y), y

    (loss, aux), grads = autograd.value_and_grad(fn, [w, unused], has_aux=True)(ops.tensor(X0))
    np.testing.assert_allclose(ops.to_numpy(aux), X0 @ W0, rtol=1e-6)
    np.testing.assert_allclose(ops.to_numpy(grads[0]), np.tile(X0.sum(0)[:, None], (1, 2)), rtol=1e-6)
    np.testing.assert_array_equal(ops.to_numpy(grads[1]), np.zeros(3))


def test_vjp_gives_input_and_parameter_gradients():
    w = nn.Parameter(W0)
    ids = ops.tensor(np.array([0, 1, 1], np.int64))

    def stage(x, i):  # a pipeline stage: activations in, activations out
        # scaled so tanh does not saturate: MindSpore's CPU tanh is accurate to ~1e-5 only,
        # which its saturated gradient 1 - tanh^2 would amplify
        return ops.tanh(ops.matmul(x, w) * 0.25) * ops.cast(ops.unsqueeze(i, 1) + 1, "float32")

    out, backward = autograd.vjp(stage, [ops.tensor(X0), ids], [w])
    scale = np.array([1, 2, 2], np.float32)[:, None]
    np.testing.assert_allclose(ops.to_numpy(out), np.tanh(X0 @ W0 * 0.25) * scale, rtol=1e-4)
    cot = np.arange(6, dtype=np.float32).reshape(3, 2)
    (gx, gi), (gw,) = backward(ops.tensor(cot))
    inner = cot * scale * (1 - np.tanh(X0 @ W0 * 0.25) ** 2) * 0.25
    np.testing.assert_allclose(ops.to_numpy(gx), inner @ W0.T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ops.to_numpy(gw), X0.T @ inner, rtol=1e-4, atol=1e-5)
    assert gi is None  # integer inputs have no gradient


def test_vjp_with_several_outputs():
    out, backward = autograd.vjp(lambda a, b: (a * b, a + b), [ops.tensor(X0), ops.tensor(X0 * 2)])
    (ga, gb), params = backward((ops.tensor(np.ones_like(X0)), ops.tensor(np.full_like(X0, 3.0))))
    np.testing.assert_allclose(ops.to_numpy(ga), X0 * 2 + 3, rtol=1e-6)
    np.testing.assert_allclose(ops.to_numpy(gb), X0 + 3, rtol=1e-6)
    assert params == []


class ScaledIdentity(autograd.Function):
    """Forward is the identity; backward scales the gradient (like a TP region's operator)."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save(x)
        ctx.factor = 3.0
        return x * y

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved
        return grad * ctx.factor, grad * x


def _stage(w):
    """A pipeline stage with a random draw: replaying it must see the same draw."""
    def run(x):
        return ops.tanh(ops.matmul(x, w) * 0.25) * ops.dropout(ops.ones(x.shape[:1] + (2,)), 0.5, True)
    return run


def _pulled(out, backward, cot) -> list:
    (gx,), (gw,) = backward(cot)
    return [ops.to_numpy(out), ops.to_numpy(gx), ops.to_numpy(gw)]


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_interleaved_vjps_each_get_their_own_gradients(declared):
    from mindspeed_core import random

    w = nn.Parameter(W0)
    inputs = (X0, X0[::-1].copy())
    cot = ops.tensor(np.arange(6, dtype=np.float32).reshape(3, 2))
    random.seed(5)
    alone = [_pulled(*autograd.vjp(_stage(w), [ops.tensor(x)], [w]), cot) for x in inputs]
    random.seed(5)  # the same draws, both forwards before either backward (a pipeline stage)
    first = autograd.vjp(_stage(w), [ops.tensor(inputs[0])], [w], interleaved=declared)
    second = autograd.vjp(_stage(w), [ops.tensor(inputs[1])], [w])
    together = [_pulled(*first, cot), _pulled(*second, cot)]
    assert not np.array_equal(alone[0][0] != 0, alone[1][0] != 0)  # the two draws differ
    for a, t in zip(alone, together):
        for x, y in zip(a, t):
            np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-7)


def test_a_forward_run_again_at_its_backward_says_so(framework):
    """autograd.replaying(): MindSpore records an interleaved forward again at its backward, and
    code with side effects (the MoE, MTP and indexer logs) must see that run as a replay to count
    each micro-batch once; PyTorch keeps each graph and never runs a forward again."""
    seen = []

    def fn(x):
        seen.append(autograd.replaying())
        return x * 2.0

    x = ops.tensor(np.ones(3, np.float32))
    for interleaved in (False, True):
        seen.clear()
        out, backward = autograd.vjp(fn, [x], interleaved=interleaved)
        autograd.vjp(fn, [x])  # another forward before this backward
        seen.pop()
        (grad,), _ = backward(ops.ones_like(out))
        assert np.array_equal(ops.to_numpy(grad), np.full(3, 2.0, np.float32))
        assert seen == ([False, True] if framework == "mindspore" else [False]), (interleaved, seen)
    assert not autograd.replaying()


def test_interleaved_vjps_hold_no_memory_from_step_to_step():
    # MindSpore keeps a recorded forward that is never pulled back for the life of the process
    # (a pipeline's first stage grew by its activations every step until its forwards were
    # declared interleaved); here each forward saves ~32 MB, so a leak is ~64 MB per round
    from mindspeed_core.memory.accounting import _status

    w = nn.Parameter(np.full((512, 512), 0.5, np.float32))

    def stage(x):
        for _ in range(32):
            x = ops.tanh(x * w)
        return x

    def round_():
        out1, back1 = autograd.vjp(stage, [ops.tensor(np.ones((512, 512), np.float32))], [w], interleaved=True)
        out2, back2 = autograd.vjp(stage, [ops.tensor(np.ones((512, 512), np.float32))], [w], interleaved=True)
        for out, back in ((out1, back1), (out2, back2)):
            ops.to_numpy(back(ops.ones_like(out))[1][0])

    for _ in range(3):  # allocator pools settle
        round_()
    before = _status("VmRSS")
    for _ in range(6):
        round_()
    grown = _status("VmRSS") - before
    assert grown < 100 * 2**20, f"resident memory grew {grown / 2**20:.0f} MB over 6 rounds"


def test_custom_function_uses_its_backward():
    a = nn.Parameter(np.array([1.0, 2.0], np.float32))
    b = nn.Parameter(np.array([4.0, 5.0], np.float32))
    loss, (ga, gb) = autograd.value_and_grad(lambda: ops.sum(ScaledIdentity.apply(a, b)), [a, b])()
    np.testing.assert_allclose(float(ops.to_numpy(loss)), 14.0)
    np.testing.assert_allclose(ops.to_numpy(ga), [3.0, 3.0])  # not b, which autograd would give
    np.testing.assert_allclose(ops.to_numpy(gb), [1.0, 2.0])


def test_custom_function_in_several_calls_keeps_contexts_apart():
    a = nn.Parameter(np.array([1.0, 2.0], np.float32))

    def loss():
        first = ScaledIdentity.apply(a, ops.tensor(np.array([1.0, 1.0], np.float32)))
        second = ScaledIdentity.apply(a * 2, ops.tensor(np.array([1.0, 1.0], np.float32)))
        return ops.sum(first + second)

    _, (ga,) = autograd.value_and_grad(loss, [a])()
    np.testing.assert_allclose(ops.to_numpy(ga), [9.0, 9.0])  # 3 + 3 * 2


def test_no_grad_and_detach():
    w = nn.Parameter(W0)
    with autograd.no_grad():
        y = ops.matmul(ops.tensor(X0), w)
    np.testing.assert_allclose(ops.to_numpy(y), X0 @ W0, rtol=1e-6)

    def fn():
        return ops.sum(ops.matmul(ops.tensor(X0), w) * autograd.detach(w[0:1, :]))

    _, (g,) = autograd.value_and_grad(fn, [w])()
    # only the first factor carries gradient: d/dw sum((x@w) * w0) = x^T broadcast w0
    np.testing.assert_allclose(ops.to_numpy(g), X0.sum(0)[:, None] * W0[0:1, :], rtol=1e-6)


@pytest.mark.parametrize("nested", [False, True])
def test_recompute_gives_the_same_gradients(nested):
    w = nn.Parameter(W0)
    x = ops.tensor(X0)

    def block(h):
        return ops.tanh(ops.matmul(h, w))

    def plain():
        return ops.sum(block(block(x)) if nested else block(x))

    def recomputed():
        h = autograd.recompute(block, x)
        return ops.sum(autograd.recompute(block, h) if nested else h)

    l1, (g1,) = autograd.value_and_grad(plain, [w])()
    l2, (g2,) = autograd.value_and_grad(recomputed, [w])()
    np.testing.assert_allclose(ops.to_numpy(l1), ops.to_numpy(l2), rtol=1e-6)
    np.testing.assert_allclose(ops.to_numpy(g1), ops.to_numpy(g2), rtol=1e-6)


@pytest.mark.parametrize("kind", ["value_and_grad", "vjp", "recompute"])
def test_grad_hooks_see_each_parameter_total_once_before_backward_returns(kind):
    """autograd.grad_hooks: the callback gets params[k]'s whole gradient (w is used twice),
    once, during the backward; after the block no hook is left (what --overlap-grad-reduce
    starts its reductions from)."""
    w = nn.Parameter(np.array([1.0, 2.0, 3.0], np.float32))
    v = nn.Parameter(np.array([0.5, -1.0, 2.0], np.float32))
    x = ops.tensor(np.array([1.0, -2.0, 0.5], np.float32))

    def block(x):
        return ops.sum(x * w) * ops.sum(x * v)

    def f(x):
        inner = autograd.recompute(block, x) if kind == "recompute" else block(x)
        return inner + ops.sum(w * w)

    seen = []
    with autograd.grad_hooks([w, v], lambda k, g: seen.append((k, ops.to_numpy(g).copy()))):
        if kind == "vjp":
            _, backward = autograd.vjp(f, [x], [w, v])
            grads = backward(ops.ones(()))[1]
        else:
            grads = autograd.value_and_grad(f, [w, v])(x)[1]
    assert sorted(k for k, _ in seen) == [0, 1]
    for k, g in seen:
        np.testing.assert_array_equal(g, ops.to_numpy(grads[k]))
    a, b = float(np.dot([1.0, -2.0, 0.5], [1.0, 2.0, 3.0])), float(np.dot([1.0, -2.0, 0.5], [0.5, -1.0, 2.0]))
    np.testing.assert_allclose(dict(seen)[0], np.array([1.0, -2.0, 0.5]) * b + 2 * np.array([1.0, 2.0, 3.0]), rtol=1e-6)
    np.testing.assert_allclose(dict(seen)[1], np.array([1.0, -2.0, 0.5]) * a, rtol=1e-6)
    seen.clear()
    autograd.value_and_grad(f, [w, v])(x)
    assert seen == []
