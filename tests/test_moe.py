"""The mixture-of-experts MLP (models/moe.py) on one device: its output is each token's
weighted sum over its experts' MLPs (plus the shared expert) computed token by token in
numpy; the grouped-matmul and sequential expert paths agree in outputs and gradients,
also when an expert receives no token and when assignments are dropped over capacity."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mindspeed_core import autograd, nn, ops, random
from mindspeed_core.models.config import ModelConfig, MoEConfig
from mindspeed_core.models.moe import MoELayer

CFG = ModelConfig(hidden_size=16, num_layers=2, num_attention_heads=2, ffn_hidden_size=24)


def _silu(x):
    return x / (1 + np.exp(-x))


def _glu(h, cfg: ModelConfig):
    """A gated MLP's activation: SwiGLU, or GPT-OSS's clamped quick-GEGLU with its offset."""
    gate, up = np.split(h, 2)
    if cfg.activation == "swiglu":
        return _silu(gate) * up
    c = cfg.activation_func_clamp_value
    gate, up = np.minimum(gate, c), np.clip(up, -c, c)
    return gate / (1 + np.exp(-1.702 * gate)) * (up + cfg.glu_linear_offset)


def reference(layer: MoELayer, x: np.ndarray, cfg: ModelConfig = CFG) -> np.ndarray:
    """Token by token: sum over its kept assignments of weight x expert MLP (with its biases
    when it has them), plus the shared."""
    r = layer.routing
    w1, w2 = (ops.to_numpy(p).astype(np.float64) for p in (layer.experts.weight1, layer.experts.weight2))
    b1, b2 = ((np.zeros((w1.shape[0], n)) if p is None else ops.to_numpy(p).astype(np.float64))
              for p, n in ((layer.experts.bias1, w1.shape[2]), (layer.experts.bias2, w2.shape[2])))
    weights = ops.to_numpy(r.weights).astype(np.float64)
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out = np.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j, e in enumerate(r.experts[t]):
            if r.kept[t, j]:
                out[t] += weights[t, j] * (_glu(flat[t] @ w1[e] + b1[e], cfg) @ w2[e] + b2[e])
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
    "capacity-padded": MoEConfig(num_experts=4, topk=2, capacity_factor=1.5, pad_to_capacity=True),
    "gpt-oss": MoEConfig(num_experts=4, topk=2),
}
# GPT-OSS's experts: biases on the router and both expert matrices, the quick-GEGLU with the
# linear half offset by one and both halves clamped (at 0.5: the O(1) weights below cross it)
CFGS = {"gpt-oss": ModelConfig(hidden_size=16, num_layers=2, num_attention_heads=2, ffn_hidden_size=24,
                               activation="quick_geglu", glu_linear_offset=1.0, activation_func_clamp_value=0.5,
                               add_bias_linear=True)}


def _layer(name):
    """The layer with O(1) weights drawn here: outputs and gradients far from rounding noise,
    and router scores whose top-k choice no last-bit difference can flip."""
    random.seed(5)
    layer = MoELayer(CFGS.get(name, CFG), LAYERS[name])
    g = np.random.default_rng(5)
    nn.load_state_dict(layer, {k: (g.standard_normal(v.shape) * 0.3).astype(np.float32)
                               for k, v in nn.state_dict(layer).items()})
    return layer


@pytest.mark.parametrize("name", list(LAYERS))
def test_moe_layer_equals_token_by_token_reference(name):
    layer = _layer(name)
    x = np.random.default_rng(0).standard_normal((2, 6, 16)).astype(np.float32)
    got = ops.to_numpy(layer(ops.tensor(x)))
    np.testing.assert_allclose(got, reference(layer, x, CFGS.get(name, CFG)), rtol=1e-4, atol=1e-5)
    if name == "capacity":
        assert layer.routing.dropped > 0


def _run(layer, x, grouped):
    layer.grouped = grouped
    params = nn.parameters(layer)
    loss, grads = autograd.value_and_grad(lambda: ops.sum(layer(ops.tensor(x)) ** 2), params)()
    return ops.to_numpy(layer(ops.tensor(x))), [ops.to_numpy(g) for g in grads]


@pytest.mark.parametrize("name", ["mixtral", "capacity", "capacity-padded", "gpt-oss"])
def test_grouped_and_sequential_experts_agree(name):
    layer = _layer(name)
    x = np.random.default_rng(1).standard_normal((2, 6, 16)).astype(np.float32)
    out_g, grads_g = _run(layer, x, True)
    out_s, grads_s = _run(layer, x, False)
    np.testing.assert_allclose(out_g, out_s, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_g, grads_s):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


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


@pytest.mark.multiprocess
@pytest.mark.feature("expert-parallel", "moe-alltoall-dispatcher", "moe-allgather-dispatcher", "collectives")
def test_expert_parallel_dispatch_equals_one_device(framework, tmp_path):
    import json
    import pathlib

    from launch import launch

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, output = launch(framework, 4, str(pathlib.Path(__file__).with_name("moe_worker.py")), [str(out_dir)],
                          str(tmp_path / "logs"), timeout=600)
    assert code == 0, output[-6000:]
    results = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    assert len(results) == 4, output[-6000:]
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["failures"]]
    assert failures == [], "\n".join(failures)
    # EP 2 and 4 x 2 dispatchers x 3 routings x (output, 2 gradients, 2 expert gradients, identity)
    assert all(sum(" got " not in c for c in res["checks"]) == 2 * 2 * 3 * 6 for res in results)
    # the skewed routing left ranks without a single row (EP=4: ranks 2 and 3, EP=2: rank 1)
    empty = [c for res in results for c in res["checks"] if c.endswith("got 0 rows")]
    assert len(empty) == 2 * (2 + 2 * 1), empty


# ---- training ------------------------------------------------------------------------------

from test_training import corpus, losses, train  # noqa: E402,F401  (corpus is a fixture)

MOE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
       "--ffn-hidden-size", "64", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
       "--lr", "3e-3", "--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "1",
       "--make-vocab-size-divisible-by", "8", "--no-progress", "--seed", "7", "--sample-tokens", "0",
       "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "0.001", "--first-k-dense-replace", "1"]


def _records(path):
    import json

    return [r for r in map(json.loads, open(path)) if "loss" in r]


@pytest.mark.feature("moe")
def test_moe_training_reports_its_routing(capsys, corpus, tmp_path):  # noqa: F811
    metrics = tmp_path / "m.jsonl"
    code, out, err = train(capsys, *MOE, "--data-path", corpus, "--train-iters", "8", "--metrics-file", str(metrics))
    assert code == 0, err
    records = _records(metrics)
    assert records[-1]["loss"] < records[0]["loss"]
    for r in records:  # layer 0 dense, layer 1 MoE: 4 sequences x 32 tokens, 2 experts each
        moe = r["moe"]
        assert len(moe["tokens_per_expert"]) == 1 and sum(moe["tokens_per_expert"][0]) == 4 * 32 * 2
        assert moe["aux_loss"] > 0 and moe["z_loss"] > 0 and moe["dropped"] == 0
        assert moe["load_balance"][0] == max(moe["tokens_per_expert"][0]) / (4 * 32 * 2 / 4)
    assert "aux loss" in out and "expert load max/mean" in out


def test_pai_megatron_aux_loss_routes_as_mindspeed_llm_whatever_the_router_flags_say(capsys, corpus):  # noqa: F811
    """MindSpeed-LLM's pai_megatron_aux_loss router takes the softmax over every expert and
    its top k as they are: DeepSeek-V2-Lite's script also passes groups, a scaling factor and a
    score function, which that router never reads, and neither does ours."""
    code, out, err = train(capsys, *MOE, "--data-path", corpus, "--moe-router-load-balancing-type",
                           "pai_megatron_aux_loss", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
                           "--moe-router-topk-scaling-factor", "2.5", "--moe-router-score-function", "sigmoid",
                           "--dry-run")
    assert code == 0, err
    moe = json.loads(out)["model"]["moe"]
    assert (moe["score_function"], moe["num_groups"], moe["group_topk"], moe["scaling_factor"],
            moe["norm_topk_prob"], moe["load_balancing_type"]) == ("softmax", None, None, 1.0, False, "aux_loss"), moe


@pytest.mark.feature("moe")
@pytest.mark.feature("gmm")
@pytest.mark.feature("matmul-add")
def test_grouped_gemm_trains_as_expert_by_expert(capsys, corpus, tmp_path):  # noqa: F811
    """--moe-grouped-gemm within float32 rounding of expert by expert; with
    --gemm-gradient-accumulation-fusion on top (the weight gradients computed in fp32 into sinks
    of their own) the same curve bit for bit: in fp32 it is the same arithmetic."""
    runs = {}
    for name, extra in (("sequential", []), ("grouped", ["--moe-grouped-gemm"]),
                        ("fused", ["--moe-grouped-gemm", "--gemm-gradient-accumulation-fusion"])):
        code, _, err = train(capsys, *MOE, "--data-path", corpus, "--train-iters", "4", *extra,
                             "--metrics-file", str(tmp_path / f"{name}.jsonl"))
        assert code == 0, err
        runs[name] = losses(tmp_path / f"{name}.jsonl")
    for i in runs["sequential"]:
        assert abs(runs["grouped"][i] - runs["sequential"][i]) <= 1e-5 * abs(runs["sequential"][i])
    assert runs["fused"] == runs["grouped"]


def test_the_grouped_matmul_kernel_gives_the_matmul_per_experts_bits(framework):
    """ops.grouped_matmul (torch._grouped_mm on PyTorch releases that have it, one call for every
    expert, its backward two more grouped calls) against the composite's matmul per expert: the
    same output, input and weight gradients bit for bit in float32, an expert without rows
    included; shapes the kernel does not take (rows not 16-byte aligned) go to the composite."""
    from mindspeed_core import autograd, composite

    rng = np.random.default_rng(0)
    native = ops.implementations()["grouped_matmul"] == "native"
    assert native == (framework == "pytorch" and hasattr(__import__("torch"), "_grouped_mm")), ops.implementations()
    for width, counts in ((16, [5, 0, 7, 4]), (12, [1, 2, 0, 0]), (6, [3, 0, 2, 1])):  # 6 x 4 bytes: not aligned
        x = ops.tensor(rng.standard_normal((sum(counts), width)).astype(np.float32))
        w = ops.tensor(rng.standard_normal((len(counts), width, 8)).astype(np.float32))
        dy = ops.tensor(rng.standard_normal((sum(counts), 8)).astype(np.float32))
        got = {}
        for name, fn in (("bound", ops.grouped_matmul), ("composite", composite.grouped_matmul)):
            out, back = autograd.vjp(lambda a, b, fn=fn: fn(a, b, counts), [x, w])
            (dx, dw), _ = back(dy)
            got[name] = [ops.to_numpy(t) for t in (out, dx, dw)]
        for a, b in zip(got["bound"], got["composite"]):
            assert np.array_equal(a, b), (width, counts)
        assert not np.any(got["bound"][2][counts.index(0)])  # no rows, no gradient


@pytest.mark.feature("matmul-add")
def test_accumulated_grouped_matmul_gives_its_weight_gradient_in_fp32(framework):
    """The grouped matmul of --gemm-gradient-accumulation-fusion: the same output and input
    gradient, no gradient for the weight, and in its sink each expert's x^T dy in fp32 (an
    expert without rows: zeros). From bf16 inputs (PyTorch: MindSpore's CPU MatMul has no bf16
    kernel) that is the exact product, where autograd's own bf16 weight gradient is rounded."""
    for dtype in ("float32", "bfloat16") if framework == "pytorch" else ("float32",):
        _check_accumulated_grouped_matmul(dtype)


