"""AdamW: the facade's fused step (the device's kernel) against a float64 reference of
torch.optim.AdamW's formula, against the composite, and through both optimizers
(replicated and distributed) over several steps with clipping and mixed weight decay."""

from __future__ import annotations

import numpy as np
import pytest

import numeric as R
from mindspeed_core import composite, nn, ops
from mindspeed_core.training.distributed_optimizer import DistributedAdamW
from mindspeed_core.training.optimizer import AdamW

SHAPES = [(6, 4), (4,), (3, 5, 2), (7,)]
LR, BETAS, EPS = 3e-2, (0.9, 0.95), 1e-6
DECAYS = [0.1, 0.0, 0.1, 0.0]


def reference(weights, grads_per_step, decays, lrs):
    """AdamW in float64: w <- w (1 - lr wd) - lr/c1 m / (sqrt(v / c2) + eps)."""
    w = [np.asarray(x, np.float64).copy() for x in weights]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    b1, b2 = BETAS
    for t, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        for i, g in enumerate(grads):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            w[i] = w[i] * (1 - lr * decays[i]) - lr / c1 * m[i] / (np.sqrt(v[i] / c2) + EPS)
    return w, m, v


def _problem(steps=5):
    g = R.rng(11)
    weights = [g.standard_normal(s).astype(np.float32) for s in SHAPES]
    grads = [[g.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(steps)]
    # one step at lr 0 (a warm-up's start, --lr 0): the moments move, the weights do not
    return weights, grads, [0.0 if t == 2 else LR * (1 - 0.1 * t) for t in range(steps)]


def _close(actual, expected, rtol=1e-6):
    for a, e in zip(actual, expected):
        a = np.asarray(ops.to_numpy(a) if ops.is_tensor(a) else a, np.float64)
        scale = max(np.abs(e).max(), 1e-3)
        assert np.abs(a - e).max() <= rtol * scale, (np.abs(a - e).max(), scale)


BOUND = pytest.param("bound", marks=pytest.mark.feature("fused-adamw"))


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("impl", [BOUND, "composite"])
def test_adamw_step_matches_the_float64_reference(impl, layout, framework):
    """``strided``: the 2-D and 3-D gradients and first moments are column-major while the
    weights and second moments are row-major (a transposed gradient, a column slice of a
    loaded moment); torch's CPU kernel walked them all in one layout and updated the wrong
    elements until the binding made its inputs contiguous."""
    if impl == "bound":
        assert ops.implementations()["adamw_step"] == "native"  # the matrix says supported on both
    step_fn = ops.adamw_step if impl == "bound" else composite.adamw_step
    weights, grads, lrs = _problem()
    ew, em, ev = reference(weights, grads, DECAYS, lrs)  # before: ops.tensor may share the arrays' memory

    def make(x, column_major=False):
        t = ops.tensor(np.asfortranarray(x) if column_major and layout == "strided" else x)
        if column_major and layout == "strided" and x.ndim > 1 and framework == "pytorch":
            assert not t.is_contiguous()  # torch keeps numpy's layout (MindSpore copies into its own)
        return t

    w = [make(x) for x in weights]
    m = [make(np.zeros_like(x), column_major=True) for x in weights]
    v = [make(np.zeros_like(x)) for x in weights]
    for t, (gs, lr) in enumerate(zip(grads, lrs), start=1):
        w, m, v = step_fn(w, [make(x, column_major=True) for x in gs], m, v, lr, BETAS[0], BETAS[1], EPS, DECAYS, t)
    _close(w, ew)
    _close(m, em)
    _close(v, ev)
    if impl == "bound":
        from mindspeed_core import features

        features.note_used("fused-adamw")  # the kernel ran above (the optimizers note it too)


def _named(weights):
    names = ["layer.weight", "norm.weight", "proj.weight", "proj.bias"]  # 1-D and biases: no decay
    return [(n, nn.Parameter(ops.tensor(w))) for n, w in zip(names, weights)]


@pytest.mark.feature("fused-adamw")
@pytest.mark.parametrize("kind", ["AdamW", "DistributedAdamW"])
def test_optimizers_take_the_reference_steps(kind):
    from mindspeed_core.parallel import state as parallel_state

    weights, grads, lrs = _problem()
    named = _named(weights)
    if kind == "AdamW":
        opt = AdamW(named, LR, weight_decay=0.1, betas=BETAS, eps=EPS)
    else:
        ps = parallel_state.initialize()
        from mindspeed_core.parallel.plan import ParallelPlan, ParamPlan

        plan = ParallelPlan([ParamPlan(n, None) for n, _ in named])
        opt = DistributedAdamW(named, LR, 0.1, BETAS, EPS, ps, plan)
    scale = 0.5  # a clip coefficient
    for gs, lr in zip(grads, lrs):
        g = [ops.tensor(x) for x in gs]
        opt.step(opt.prepare(g) if kind == "DistributedAdamW" else g, lr, scale)
    decays = [0.1 if len(s) > 1 else 0.0 for s in SHAPES]
    expected, _, _ = reference(weights, [[x * scale for x in gs] for gs in grads], decays, lrs)
    _close([p for _, p in named], expected)


@pytest.mark.feature("fused-adamw")
def test_adamw_equals_torch_optim_adamw():
    import torch  # the reference, on either framework

    weights, grads, lrs = _problem()
    named = _named(weights)
    ours = AdamW(named, LR, weight_decay=0.1, betas=BETAS, eps=EPS)
    theirs = [torch.nn.Parameter(torch.tensor(w)) for w in weights]
    groups = [{"params": [p], "weight_decay": 0.1 if p.dim() > 1 else 0.0} for p in theirs]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=False)
    for gs, lr in zip(grads, lrs):
        ours.step([ops.tensor(x) for x in gs], lr)
        for p, x in zip(theirs, gs):
            p.grad = torch.tensor(x)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    for (_, p), q in zip(named, theirs):
        np.testing.assert_allclose(ops.to_numpy(p), q.detach().numpy(), rtol=1e-6, atol=1e-7)
