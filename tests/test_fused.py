"""Fused operators: each against its float64 reference (values and gradients); where the
device binds a native kernel, that kernel against the composite (values and gradients); and
the --use-flash-attn / --use-fused-* switches, which make a model call the bound kernels
instead of the composites, with the same losses and gradients."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import numeric as R
from mindspeed_core import autograd, composite, device, nn, ops, runtime

g = R.rng(3)
X = g.standard_normal((2, 3, 8))
W = g.uniform(0.5, 1.5, 8)
BIAS = g.standard_normal(8)
Q = g.standard_normal((2, 5, 4, 8))
K = g.standard_normal((2, 5, 2, 8))
V = g.standard_normal((2, 5, 2, 8))
COS, SIN = R.rope_tables(5, 8)
BOOL_MASK = g.uniform(size=(5, 5)) > 0.3
np.fill_diagonal(BOOL_MASK, True)  # no fully masked row
ADD_MASK = g.standard_normal((5, 5))
SEGMENTS = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])  # packed documents per batch row


def _with_lse(out_and_lse, ops_=None):
    """One tensor whose gradient checks both outputs: out + the log-sum-exp on every feature."""
    out, lse = out_and_lse
    if ops_ is None:
        return out + lse[..., None]
    return out + ops_.unsqueeze(lse, -1)


# name -> (facade op name, call(fn, *tensors), reference, inputs, positions to differentiate)
CASES = {
    "rms_norm": ("rms_norm", lambda f, x, w: f(x, w, 1e-6), R.rms_norm, [X, W], (0, 1)),
    "layer_norm": ("layer_norm", lambda f, x, w, b: f(x, w, b, 1e-5), R.layer_norm, [X, W, BIAS],
                   (0, 1, 2)),
    "layer_norm_nobias": ("layer_norm", lambda f, x, w: f(x, w, None, 1e-5), R.layer_norm, [X, W], (0,)),
    "swiglu": ("swiglu", lambda f, x: f(x), R.swiglu, [X], (0,)),
    "apply_rotary": ("apply_rotary", lambda f, x, c, s: f(x, c, s), R.apply_rotary, [Q, COS, SIN], (0,)),
    "attention": ("attention", lambda f, q, k, v: f(q, k, v), R.attention, [Q, Q, Q], (0, 1, 2)),
    "attention_causal_gqa": ("attention", lambda f, q, k, v: f(q, k, v, causal=True),
                             lambda q, k, v: R.attention(q, k, v, causal=True), [Q, K, V], (0, 1, 2)),
    "attention_bool_mask": ("attention", lambda f, q, k, v, m: f(q, k, v, mask=m),
                            lambda q, k, v, m: R.attention(q, k, v, mask=m), [Q, K, V, BOOL_MASK], (0, 1, 2)),
    "attention_additive_mask_causal": (
        "attention", lambda f, q, k, v, m: f(q, k, v, causal=True, mask=m, scale=0.2),
        lambda q, k, v, m: R.attention(q, k, v, causal=True, mask=m, scale=0.2), [Q, K, V, ADD_MASK], (0, 1, 2)),
    "attention_causal_kv_prefix": (  # 2 new queries continuing a 5-key cache: bottom-right alignment
        "attention", lambda f, q, k, v: f(q, k, v, causal=True),
        lambda q, k, v: R.attention(q, k, v, causal=True), [Q[:, :2], K, V], (0, 1, 2)),
    "attention_packed_causal_gqa": (
        "attention", lambda f, q, k, v, s: f(q, k, v, causal=True, segment_ids=s),
        lambda q, k, v, s: R.attention(q, k, v, causal=True, segment_ids=s), [Q, K, V, SEGMENTS], (0, 1, 2)),
    "attention_lse_packed_causal_gqa": (
        "attention", lambda f, q, k, v, s: _with_lse(f(q, k, v, causal=True, segment_ids=s, return_lse=True), ops),
        lambda q, k, v, s: _with_lse(R.attention(q, k, v, causal=True, segment_ids=s, return_lse=True)),
        [Q, K, V, SEGMENTS], (0, 1, 2)),
    "attention_lse_bool_mask": (
        "attention", lambda f, q, k, v, m: _with_lse(f(q, k, v, mask=m, return_lse=True, scale=0.3), ops),
        lambda q, k, v, m: _with_lse(R.attention(q, k, v, mask=m, return_lse=True, scale=0.3)),
        [Q, K, V, BOOL_MASK], (0, 1, 2)),
    # Gemma 2's: a 2-key sliding window over a causal GQA attention, scores soft-capped at 1.5,
    # also over packed documents with the log-sum-exp (the ring's blocks), and for 2 new queries
    # continuing a 5-key cache
    "attention_window_softcap_gqa": (
        "attention", lambda f, q, k, v: f(q, k, v, causal=True, window=2, softcap=1.5, scale=0.4),
        lambda q, k, v: R.attention(q, k, v, causal=True, window=2, softcap=1.5, scale=0.4), [Q, K, V], (0, 1, 2)),
    "attention_window_lse_packed": (
        "attention", lambda f, q, k, v, s: _with_lse(f(q, k, v, causal=True, segment_ids=s, window=3, softcap=2.0,
                                                       return_lse=True), ops),
        lambda q, k, v, s: _with_lse(R.attention(q, k, v, causal=True, segment_ids=s, window=3, softcap=2.0,
                                                 return_lse=True)),
        [Q, K, V, SEGMENTS], (0, 1, 2)),
    "attention_window_kv_prefix": (
        "attention", lambda f, q, k, v: f(q, k, v, causal=True, window=3),
        lambda q, k, v: R.attention(q, k, v, causal=True, window=3), [Q[:, :2], K, V], (0, 1, 2)),
    "matmul_add": ("matmul_add", lambda f, a, b, c: f(a, b, c), lambda a, b, c: c + a @ b,
                   [g.standard_normal((3, 4)), g.standard_normal((4, 5)), g.standard_normal((3, 5))], (0, 1, 2)),
    # the diagonal and upper part are not read: filled with noise here
    "solve_unit_lower": ("solve_unit_lower", lambda f, a, b: f(a, b),
                         lambda a, b: np.linalg.solve(np.tril(a, -1) + np.eye(a.shape[-1]), b),
                         [0.3 * g.standard_normal((2, 7, 7)), g.standard_normal((2, 7, 3))], (0, 1)),
    "grouped_matmul": ("grouped_matmul", lambda f, x, w: f(x, w, [2, 0, 4]),
                       lambda x, w: np.concatenate([x[:2] @ w[0], x[2:6] @ w[2]]),
                       [g.standard_normal((6, 4)), g.standard_normal((3, 4, 5))], (0, 1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_matches_reference(name):
    op, call, ref, inputs, wrt = CASES[name]
    R.check_op(lambda *t: call(getattr(ops, op), *t), ref, inputs, wrt, rtol=2e-5, atol=2e-5)


def _values_and_grads(fn, arrays, wrt, dtype="float32"):
    tensors = [ops.tensor(a, dtype=dtype if np.asarray(a).dtype.kind == "f" else None) for a in arrays]
    params = [nn.Parameter(tensors[i]) for i in wrt]
    cot = ops.tensor(R.rng(5).standard_normal(np.shape(ops.to_numpy(fn(*tensors)))), dtype=dtype)

    def loss():
        args = list(tensors)
        for k, i in enumerate(wrt):
            args[i] = params[k]
        return ops.sum(ops.cast(fn(*args) * cot, "float32"))

    value = ops.to_numpy(fn(*tensors)).astype(np.float64)
    _, grads = autograd.value_and_grad(loss, params)()
    return value, [ops.to_numpy(g).astype(np.float64) for g in grads]


def _native_or_skip(op):
    if ops.implementations()[op] != "native":
        pytest.skip(f"no native kernel is bound for {op} on this device: the composite runs there")


@pytest.mark.parametrize("name", sorted(CASES))
def test_bound_kernel_agrees_with_composite(name):
    op, call, _, inputs, wrt = CASES[name]
    _native_or_skip(op)
    assert inspect.unwrap(getattr(ops, op)) is not getattr(composite, op)
    got, got_grads = _values_and_grads(lambda *t: call(getattr(ops, op), *t), inputs, wrt)
    want, want_grads = _values_and_grads(lambda *t: call(getattr(composite, op), *t), inputs, wrt)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for i, (a, b) in zip(wrt, zip(got_grads, want_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"gradient of input {i}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_norm_agrees_with_composite(dtype):
    if not device.supports_dtype(dtype):
        pytest.skip(f"{dtype} math is not available on this device (the matrix marks it unsupported)")
    _native_or_skip("rms_norm")
    x, w = ops.tensor(X, dtype=dtype), ops.tensor(W, dtype=dtype)
    bound, comp = ops.to_numpy(ops.rms_norm(x, w)), ops.to_numpy(composite.rms_norm(x, w))
    np.testing.assert_allclose(bound, comp, rtol=1e-2, atol=1e-2)
    assert ops.dtype_of(ops.rms_norm(x, w)) == dtype


def _bf16_pair(plain, fp32, weight: np.ndarray, x: np.ndarray):
    """A layer and its float32-switched twin holding ``weight``: the same output in float32,
    then both cast to bf16 (skipped where bf16 math is not available); returns (x in bf16, x and
    the weight as float64 of their bf16 values)."""
    for layer in (plain, fp32):
        nn.assign(layer.weight, ops.tensor(weight))
    assert np.array_equal(ops.to_numpy(plain(ops.tensor(x))), ops.to_numpy(fp32(ops.tensor(x))))
    if not device.supports_dtype("bfloat16"):
        pytest.skip("bfloat16 math is not available on this device (the matrix marks it unsupported)")
    for layer in (plain, fp32):
        nn.cast_parameters(layer, "bfloat16")
    xb = ops.tensor(x, dtype="bfloat16")
    return (xb, *(ops.to_numpy(ops.cast(t, "float32")).astype(np.float64) for t in (xb, fp32.weight)))


def test_rmsnorm_weight_in_fp32_scales_before_the_cast():
    """--rmsnorm-weight-in-fp32 (MindSpeed-LLM's): in bf16 the normed input times the (bf16) weight
    in float32, then cast (one rounding), where the default casts the normed input first and scales
    in bf16 (two); in float32 both are the same arithmetic."""
    from mindspeed_core.models.layers import RMSNorm

    plain, fp32 = RMSNorm(8, 1e-6), RMSNorm(8, 1e-6, weight_float32=True)
    xb, x64, w64 = _bf16_pair(plain, fp32, (W * 3.1).astype(np.float32), X.astype(np.float32))
    exact = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w64
    errors = {}
    for name, norm in (("fp32", fp32), ("plain", plain)):
        out = norm(xb)
        assert ops.dtype_of(out) == "bfloat16"
        errors[name] = float(np.abs(ops.to_numpy(ops.cast(out, "float32")) - exact).mean())
    assert errors["fp32"] < errors["plain"], errors  # one rounding, not two


def test_router_gating_in_fp32_computes_the_logits_in_float32():
    """--router-gating-in-fp32 (MindSpeed-LLM's): in bf16 the router's logits are a float32 linear
    of the (bf16) input and weight, one rounding off the exact product, where the default's bf16
    linear rounds them to bf16; in float32 both are the same arithmetic."""
    from mindspeed_core.models.moe import Router

    rng = np.random.default_rng(5)
    plain, fp32 = Router(16, 4, 0.02, False), Router(16, 4, 0.02, False, float32=True)
    xb, x64, w64 = _bf16_pair(plain, fp32, rng.normal(size=(4, 16)).astype(np.float32),
                              rng.normal(size=(6, 16)).astype(np.float32))
    exact = x64 @ w64.T
    got = {name: ops.to_numpy(ops.cast(r(xb), "float32")) for name, r in (("fp32", fp32), ("plain", plain))}
    assert ops.dtype_of(fp32(xb)) == "float32"
    assert np.abs(got["fp32"] - exact).max() < 1e-5 * np.abs(exact).max() < np.abs(got["plain"] - exact).max()


# flag -> (ModelConfig.fused entry, feature id)
SWITCHES = {
    "--use-flash-attn": ("attention", "flash-attention"),
    "--use-fused-rmsnorm": ("rms_norm", "fused-rmsnorm"),
    "--use-fused-swiglu": ("swiglu", "fused-swiglu"),
    "--use-fused-rotary-pos-emb": ("rope", "fused-rope"),
}


def _model_loss_and_grads(fused, **overrides):
    from mindspeed_core import random
    from mindspeed_core.models.config import ModelConfig
    from mindspeed_core.models.gpt import GPTModel

    random.seed(7)
    cfg = ModelConfig(**{**dict(vocab_size=40, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=48, max_position_embeddings=16, qk_layernorm=True), **overrides},
                      fused=fused)
    model = GPTModel(cfg)
    ids = ops.tensor(R.rng(2).integers(0, 40, (2, 12)))
    params = nn.parameters(model)
    loss, grads = autograd.value_and_grad(lambda: model.loss(ids, ids), params)()
    return float(ops.to_numpy(loss)), [ops.to_numpy(g) for g in grads]


def _assert_same_training_math(fused, **overrides):
    loss, grads = _model_loss_and_grads(fused, **overrides)
    ref_loss, ref_grads = _model_loss_and_grads(frozenset(), **overrides)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("flag", [pytest.param(f, marks=pytest.mark.feature(SWITCHES[f][1])) for f in SWITCHES])
def test_fused_switch_runs_the_bound_kernel_with_the_same_math(flag):
    """The switch makes the model call ops.<op> (native where the device has a kernel) and
    the loss and every gradient stay those of the composite model."""
    _assert_same_training_math(frozenset({SWITCHES[flag][0]}))


@pytest.mark.feature("fused-layernorm")
def test_layernorm_models_run_the_bound_layer_norm():
    """A LayerNorm model's norms are the bound ops.layer_norm: their gradients (of input, weight
    and bias, through the model's own module) are a float64 layer norm's finite differences, and
    the model's logits a float64 numpy model's."""
    from mindspeed_core import random
    from mindspeed_core.models.config import ModelConfig
    from mindspeed_core.models.gpt import GPTModel

    random.seed(5)
    cfg = ModelConfig(vocab_size=40, hidden_size=8, num_layers=2, num_attention_heads=2, ffn_hidden_size=16,
                      max_position_embeddings=16, normalization="layernorm", activation="gelu")
    model = GPTModel(cfg)
    state = {k: R.rng(len(k)).uniform(0.5, 1.5, np.shape(v)) if k.endswith("layernorm.weight") else
             R.rng(len(k)).standard_normal(np.shape(v)) * (0.3 if k.endswith("layernorm.bias") else 1.0)
             if "layernorm" in k else v for k, v in nn.state_dict(model).items()}
    nn.load_state_dict(model, {k: np.asarray(v, np.float32) for k, v in state.items()})
    norm = model.decoder.final_layernorm
    x = nn.Parameter(ops.tensor(X.astype(np.float32)))
    cot = R.rng(4).standard_normal(X.shape)
    _, grads = autograd.value_and_grad(lambda: ops.sum(norm(x) * ops.tensor(cot.astype(np.float32))),
                                       [x, norm.weight, norm.bias])()
    f64 = [X.astype(np.float64), np.asarray(state["decoder.final_layernorm.weight"], np.float64),
           np.asarray(state["decoder.final_layernorm.bias"], np.float64)]
    for i, grad in enumerate(grads):
        want = R.numeric_grad(lambda *a: float(np.sum(R.layer_norm(*a, cfg.norm_epsilon) * cot)), f64, i)
        np.testing.assert_allclose(ops.to_numpy(grad).astype(np.float64), want, rtol=2e-3, atol=2e-4,
                                   err_msg=f"gradient {i}")
    ids = R.rng(2).integers(0, 40, 12)
    got = ops.to_numpy(model(ops.tensor(ids[None])))[0].astype(np.float64)
    want = R.gpt_logits(state, cfg, ids)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_matrix_cells_of_fused_ops_say_what_runs_here():
    """supported where a native kernel is bound on this device, emulated where the composite runs."""
    from conftest import DEVICE, FRAMEWORK
    from mindspeed_core import features

    rows = {"flash-attention": "attention", "fused-rmsnorm": "rms_norm", "fused-layernorm": "layer_norm",
            "fused-swiglu": "swiglu", "fused-rope": "apply_rotary"}
    kinds = ops.implementations()
    for fid, op in rows.items():
        want = "supported" if kinds[op] == "native" else "emulated"
        assert features.get(fid).status(FRAMEWORK, DEVICE).kind == want, (fid, kinds[op])


def test_implementations_cover_every_fused_op():
    kinds = ops.implementations()
    assert set(kinds) == set(composite.FUSED)
    assert set(kinds.values()) <= {"native", "composite"}
    stand_ins = {}  # composites a backend rewrote with a hand-written backward (same math, faster)
    if runtime.bound().NAME == "mindspore":
        from mindspeed_core.backends.mindspore import kernels

        stand_ins = kernels.KERNELS
    for name, kind in kinds.items():
        bound = inspect.unwrap(getattr(ops, name))  # the test harness wraps facade names to record their use
        composite_fn = stand_ins.get(name, getattr(composite, name))
        assert (bound is composite_fn) == (kind == "composite"), name


def test_attention_dropout_is_unbiased():
    from mindspeed_core import random

    random.seed(11)
    q, k, v = ops.tensor(Q[:1, :3, :2]), ops.tensor(K[:1, :3, :1]), ops.tensor(V[:1, :3, :1])
    plain = ops.to_numpy(ops.attention(q, k, v))
    draws = np.stack([ops.to_numpy(ops.attention(q, k, v, dropout_p=0.3)) for _ in range(400)])
    assert not np.allclose(draws[0], plain)  # dropout did something
    # Inverted dropout keeps the expectation: the mean over draws is the plain result up to
    # sampling error (5 standard errors per element).
    stderr = draws.std(0) / np.sqrt(len(draws))
    assert np.all(np.abs(draws.mean(0) - plain) <= 5 * stderr + 1e-4)


def test_grouped_matmul_rejects_bad_sizes():
    x, w = ops.tensor(np.ones((4, 2))), ops.tensor(np.ones((2, 2, 3)))
    with pytest.raises(ValueError, match="add up to"):
        ops.grouped_matmul(x, w, [1, 2])
    with pytest.raises(ValueError, match="group sizes for"):
        ops.grouped_matmul(x, w, [4])


def test_attention_rejects_incompatible_heads():
    with pytest.raises(ValueError, match="multiple"):
        ops.attention(ops.tensor(Q[:, :, :3]), ops.tensor(K), ops.tensor(V))


@pytest.mark.parametrize("impl", ["bound", "composite"])
def test_attention_lse_of_a_row_that_sees_nothing_is_finite(impl):
    """A query with no visible key (a key block from another document, in a merge) gets a
    log-sum-exp near -1e30 and no NaN, in values or gradients."""
    fn = ops.attention if impl == "bound" else composite.attention
    mask = np.ones((5, 5), bool)
    mask[1] = False
    q, k, v = (nn.Parameter(ops.tensor(a)) for a in (Q, K, V))

    def loss():
        out, lse = fn(q, k, v, mask=ops.tensor(mask), return_lse=True)
        weight = ops.exp(lse - ops.amax(lse, dim=1, keepdim=True))  # 0 for the hidden row, as in a merge
        return ops.sum(out * ops.unsqueeze(weight, -1))

    value, grads = autograd.value_and_grad(loss, [q, k, v])()
    lse = ops.to_numpy(fn(ops.tensor(Q), ops.tensor(K), ops.tensor(V), mask=ops.tensor(mask), return_lse=True)[1])
    assert (lse[:, 1] < -1e29).all() and np.isfinite(lse).all()
    assert np.isfinite(float(ops.to_numpy(value)))
    assert all(np.isfinite(ops.to_numpy(g)).all() for g in grads)
    assert np.abs(ops.to_numpy(grads[0])[:, 1]).max() == 0.0  # the hidden row has no influence


@pytest.mark.feature("squared-relu")
def test_squared_relu_mlp_is_relu_squared_on_an_ungated_first_layer():
    """--squared-relu (PLM's MLP, Megatron's activation): fc1 as wide as the MLP (no gate half),
    relu(x)^2 of its output; MindSpeed-LLM's --fc-type names the layout and must agree."""
    from mindspeed_core.models.config import ModelConfig
    from mindspeed_core.models.gpt import MLP
    from mindspeed_core.models.layers import activate

    h = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(ops.to_numpy(activate(ops.tensor(h), "squared_relu")), np.maximum(h, 0) ** 2,
                               rtol=1e-6)
    cfg = ModelConfig(hidden_size=16, ffn_hidden_size=24, num_attention_heads=2, activation="squared_relu")
    assert not cfg.gated and MLP(cfg).linear_fc1.weight.shape[0] == 24