def _check_accumulated_grouped_matmul(dtype: str) -> None:
    from mindspeed_core.models.moe import _grouped

    rng = np.random.default_rng(0)
    counts = [3, 0, 5]
    x = nn.Parameter(ops.cast(ops.tensor(rng.standard_normal((8, 6)).astype(np.float32)), dtype))
    w = nn.Parameter(ops.cast(ops.tensor(rng.standard_normal((3, 6, 4)).astype(np.float32)), dtype))
    sink = nn.Parameter(np.zeros((3, 6, 4), np.float32))
    dy = ops.cast(ops.tensor(rng.standard_normal((8, 4)).astype(np.float32)), dtype)
    out = {}
    for name, s in (("plain", None), ("sink", sink)):
        fn = autograd.value_and_grad(lambda s=s: ops.sum(ops.cast(_grouped(x, w, counts, s) * dy, "float32")),
                                     [x, w] + ([sink] if s is not None else []))
        out[name] = [ops.to_numpy(ops.cast(g, "float32")) for g in fn()[1]]
    assert np.array_equal(out["sink"][0], out["plain"][0])  # the input's gradient: unchanged
    assert not out["sink"][1].any()  # the weight's went to the sink
    xs, dys = (ops.to_numpy(ops.cast(t, "float32")).astype(np.float64) for t in (x, dy))
    want = np.stack([xs[a:b].T @ dys[a:b] for a, b in ((0, 3), (3, 3), (3, 8))])
    np.testing.assert_allclose(out["sink"][2], want, rtol=1e-6, atol=1e-6)
    assert not out["sink"][2][1].any()
    if dtype == "bfloat16":  # autograd's own weight gradient is bf16: a rounding away from the product
        assert np.abs(out["plain"][1] - want).max() > 100 * np.abs(out["sink"][2] - want).max()


