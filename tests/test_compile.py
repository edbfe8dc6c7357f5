"""--compile: the compiled training step (torch.compile / mindspore.jit trace capture) gives
the eager losses: on one process with dropout (the same masks), over 6 steps with pipeline and
context parallelism, and for an MoE model under tensor (or data) parallelism; its first step is
checked against eager gradients, and a wrong compiled gradient stops the run."""

from __future__ import annotations

import numpy as np
import pytest

from mindspeed_core import autograd, features, nn, ops, runtime
from test_parallel import GQA, MOE, assert_same_curve
from test_training import corpus, losses, train  # noqa: F401  (corpus is a fixture)

ITERS = 6  # past the warm-up (2) into the decay: each compiled step after the checked first
FLAGS = [*GQA, "--use-flash-attn", "--use-fused-rmsnorm", "--use-fused-rotary-pos-emb", "--train-iters", str(ITERS)]
FRAMEWORK, VERSION = runtime.bound().NAME, runtime.bound().FRAMEWORK_VERSION
TP_STATUS = features.get("compile-tensor-parallel").status(FRAMEWORK, version=VERSION)


def eager_run(flags, corpus, folder):
    """The metrics file of an eager run, one process."""
    import contextlib
    import io

    from mindspeed_core import cli

    path = folder / "m.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["train", *flags, "--data-path", corpus, "--metrics-file", str(path)]) == 0
    return path


def compiled_run(capsys, flags, corpus, folder):
    """The metrics file of a --compile run, one process, its first step checked against eager."""
    path = folder / "m.jsonl"
    code, out, err = train(capsys, *flags, "--compile", "--data-path", corpus, "--metrics-file", str(path))
    assert code == 0, err
    assert "first-step gradients match eager" in out, out
    return path


@pytest.fixture(scope="module")
def eager(corpus, tmp_path_factory):  # noqa: F811
    """The eager loss curve, one process (the compiled layouts' reference)."""
    return losses(eager_run(FLAGS, corpus, tmp_path_factory.mktemp("eager")))


def _marks(*ids):
    return [pytest.mark.multiprocess, *(pytest.mark.feature(i) for i in ids)]


def _with(marks):
    def decorate(test):
        for mark in marks:
            test = mark(test)
        return test
    return decorate


# The MoE model (one MoE layer) runs the data or tensor layout: TP2 with
# sequence parallelism where the matrix supports --compile with tensor parallelism (MindSpore,
# torch >= 2.13; two ranks: four would compile four graphs on two cores); elsewhere (older torch)
# DP2, and the refusal is tested below. Each compile costs a minute or two on these cores, so the
# dense model is not compiled at this layout again.
if TP_STATUS.kind == "supported":
    LAYOUT, SAYS = ["--tensor-model-parallel-size", "2", "--sequence-parallel"], "TP=2 DP=1"
    MARKS = _marks("compile", "compile-tensor-parallel", "collectives", "tensor-parallel", "sequence-parallel",
                   "distributed-optimizer")
else:
    LAYOUT, SAYS = [], "TP=1 DP=2"
    MARKS = _marks("compile", "collectives", "data-parallel", "distributed-optimizer")


# two micro-batches per step through two stages: the first stage's first forward is interleaved
# (MindSpore runs its graph again at its backward)
PIPELINE = ["--pipeline-model-parallel-size", "2"]


LAYOUTS = [
    pytest.param(PIPELINE, "PP=2", marks=_marks("compile", "compile-pipeline", "pipeline-parallel"), id="PP=2"),
    pytest.param(["--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo"], "CP=2",
                 marks=_marks("compile", "compile-context-parallel", "ulysses-cp"), id="Ulysses-CP=2")]
if FRAMEWORK == "mindspore":  # the ring's own traced exchange; torch.compile takes its Functions as it takes
    # Ulysses' (and compiles the ring's many blocks for 80 s here)
    LAYOUTS.append(pytest.param(["--context-parallel-size", "2"], "CP=2",
                                marks=_marks("compile", "compile-context-parallel", "ring-attention-cp"),
                                id="ring-CP=2"))