@pytest.mark.feature("moe")
@pytest.mark.parametrize("balancing", [[], ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
                                              "0.05", "--moe-aux-loss-coeff", "0"]], ids=["aux-loss", "expert-bias"])
def test_a_resumed_moe_run_continues_the_uninterrupted_one(capsys, corpus, tmp_path, balancing):  # noqa: F811
    """Checkpoints carry the router and the stacked experts, and aux-loss-free balancing's
    per-layer bias (which moves every step and decides the routing)."""
    common = [*MOE, "--data-path", corpus, "--train-iters", "6", "--split", "90,10,0", *balancing]
    code, _, err = train(capsys, *common, "--metrics-file", str(tmp_path / "whole.jsonl"))
    assert code == 0, err
    code, _, err = train(capsys, *common, "--save", str(tmp_path / "ckpt"), "--save-interval", "3", "--exit-interval",
                         "3", "--metrics-file", str(tmp_path / "first.jsonl"))
    assert code == 0, err
    code, _, err = train(capsys, *common, "--load", str(tmp_path / "ckpt"), "--metrics-file",
                         str(tmp_path / "rest.jsonl"))
    assert code == 0, err
    whole, rest = losses(tmp_path / "whole.jsonl"), losses(tmp_path / "rest.jsonl")
    assert sorted(rest) == [4, 5, 6] and all(rest[i] == pytest.approx(whole[i], rel=1e-6) for i in rest)
    routed = [r["moe"]["tokens_per_expert"] for r in _records(tmp_path / "whole.jsonl")]
    assert [r["moe"]["tokens_per_expert"] for r in _records(tmp_path / "rest.jsonl")] == routed[3:]
    if balancing:  # the saved bias (model state) is the update rule replayed on the logged loads of steps 1-3
        from mindspeed_core.training import checkpoint

        saved = checkpoint.load_model_arrays(str(tmp_path / "ckpt"), 3)["decoder.layers.1.mlp.router.expert_bias"]
        bias = np.zeros(4, np.float32)
        for load in routed[:3]:
            counts = np.asarray(load[0], np.float64)  # the one MoE layer (layer 1)
            bias = (bias + 0.05 * np.sign(counts.mean() - counts)).astype(np.float32)
        assert np.abs(bias).max() > 0
        assert saved.dtype == np.float32
        np.testing.assert_array_equal(saved, bias)


def test_the_expert_bias_is_model_state_kept_in_float32():
    """The router's expert bias is a parameter no optimizer trains (requires_grad off), and a
    cast to bfloat16 for mixed precision leaves it in float32 with its value (bfloat16 would
    round 0.501 to 0.5: the update's 1e-3 steps would vanish)."""
    from mindspeed_core.training import routing

    cfg = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_attention_heads=2, ffn_hidden_size=24)
    layer = MoELayer(cfg, MoEConfig(num_experts=4, topk=2, enable_expert_bias=True), number=0)
    assert not nn.requires_grad(layer.router.expert_bias)
    assert "router.expert_bias" in nn.state_dict(layer)
    layer.set_expert_bias([0.501, -0.25, 0.0, 1e-3])
    routing.cast_keeping_expert_bias([layer], [layer], "bfloat16")
    assert ops.dtype_of(layer.router.weight) == "bfloat16" and ops.dtype_of(layer.router.expert_bias) == "float32"
    np.testing.assert_array_equal(layer.expert_bias(), np.asarray([0.501, -0.25, 0.0, 1e-3], np.float32))
    assert "router.expert_bias" in nn.state_dict(layer)  # still the layer's, after the swap


def test_a_checkpoint_from_when_the_bias_was_run_state_still_loads(tmp_path):
    """Checkpoints written before the expert biases were model state kept them in the trainer
    state (per rank, by layer number): reading the model fills them in from there."""
    from mindspeed_core.training import checkpoint

    weights = {"decoder.layers.1.mlp.router.weight": np.ones((4, 8), np.float32)}
    legacy = {"rng": [{"expert_bias": {"1": [0.25, -0.5, 0.0, 0.125]}}, {}]}
    meta = {"model": {"moe": {"enable_expert_bias": True}}}
    checkpoint.save(str(tmp_path), 3, weights, {}, 3, meta, trainer_state=legacy)
    arrays = checkpoint.load_model_arrays(str(tmp_path), 3)
    np.testing.assert_array_equal(arrays["decoder.layers.1.mlp.router.expert_bias"], [0.25, -0.5, 0.0, 0.125])
    assert arrays["decoder.layers.1.mlp.router.expert_bias"].dtype == np.float32