# MoE with what its device routing has to reproduce: DeepSeek-V3's sigmoid scores within the best
# of two groups, the aux-loss-free expert bias (moved by the loads after every step), a
# per-sequence aux loss and the z loss. One layer, the MoE one: Inductor's compile time grows with
# the graph (measured in one process: 46 s with test_parallel's dense first layer, 21 s without),
# and the dense layer is compiled at the other layouts below.
MOE_FLAGS = [*MOE, "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "2",
             "--moe-router-group-topk", "1", "--moe-router-enable-expert-bias", "--moe-router-load-balancing-type",
             "seq_aux_loss", "--train-iters", "6", "--num-layers", "1", "--first-k-dense-replace", "0"]


@pytest.fixture(scope="module")
def moe_eager(corpus, tmp_path_factory):  # noqa: F811
    """The eager MoE run, one process: {iteration: metrics record}."""
    import json

    path = eager_run(MOE_FLAGS, corpus, tmp_path_factory.mktemp("moe-eager"))
    return {r["iteration"]: r for r in map(json.loads, open(path)) if "loss" in r}


def assert_same_moe_run(path, eager):
    """The compiled run's losses, and every step's routing (tokens per expert, which the expert
    bias follows, and the aux and z losses), are the eager run's."""
    import json

    got = {r["iteration"]: r for r in map(json.loads, open(path)) if "loss" in r}
    assert_same_curve({i: r["loss"] for i, r in got.items()}, {i: r["loss"] for i, r in eager.items()})
    for i, record in eager.items():
        assert got[i]["moe"]["tokens_per_expert"] == record["moe"]["tokens_per_expert"], i
        for key in ("aux_loss", "z_loss"):
            assert got[i]["moe"][key] == pytest.approx(record["moe"][key], rel=1e-4), (i, key)


if TP_STATUS.kind != "supported":  # where TP is (the newest torch, MindSpore) the two-rank launch proves it
    @pytest.mark.feature("compile")
    @pytest.mark.feature("moe-compile")
    @pytest.mark.feature("moe")
    def test_compiled_moe_routes_and_trains_as_eager(capsys, corpus, moe_eager, tmp_path):  # noqa: F811
        assert len({str(r["moe"]["tokens_per_expert"]) for r in moe_eager.values()}) > 1  # the routing moved
        assert_same_moe_run(compiled_run(capsys, MOE_FLAGS, corpus, tmp_path), moe_eager)


@pytest.fixture(scope="module")
def compiled_layouts(corpus, tmp_path_factory):  # noqa: F811
    """Every compiled layout in one launch of two ranks (tests/launch.py run_configs): a launch
    costs more than a tiny model's compiled steps; the MoE model's under tensor (or data)
    parallelism with the distributed optimizer too. Returns its folder."""
    from launch import run_configs

    tmp = tmp_path_factory.mktemp("compiled-layouts")
    spec = [[param.id, [*FLAGS, *param.values[0], "--compile", "--use-distributed-optimizer", "--data-path", corpus],
             False] for param in LAYOUTS]
    spec.append(["moe", [*MOE_FLAGS, *LAYOUT, "--compile", "--use-distributed-optimizer", "--data-path", corpus],
                 False])
    return run_configs(FRAMEWORK, 2, spec, tmp)


@pytest.mark.feature("moe-compile")
@pytest.mark.feature("moe")
@_with(MARKS)
def test_compiled_moe_under_tensor_parallelism_equals_eager(compiled_layouts, moe_eager):
    assert len({str(r["moe"]["tokens_per_expert"]) for r in moe_eager.values()}) > 1  # the routing moved
    out = (compiled_layouts / "moe.log").read_text()
    assert SAYS in out and "first-step gradients match eager" in out, out
    assert_same_moe_run(compiled_layouts / "moe.jsonl", moe_eager)


@pytest.mark.parametrize("layout,says", LAYOUTS)
def test_compiled_parallel_run_equals_eager(request, compiled_layouts, eager, layout, says):
    name = request.node.callspec.id
    out = (compiled_layouts / f"{name}.log").read_text()
    assert says in out, out
    if layout is PIPELINE:  # each stage checks its chunk (the last with the loss) on its first micro-batch
        assert "stage 0: --compile: model chunk 0 compiled" in out, out
        last = (compiled_layouts / f"{name}.rank1.log").read_text()
        assert "stage 1: --compile: model chunk 0 with the loss compiled" in last, last
    assert "first-step gradients match eager" in out, out
    assert_same_curve(losses(compiled_layouts / f"{name}.jsonl"), eager)