def test_router_losses_join_the_gradient_not_the_reported_loss():
    from mindspeed_core.models.moe import MoEModel, with_router_losses

    random.seed(2)
    cfg = ModelConfig(vocab_size=32, hidden_size=16, num_layers=2, num_attention_heads=2, ffn_hidden_size=24,
                      moe=MoEConfig(num_experts=4, topk=2, aux_loss_coeff=0.1, z_loss_coeff=0.01), moe_layers=[1])
    model = MoEModel(cfg)
    ids = ops.tensor(np.random.default_rng(0).integers(0, 32, (2, 8)))
    params = nn.parameters(model)

    def grads_of(fn):
        value, grads = autograd.value_and_grad(fn, params)()
        return float(ops.to_numpy(value)), [ops.to_numpy(g) for g in grads]

    carried, g_carried = grads_of(lambda: with_router_losses(model.loss(ids, ids), model.router_losses()))
    extra = float(ops.to_numpy(model.router_losses()))
    summed, g_summed = grads_of(lambda: model.loss(ids, ids) + model.router_losses())
    plain, g_plain = grads_of(lambda: model.loss(ids, ids))
    assert extra > 0 and carried == plain and summed == pytest.approx(plain + extra, rel=1e-6)
    for a, b in zip(g_carried, g_summed):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    router = [n for n, _ in nn.named_parameters(model)].index("decoder.layers.1.mlp.router.weight")
    assert np.abs(g_carried[router] - g_plain[router]).max() > 1e-4  # the router losses did reach the router


@pytest.mark.feature("moe")
def test_capacity_drops_are_counted(capsys, corpus, tmp_path):  # noqa: F811
    metrics = tmp_path / "m.jsonl"
    code, out, err = train(capsys, *MOE, "--data-path", corpus, "--train-iters", "2", "--moe-expert-capacity-factor",
                           "0.5", "--moe-pad-expert-input-to-capacity", "--metrics-file", str(metrics))
    assert code == 0, err
    for r in _records(metrics):  # capacity ceil(64 x 2 / 4 x 0.5) = 16 per expert and micro-batch, 2 of them
        assert r["moe"]["dropped"] > 0 and max(max(t) for t in r["moe"]["tokens_per_expert"]) <= 2 * 16
    assert "dropped" in out