def test_compiled_tensor_parallel_is_refused_exactly_where_the_matrix_says(capsys):
    from mindspeed_core import cli

    code = cli.main(["check-args", "--ai-framework", FRAMEWORK, "--compile", "--tensor-model-parallel-size", "2"])
    err = capsys.readouterr().err
    if TP_STATUS.kind == "supported":
        assert code == 0, err
    else:  # torch before 2.13: a wrong embedding gradient
        assert code == 2 and "compile-tensor-parallel" in err and TP_STATUS.note in err, err
        assert "word-embedding gradient" in err, err


DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1", "--train-iters", "6"]


@pytest.mark.feature("compile")
def test_compiled_losses_with_dropout_equal_eager(capsys, corpus, tmp_path):  # noqa: F811
    """One process: the compiled step gives eager's losses, and its dropout masks are those eager
    draws, step after step (MindSpore's trace capture would freeze host draws into the graph: they
    are graph inputs instead). The one single-process compile of the dense model (each costs
    about a minute here)."""
    curves = []
    for extra in ([], ["--compile"]):
        metrics = tmp_path / f"m{len(extra)}.jsonl"
        code, out, err = train(capsys, *FLAGS, *DROPOUT, *extra, "--data-path", corpus, "--metrics-file", str(metrics))
        assert code == 0, err
        curves.append(losses(metrics))
    assert "first-step gradients match eager" in out, out
    assert_same_curve(curves[1], curves[0])


def test_a_packed_dataset_under_compile_stops_in_one_line(capsys, tmp_path):
    """Its samples bring a loss mask (the packs' padding), which the compiled loss does not take:
    training on without it would count the padding, so the run stops."""
    import json

    from mindspeed_core import cli

    with open(tmp_path / "docs.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": "word " * n}) + "\n" for n in range(1, 60))
    prefix = str(tmp_path / "c")
    assert cli.main(["preprocess", "--input", str(tmp_path / "docs.jsonl"), "--output-prefix", prefix, "--append-eod",
                     "--pack", "--seq-length", "32"]) == 0
    capsys.readouterr()
    code, out, err = train(capsys, *FLAGS, "--compile", "--train-iters", "1", "--data-path",
                           prefix + "_packed_text_document")
    assert code != 0 and "packed dataset" in err and "run without --compile" in err, (out[-2000:], err)
    assert err.strip().count("\n") == 0, err