@pytest.mark.feature("moe")
@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-deepseek-v3",
                                  "tiny-glm45", "tiny-gpt-oss"])
def test_moe_presets_train(capsys, corpus, tmp_path, name):  # noqa: F811
    from mindspeed_core.models import registry
    from mindspeed_core.models.families import preset

    # the parameter count the planner and the log use is what the model holds
    cfg = preset(name)
    model = registry.for_config(cfg).build(cfg)
    assert sum(int(np.prod(p.shape)) for p in nn.parameters(model)) == cfg.num_parameters()

    metrics = tmp_path / "m.jsonl"
    code, out, err = train(capsys, "--model-name", name, "--data-path", corpus, "--train-iters", "2", "--seq-length",
                           "32", "--micro-batch-size", "2", "--eval-iters", "0", "--log-interval", "1", "--no-progress",
                           "--sample-tokens", "0", "--metrics-file", str(metrics))
    assert code == 0, err
    cfg = preset(name)
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    for r in _records(metrics):
        assert np.isfinite(r["loss"]) and len(r["moe"]["tokens_per_expert"]) == len(moe_layers)
        assert all(sum(t) == 2 * 32 * cfg.moe.topk for t in r["moe"]["tokens_per_expert"])


@pytest.mark.parametrize("extra, message", [
    (["--compile", "--context-parallel-size", "2"], "context parallelism's load-balancing counts and the router's"),
    (["--expert-model-parallel-size", "3"], "does not divide the number of experts (4)"),
    (["--expert-model-parallel-size", "4"], "does not divide the data-parallel size 1"),
    (["--compile", "--moe-expert-capacity-factor", "1.0"], "a capacity's drops, context parallelism's"),
    (["--compile", "--moe-input-jitter-eps", "0.1"], "the router's input jitter are not built"),
    (["--moe-layer-freq", "4", "--first-k-dense-replace", "1"], "leave none of the 2 layers an MoE layer"),
    (["--moe-router-topk", "5"], "topk must be between 1 and the"),
])
def test_moe_layouts_this_trainer_cannot_run_are_refused(capsys, corpus, extra, message):  # noqa: F811
    code, _, err = train(capsys, *MOE, "--data-path", corpus, "--train-iters", "1", "--dry-run", *extra)
    assert code == 2 and message in err, err


@pytest.mark.feature("moe-input-jitter")
def test_input_jitter_scales_the_routers_input_only_in_training():
    """--moe-input-jitter-eps (megatron-core's input jitter): in training the router scores the
    tokens times noise uniform in [1 - eps, 1 + eps], drawn from the default stream, while the
    experts get the tokens themselves; in evaluation there is no noise."""
    layer = MoELayer(CFG, MoEConfig(num_experts=4, topk=2, input_jitter_eps=0.5))
    nn.load_state_dict(layer, nn.state_dict(_layer("mixtral")))
    x = np.random.default_rng(2).standard_normal((2, 6, 16)).astype(np.float32)
    flat = x.reshape(-1, 16).astype(np.float64)
    w = ops.to_numpy(layer.router.weight).astype(np.float64)

    def chosen(inputs):  # softmax top-2 of the router's scores, in numpy
        logits = inputs @ w.T
        return np.sort(np.argsort(-logits, axis=1)[:, :2], axis=1)

    random.seed(11)
    noise = ops.to_numpy(ops.rand((12, 16))).astype(np.float64) * 1.0 + 0.5  # 2 eps u + 1 - eps
    assert noise.min() >= 0.5 and noise.max() < 1.5
    random.seed(11)
    got = ops.to_numpy(layer(ops.tensor(x)))
    assert np.array_equal(np.sort(layer.routing.experts, axis=1), chosen(flat * noise))
    assert not np.array_equal(chosen(flat * noise), chosen(flat))  # the noise changes some choices
    np.testing.assert_allclose(got, reference(layer, x), rtol=1e-4, atol=1e-5)  # experts on x itself
    nn.set_training(layer, False)
    random.seed(11)
    layer(ops.tensor(x))
    assert np.array_equal(np.sort(layer.routing.experts, axis=1), chosen(flat))