class _Doubled(autograd.Function):
    """Identity forward, doubled backward: what the tensor-parallel collectives look like to
    a compiler (their backward is not the derivative of their forward)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


class _TracedDoubled(_Doubled):
    @staticmethod
    def traced(x):  # x's values, the gradient of 2x
        return autograd.detach(x) + (x * 2.0 - autograd.detach(x * 2.0))


class _Scale(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function
        self.weight = nn.Parameter(np.full(3, 3.0, np.float32))

    def forward(self, x):
        return ops.sum(self.function.apply(x * self.weight))


def test_hand_written_backward_under_compile():
    """torch.compile keeps a Function's backward. MindSpore's trace capture would differentiate
    the forward instead: there a Function runs its traced formulation, and one without is refused."""
    for function in (_Doubled, _TracedDoubled):
        model = _Scale(function)
        x = ops.ones((3,))
        _, (eager,) = autograd.value_and_grad(model, [model.weight])(x)
        np.testing.assert_allclose(ops.to_numpy(eager), [2.0, 2.0, 2.0])
        if FRAMEWORK == "mindspore" and function is _Doubled:
            with pytest.raises(NotImplementedError, match="_Doubled has a hand-written backward and no traced"):
                autograd.compiled_value_and_grad(model, [model.weight], model)(x)
            continue
        _, (compiled,) = autograd.compiled_value_and_grad(model, [model.weight], model)(x)
        np.testing.assert_allclose(ops.to_numpy(compiled), [2.0, 2.0, 2.0])


def test_a_wrong_compiled_gradient_stops_the_run(capsys, corpus, monkeypatch):  # noqa: F811
    """A compiler whose gradients are off by 0.1% (an eager stand-in, so nothing is compiled)."""
    from mindspeed_core.training import compiled

    def slightly_wrong(fn, params, module):
        run = autograd.value_and_grad(fn, params)

        def wrapped(*args):
            value, grads = run(*args)
            return value, [g * 1.001 for g in grads]
        return wrapped

    shim = type("Autograd", (), {"__getattr__": lambda self, name: getattr(autograd, name),
                                 "compiled_value_and_grad": staticmethod(slightly_wrong)})()
    monkeypatch.setattr(compiled, "autograd", shim)
    code, out, err = train(capsys, *FLAGS, "--compile", "--train-iters", "2", "--data-path", corpus)
    assert code != 0 and "disagrees with eager" in err and "run without --compile" in err, (out, err)


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(np.array([[1.0, 2.0], [3.0, -1.0]], np.float32))

    def forward(self, x):
        return ops.tanh(ops.matmul(x, self.weight))


@pytest.mark.parametrize("interleaved", [False, True])
def test_a_compiled_stage_gives_the_outputs_and_gradients_of_vjp(interleaved):
    """What the pipeline schedule runs under --compile; interleaved: another forward is recorded
    before this backward (MindSpore then runs the stage's graph again)."""
    model = _Stage()
    x = ops.tensor(np.array([[0.5, -1.0], [2.0, 0.25]], np.float32))
    cotangent = ops.tensor(np.array([[1.0, 2.0], [-1.0, 0.5]], np.float32))
    want, want_backward = autograd.vjp(model, [x], [model.weight])
    (want_input,), (want_weight,) = want_backward(cotangent)
    out, backward = autograd.compiled_vjp(model, [model.weight], model)([x], interleaved=interleaved)
    if interleaved:
        autograd.vjp(model, [x * 2.0], [model.weight])
    (got_input,), (got_weight,) = backward(cotangent)
    # a compiler may fuse tanh's backward differently (torch 2.6's Inductor: 4.8e-7 off)
    for got, expected in ((out, want), (got_input, want_input), (got_weight, want_weight)):
        np.testing.assert_allclose(ops.to_numpy(got), ops.to_numpy(expected), rtol=1e-5, atol=1e-6)


def test_a_compiled_function_reads_the_parameters_as_they_are_now():
    """autograd.compiled (generation's decode step): eager's outputs, and a parameter changed
    after compilation is seen (not frozen into the graph)."""
    model = _Stage()
    x = ops.tensor(np.array([[0.5, -1.0], [2.0, 0.25]], np.float32))
    run = autograd.compiled(lambda t: (model(t), t * 2.0), [model.weight], model)
    for weight in ([[1.0, 2.0], [3.0, -1.0]], [[0.5, 0.0], [-2.0, 1.0]]):
        nn.assign(model.weight, np.array(weight, np.float32))
        out, doubled = run(x)
        np.testing.assert_allclose(ops.to_numpy(out), np.tanh(ops.to_numpy(x) @ np.array(weight)), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_array_equal(ops.to_numpy(doubled), ops.to_numpy(x) * 2.0)


class _Square(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(np.array([1.0, 2.0, 3.0], np.float32))

    def forward(self, x):
        return ops.sum(x * self.weight * self.weight)


def test_compile_works_when_a_caller_has_no_source():
    """``python -m mindspeed_core.cli train --compile`` has ``<frozen runpy>`` frames below
    it, ``python -c`` a ``<string>``: MindSpore's trace capture reads its callers' source lines
    and had failed there with a TypeError. Here the caller is code without a file."""
    model = _Square()
    step = autograd.compiled_value_and_grad(model, [model.weight], model)
    scope = {"step": step, "x": ops.ones((3,))}
    exec(compile("\n" * 40 + "result = step(x)", "<code without a file>", "exec"), scope)
    loss, (grad,) = scope["result"]
    assert float(ops.to_numpy(loss)) == 14.0
    np.testing.assert_allclose(ops.to_numpy(grad), [2.0, 4.0, 6.0])
