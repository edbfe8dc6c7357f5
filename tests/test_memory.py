"""Memory features (recompute, swap attention): exactly the same training, less memory held.

Tensor- and pipeline-parallel runs with recompute are cases of the layout tests
(test_parallel.py, test_pipeline.py); the RNG replay under tensor parallelism is checked by
tests/tp_dropout_worker.py.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from mindspeed_core import runtime
from mindspeed_core.errors import MindSpeedError
from mindspeed_core import measure
from mindspeed_core.memory import accounting
from test_training import SMALL, corpus, train  # noqa: F401  (corpus is a fixture)

# three layers (uniform groups of 2 leave one over), q/k norms, dropout everywhere: the
# recomputation must replay every dropout mask. Layers 0 and 2 are gated DeltaNet (MindSpeed-LLM's
# qwen3_next spec), layer 1 gated attention: every policy acts on both kinds of token mixer
MODEL = [*SMALL, "--num-layers", "3", "--qk-layernorm", "--attention-dropout", "0.2", "--hidden-dropout", "0.2",
         "--spec", "mindspeed_llm.tasks.models.spec.qwen3_next_spec", "layer_spec", "--full-attention-interval", "2",
         "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "16",
         "--linear-value-head-dim", "16", "--mamba-chunk-size", "8"]
STEPS = 5
FRAMEWORK = runtime.bound().NAME

VARIANTS = {
    "full-uniform-2": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
    "full-block-1": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
    "selective": ["--recompute-activations"],
    "norm": ["--recompute-norm"],
    "selective-norm": ["--recompute-granularity", "selective", "--recompute-norm"],
    "swap-attention": ["--swap-attention"],
    "activation-function": ["--recompute-activation-function"],
    # layer 0 fully recomputed, layer 1 its activation function only, layer 2 nothing
    "full-block-1-activation-1": ["--recompute-granularity", "full", "--recompute-method", "block",
                                  "--recompute-num-layers", "1", "--recompute-activation-function",
                                  "--recompute-activation-function-num-layers", "1"],
    "swap-block-2": ["--swap-attention", "--recompute-granularity", "full", "--recompute-method", "block",
                     "--recompute-num-layers", "2"],
}


def run(corpus, flags):  # noqa: F811
    """First-step gradients and the losses of STEPS steps, in this process."""
    import contextlib
    import io

    from mindspeed_core import ops
    from mindspeed_core.compat.megatron_args import training_parser
    from mindspeed_core.training.trainer import Trainer

    args = training_parser().parse_args([*MODEL, *flags, "--data-path", corpus, "--train-iters", str(STEPS)])
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(args)
        trainer.build()
        grads = dict(zip(trainer.names, map(ops.to_numpy, trainer.gradients(0)[1])))
        curve = [trainer.train_step(i)[0] for i in range(STEPS)]
    return grads, curve, trainer


@pytest.fixture(scope="module")
def plain(corpus):  # noqa: F811
    return run(corpus, [])


def _variant(name):
    """The variant with the features it really runs on this framework marked (on MindSpore the
    swap variants check the refusal instead)."""
    flags = VARIANTS[name]
    if "--swap-attention" in flags and FRAMEWORK == "mindspore":
        return pytest.param(name, id=name)
    ids = [("recompute", "--recompute-granularity" in flags or "--recompute-activations" in flags),
           ("norm-recompute", "--recompute-norm" in flags), ("swap-attention", "--swap-attention" in flags),
           ("recompute-activation-function", "--recompute-activation-function" in flags)]
    return pytest.param(name, id=name, marks=[pytest.mark.feature(i) for i, on in ids if on])


@pytest.mark.parametrize("variant", [_variant(v) for v in sorted(VARIANTS)])
def test_memory_features_train_bit_identically(capsys, framework, corpus, plain, variant):  # noqa: F811
    if "swap" in variant and framework == "mindspore":
        assert_swap_refused(capsys, corpus)
        return
    grads, curve, trainer = run(corpus, VARIANTS[variant])
    want_grads, want_curve, _ = plain
    assert sorted(grads) == sorted(want_grads)
    for name, g in want_grads.items():
        assert np.array_equal(grads[name], g), (variant, name, float(np.max(np.abs(grads[name] - g))))
    assert curve == want_curve, (variant, curve, want_curve)
    if "swap" in variant:  # the tensors really went to the host and came back
        assert trainer.swap.swapped > 0 and trainer.swap.host_bytes == 0
    if "activation" in variant:  # which layers recompute their activation function
        want = [True] * 3 if variant == "activation-function" else [False, True, False]
        assert [layer.mlp.recompute_activation for layer in trainer.model.decoder.layers] == want


def assert_swap_refused(capsys, corpus):  # noqa: F811
    """MindSpore: the matrix refuses --swap-attention (exit 2, what to use instead), and the
    facade's hook says why."""
    code, out, err = train(capsys, *MODEL, "--data-path", corpus, "--train-iters", "1", "--swap-attention")
    assert code == 2 and "swap-attention" in err and "--recompute-granularity full" in err, err
    from mindspeed_core import autograd

    with pytest.raises(NotImplementedError, match="no hook"):
        autograd.saved_tensors_hooks(lambda x, s: x, lambda x: x)


@pytest.mark.parametrize("flags,message", [
    (["--recompute-granularity", "full"], "needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "block"], "needs --recompute-method"),
    (["--recompute-granularity", "selective", "--recompute-method", "block"], "applies to --recompute-granularity full"),
    (["--recompute-num-layers", "1"], "applies to --recompute-granularity full only"),
    (["--recompute-activations", "--recompute-granularity", "full"], "cannot be combined"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "4"],
     "exceeds the 3 layers"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3",
      "--pipeline-model-parallel-size", "2", "--num-layer-list", "2,1"], "exceeds the 2 layers"),
    (["--recompute-activations", "--compile", "--attention-dropout", "0", "--hidden-dropout", "0"],
     "--compile with activation recompute"),
    (["--recompute-norm", "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
      "0"], "must be a positive integer"),
])
def test_bad_recompute_flags_are_clear_errors(capsys, corpus, flags, message):  # noqa: F811
    code, out, err = train(capsys, *MODEL, "--data-path", corpus, "--train-iters", "1", *flags)
    assert code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.framework_free
def test_a_recompute_count_above_a_chunks_layers_recomputes_all_of_them():
    """megatron-core bounds --recompute-num-layers by a pipeline rank's layers and applies it per
    model chunk: MindSpeed-LLM's Qwen3-235B script recomputes 12 layers of chunks holding 8."""
    from mindspeed_core.memory.recompute import Recompute, check

    assert Recompute("full", "block", 12).groups(8) == [(i, i + 1, True) for i in range(8)]
    assert Recompute("full", "uniform", 12).groups(8) == [(0, 8, True)]
    assert Recompute("full", "block", 2).groups(3) == [(0, 1, True), (1, 2, True), (2, 3, False)]

    class Flags:
        recompute_granularity, recompute_method, recompute_num_layers = "full", "block", 12
        recompute_activations = recompute_norm = False
        recompute_activation_function, recompute_activation_function_num_layers = False, None

    check(Flags, [24, 24, 24, 22])  # four ranks of three 8-layer chunks (the last with two no-op layers)
    with pytest.raises(MindSpeedError, match="exceeds the 11 layers a pipeline rank holds"):
        check(Flags, [11, 11])


# ---- measured savings ------------------------------------------------------------------------

# big enough that activations dwarf the framework's own allocations; no dropout, fp32
SIZE = {"s": 512, "b": 4, "h": 128, "a": 4, "f": 384, "layers": 4}
MEASURED_MODEL = ["--num-layers", str(SIZE["layers"]), "--hidden-size", str(SIZE["h"]), "--num-attention-heads",
                  str(SIZE["a"]), "--ffn-hidden-size", str(SIZE["f"]), "--seq-length", str(SIZE["s"]),
                  "--micro-batch-size", str(SIZE["b"]), "--tokenizer-type", "NullTokenizer", "--vocab-size", "511",
                  "--make-vocab-size-divisible-by", "1", "--attention-dropout", "0", "--hidden-dropout", "0",
                  "--eval-iters", "0", "--split", "100,0,0", "--no-progress", "--train-iters", "2"]


@functools.lru_cache(maxsize=None)
def _measured(framework, flags: tuple) -> str:
    env = {**os.environ, **accounting.MALLOC_ENV}
    # the first full-size step (its peak, loss and saved bytes) is all the tests compare: measure
    # stops there, a third of its full run
    out = subprocess.run([sys.executable, "-m", "mindspeed_core.measure", "--ai-framework", framework,
                          *MEASURED_MODEL, *flags, "--first-step-only"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def measured(framework, flags) -> dict:
    """mindspeed_core/measure.py's figures of the first full-size step in a fresh process (the
    run without memory flags is measured once for the tests that compare against it)."""
    return json.loads(_measured(framework, tuple(flags)))


ESTIMATE_SIZE = {"s": SIZE["s"], "b": SIZE["b"], "h": SIZE["h"], "a": SIZE["a"], "f": SIZE["f"], "element": 4,
                 "dropout": False, "gated": True}


@pytest.mark.feature("recompute")
def test_full_recompute_lowers_the_measured_peak(framework):
    from mindspeed_core.memory.recompute import NONE, Recompute

    full_policy = Recompute("full", "uniform", 1)
    none = measured(framework, [])
    full = measured(framework, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                "--recompute-num-layers", "1"])
    n = SIZE["layers"]
    saving = (accounting.estimated_peak_bytes(NONE, n, **ESTIMATE_SIZE)
              - accounting.estimated_peak_bytes(full_policy, n, **ESTIMATE_SIZE))
    assert full["loss"] == none["loss"]
    got = none["first_host_peak_bytes"] - full["first_host_peak_bytes"]
    print(f"{framework}: measured peak {none['first_host_peak_bytes'] / 2**20:.1f} -> "
          f"{full['first_host_peak_bytes'] / 2**20:.1f} MiB, saving {got / 2**20:.1f} MiB; analytical saving "
          f"{saving / 2**20:.1f} MiB")
    assert got >= saving / 2, (got, saving)
    if framework == "pytorch":  # what autograd holds at the end of forward, counted: all but the group inputs
        kept = n * 4 * SIZE["s"] * SIZE["b"] * SIZE["h"]
        assert none["saved_bytes"] - full["saved_bytes"] >= (accounting.estimated_peak_bytes(NONE, n, **ESTIMATE_SIZE)
                                                             - kept) / 2, (none, full)


@pytest.mark.feature("swap-attention")
def test_swap_attention_lowers_what_the_device_holds(capsys, framework, corpus):  # noqa: F811
    if framework == "mindspore":
        assert_swap_refused(capsys, corpus)
        return
    none, swap = measured(framework, []), measured(framework, ["--swap-attention"])
    assert swap["loss"] == none["loss"]
    moved = SIZE["layers"] * accounting.layer_activation_bytes(**ESTIMATE_SIZE, part="attention")  # analytically
    assert none["saved_bytes"] - swap["saved_bytes"] >= moved / 2, (none, swap, moved)
    # on this CPU-only machine host and device are the same memory: what left autograd's
    # hands is now held by the swap, about as many bytes
    assert swap["swapped_peak_host_bytes"] >= (none["saved_bytes"] - swap["saved_bytes"]) / 2, swap


MOE_MEASURED = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", str(SIZE["f"]),
                "--moe-grouped-gemm", "--swiglu"]


@pytest.mark.feature("moe-zero-memory")
@pytest.mark.feature("gmm")
def test_moe_zero_memory_recomputes_the_dispatch_and_keeps_less(framework):
    """--moe-zero-memory on the measured model with every layer top-2 of 4 SwiGLU experts: the
    same loss bit for bit, and less kept. level0 drops each layer's dispatched rows (fc1's input,
    [T k, h]) and its activation (fc2's input, [T k, f]); level1 also fc1's output [T k, 2f]: the
    measured first-step peak falls by at least half of that (both frameworks), and what autograd
    keeps (PyTorch) by at least all of it."""
    runs = {level: measured(framework, [*MOE_MEASURED, "--moe-zero-memory", level])
            for level in ("disable", "level0", "level1")}
    assert runs["level0"]["loss"] == runs["disable"]["loss"] == runs["level1"]["loss"], runs
    rows = SIZE["layers"] * SIZE["s"] * SIZE["b"] * 2 * 4  # T k fp32 elements' bytes, per width unit, all layers
    dropped = {"level0": rows * (SIZE["h"] + SIZE["f"]), "level1": rows * (SIZE["h"] + SIZE["f"] + 2 * SIZE["f"])}
    for level, want in dropped.items():
        got = runs["disable"]["first_host_peak_bytes"] - runs[level]["first_host_peak_bytes"]
        print(f"{framework} {level}: measured peak {runs['disable']['first_host_peak_bytes'] / 2**20:.1f} -> "
              f"{runs[level]['first_host_peak_bytes'] / 2**20:.1f} MiB (saving {got / 2**20:.1f} MiB; the dropped "
              f"activations {want / 2**20:.1f} MiB)" + (f"; kept for backward {runs['disable']['saved_bytes'] / 2**20:.1f}"
                                                      f" -> {runs[level]['saved_bytes'] / 2**20:.1f} MiB"
                                                      if framework == "pytorch" else ""))
        assert got >= want / 2, (level, got, want)
        if framework == "pytorch":
            assert runs["disable"]["saved_bytes"] - runs[level]["saved_bytes"] >= want, (level, runs)


# ---- the O2 optimizer -----------------------------------------------------------------------

@pytest.mark.feature("o2-bf16-optimizer")
@pytest.mark.parametrize("distributed", [False, True])
def test_o2_optimizer_keeps_bf16_moments_and_resumes_exactly(capsys, framework, corpus, tmp_path, distributed):  # noqa: F811
    flags = [*SMALL, "--data-path", corpus, "--bf16", *(["--use-distributed-optimizer"] if distributed else [])]
    if framework == "mindspore":  # no bf16 on MindSpore's CPU kernels: the matrix refuses both
        code, out, err = train(capsys, *flags, "--train-iters", "1", "--o2-optimizer")
        assert code == 2 and "o2-bf16-optimizer" in err, err
        return
    from mindspeed_core import ops
    from mindspeed_core.compat.megatron_args import training_parser
    from mindspeed_core.training.trainer import Trainer

    trainers = {}
    for o2 in (False, True):
        trainer = Trainer(training_parser().parse_args([*flags, "--train-iters", "6", *(["--o2-optimizer"] if o2 else [])]))
        trainer.build()
        trainers[o2] = (trainer, [trainer.train_step(i)[0] for i in range(6)])
    (plain, plain_curve), (o2, o2_curve) = trainers[False], trainers[True]
    n = sum(ops.numel(p) for p in plain.params)
    assert plain.optimizer.state_bytes() - o2.optimizer.state_bytes() == 4 * n  # two moments, 2 bytes each fewer
    moments = [o2.optimizer.exp_avg[0]] if not distributed else [o2.optimizer.partitions[0].exp_avg]
    assert all(ops.dtype_of(m) == "bfloat16" for m in moments)
    # bf16 moments round the update a little: the same training, not the same bits
    assert max(abs(a - b) / a for a, b in zip(plain_curve, o2_curve)) < 0.02, (plain_curve, o2_curve)
    # the checkpoint keeps the bf16 moments exactly: a resumed run continues the same curve
    metrics = tmp_path / "o2.jsonl"
    common = [*flags, "--o2-optimizer", "--train-iters", "6", "--save", str(tmp_path / "ckpt"), "--save-interval", "3"]
    code, out, err = train(capsys, *common, "--metrics-file", str(metrics))
    assert code == 0, err
    from test_pipeline import iteration_only

    half = iteration_only(tmp_path / "ckpt", 3, tmp_path / "ckpt3")
    code, out, err = train(capsys, *common[:-4], "--load", str(half), "--metrics-file", str(tmp_path / "resumed.jsonl"))
    assert code == 0 and "resumed" in out, err
    from test_training import losses

    whole, resumed = losses(metrics), losses(tmp_path / "resumed.jsonl")
    assert resumed == {i: whole[i] for i in range(4, 7)}, (resumed, whole)
    assert [whole[i] for i in range(1, 7)] == pytest.approx(o2_curve, rel=0, abs=0)


@pytest.mark.feature("o2-gradient")
@pytest.mark.parametrize("distributed", [False, True])
def test_o2_gradient_accumulates_in_bf16(capsys, framework, corpus, distributed):  # noqa: F811
    """MindSpeed's --o2-gradient: the micro-batches' gradients summed in bf16, not in fp32 (the
    optimizer takes bf16 gradients, its slice too under the distributed optimizer); the same
    training within bf16's rounding, not the same bits."""
    flags = [*SMALL, "--data-path", corpus, "--bf16", "--micro-batch-size", "1", "--global-batch-size", "4",
             *(["--use-distributed-optimizer"] if distributed else [])]
    if framework == "mindspore":  # no bf16 on MindSpore's CPU kernels: the matrix refuses it
        code, out, err = train(capsys, *flags, "--train-iters", "1", "--o2-gradient")
        assert code == 2 and "o2-gradient" in err and "Traceback" not in err, err
        return
    from mindspeed_core import ops
    from mindspeed_core.compat.megatron_args import training_parser
    from mindspeed_core.training.trainer import Trainer

    runs = {}
    for o2 in (False, True):
        trainer = Trainer(training_parser().parse_args([*flags, "--train-iters", "4",
                                                        *(["--o2-gradient"] if o2 else [])]))
        trainer.build()
        dtypes = set()
        trainer.after_reduction = lambda i, grads, norm: dtypes.update(ops.dtype_of(g) for g in grads)
        runs[o2] = ([trainer.train_step(i)[0] for i in range(4)], dtypes)
    (plain, plain_dtypes), (o2, o2_dtypes) = runs[False], runs[True]
    assert plain_dtypes == {"float32"} and o2_dtypes == {"bfloat16"}, (plain_dtypes, o2_dtypes)
    assert plain[0] == o2[0] and plain[1:] != o2[1:]  # the first loss precedes any update
    assert max(abs(a - b) / a for a, b in zip(plain, o2)) < 0.02, (plain, o2)


def test_o2_gradient_needs_bf16(capsys, framework, corpus):  # noqa: F811
    code, out, err = train(capsys, *MODEL, "--data-path", corpus, "--train-iters", "1", "--o2-gradient")
    want = "o2-gradient" if framework == "mindspore" else "needs bf16 training: add --bf16"
    assert code == 2 and want in err and "Traceback" not in err, err


# Megatron-LM's precision-aware optimizer's dtypes: how far bf16 moments move a run over
# STATE_STEPS steps of each optimizer (the largest relative loss difference measured: 7.5e-6 for
# AdamW, 1.3e-5 for Muon, on both frameworks); the bound, 8x the worst, is the stated one
LOW_STATES = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
STATE_STEPS = 8
STATE_BOUND = 1e-4


@pytest.mark.feature("low-precision-optimizer-states")
@pytest.mark.parametrize("optimizer", ["adamw", "distributed", "muon"])
def test_bf16_optimizer_states_stay_near_fp32_and_resume_exactly(capsys, framework, corpus, tmp_path, optimizer):  # noqa: F811
    """--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 in fp32 training (AdamW, the distributed
    optimizer, Muon's momentum): the log's bytes per parameter fall by the moments' two bytes
    each, the curve stays within STATE_BOUND of fp32 states and is not the same (the states
    are rounded), and a run resumed from its checkpoint continues it bit for bit."""
    from test_pipeline import iteration_only
    from test_training import losses

    chosen = {"adamw": [], "distributed": ["--use-distributed-optimizer"],
              "muon": ["--optimizer", "muon", "--weight-decay", "0.1"]}[optimizer]
    flags = [*SMALL, "--data-path", corpus, *chosen, "--train-iters", str(STATE_STEPS)]
    per_param = {}
    for name, extra in (("fp32", []), ("bf16", [*LOW_STATES, "--save", str(tmp_path / "ckpt"), "--save-interval",
                                                 str(STATE_STEPS // 2)])):
        code, out, err = train(capsys, *flags, *extra, "--metrics-file", str(tmp_path / f"{name}.jsonl"))
        assert code == 0, err
        per_param[name] = float(re.search(r"optimizer state: [\d.]+ MiB on this rank, ([\d.]+) bytes per", out).group(1))
    assert "moments stored as exp_avg bfloat16, exp_avg_sq bfloat16" in out, out
    if optimizer == "adamw":  # two fp32 moments (8 bytes) become two bf16 ones (4)
        assert (per_param["fp32"], per_param["bf16"]) == (8.0, 4.0), per_param
    elif optimizer == "distributed":  # the fp32 master slice stays: 12 -> 8
        assert (per_param["fp32"], per_param["bf16"]) == (12.0, 8.0), per_param
    else:  # Muon's matrices keep one momentum (4 -> 2 bytes), the rest two moments (8 -> 4)
        assert per_param["bf16"] < per_param["fp32"] / 2 + 0.5 and per_param["bf16"] > per_param["fp32"] / 2 - 0.5
    fp32, low = losses(tmp_path / "fp32.jsonl"), losses(tmp_path / "bf16.jsonl")
    worst = max(abs(fp32[i] - low[i]) / abs(fp32[i]) for i in fp32)
    assert 0 < worst < STATE_BOUND, (fp32, low)
    half = iteration_only(tmp_path / "ckpt", STATE_STEPS // 2, tmp_path / "half")
    code, out, err = train(capsys, *flags, *LOW_STATES, "--load", str(half), "--metrics-file",
                           str(tmp_path / "resumed.jsonl"))
    assert code == 0 and "resumed" in out, err
    assert losses(tmp_path / "resumed.jsonl") == {i: low[i] for i in range(STATE_STEPS // 2 + 1, STATE_STEPS + 1)}
    print(f"{framework} {optimizer}: bf16 states moved the loss by at most {worst:.2e} relative over {STATE_STEPS} "
          f"steps; {per_param['fp32']} -> {per_param['bf16']} bytes per parameter")


@pytest.mark.parametrize("flags,message", [
    (["--exp-avg-dtype", "bf16"], "add --use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp16"], "--exp-avg-sq-dtype fp16 is not built here"),
    (["--use-precision-aware-optimizer", "--exp-avg-dtype", "fp8"], "--exp-avg-dtype fp8 is not built here"),
    (["--use-precision-aware-optimizer", "--main-params-dtype", "fp16"], "--main-params-dtype fp16 is not built"),
    (["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--fp16"], "bf16 optimizer states with --fp16"),
])
def test_low_precision_state_flags_are_checked(capsys, framework, corpus, flags, message):  # noqa: F811
    code, out, err = train(capsys, *MODEL, "--data-path", corpus, "--train-iters", "1", *flags)
    if framework == "mindspore" and "--fp16" in flags:  # the matrix refuses fp16 on its CPU first
        message = "fp16 (--fp16) is unsupported for mindspore"
    assert code == 2 and message in err and "Traceback" not in err, err


def test_o2_optimizer_needs_bf16(capsys, framework, corpus):  # noqa: F811
    code, out, err = train(capsys, *MODEL, "--data-path", corpus, "--train-iters", "1", "--o2-optimizer")
    # MindSpore: the matrix refuses O2 first (no bf16 on its CPU kernels)
    want = "o2-bf16-optimizer" if framework == "mindspore" else "needs bf16 training: add --bf16"
    assert code == 2 and want in err and "Traceback" not in err, err


# ---- parameter-copy reuse ------------------------------------------------------------------

@pytest.mark.feature("reuse-fp32-param")
def test_reuse_split_and_join_keep_every_fp32_master(framework):
    """The high half is what a cast to bf16 gives; join(split(x)) is x bit for bit, but for a
    value exactly on a bf16 tie, which moves one ulp and still rounds to the same bf16."""
    from mindspeed_core import ops
    from mindspeed_core.memory.reuse_fp32_param import join, split

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(50_000) * 10.0 ** rng.integers(-40, 38, 50_000)).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45, -1e-45, 1e-39], np.float32)
    # ties: the low 16 bits exactly 0x8000, above an even and an odd bf16, both signs, a subnormal
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x00008000, 0x7F7E8000], np.uint32)
    x = np.concatenate([x, special, ties.view(np.float32)])
    high, residual = split(ops.tensor(x))
    assert ops.dtype_of(high) == "bfloat16" and ops.dtype_of(residual) == "int16"
    cast = ops.to_numpy(ops.cast(ops.tensor(x), "bfloat16"))
    assert np.array_equal(ops.to_numpy(high), cast)
    back = ops.to_numpy(join(high, residual))
    moved = back.view(np.int32).astype(np.int64) - x.view(np.int32).astype(np.int64)
    tie = (x.view(np.uint32) & 0xFFFF) == 0x8000
    assert tie[-len(ties):].all() and not moved[~tie].any()
    assert set(np.abs(moved[tie])) == {1}
    assert np.array_equal(ops.to_numpy(ops.cast(ops.tensor(back), "bfloat16")), cast)


@pytest.mark.feature("reuse-fp32-param")
def test_reuse_fp32_param_trains_as_the_fp32_master_does(capsys, framework, corpus, tmp_path):  # noqa: F811
    flags = [*SMALL, "--data-path", corpus, "--bf16", "--use-distributed-optimizer"]
    if framework == "mindspore":  # no bf16 on MindSpore's CPU kernels: the matrix refuses it
        code, out, err = train(capsys, *flags, "--train-iters", "1", "--reuse-fp32-param")
        assert code == 2 and "reuse-fp32-param" in err and "Traceback" not in err, err
        return
    from mindspeed_core import ops
    from mindspeed_core.compat.megatron_args import training_parser
    from mindspeed_core.training.trainer import Trainer

    steps, runs = 6, {}
    for reuse in (False, True):
        trainer = Trainer(training_parser().parse_args([*flags, "--train-iters", str(steps),
                                                        *(["--reuse-fp32-param"] if reuse else [])]))
        trainer.build()
        runs[reuse] = (trainer, [trainer.train_step(i)[0] for i in range(steps)])
    (plain, plain_curve), (reused, reused_curve) = runs[False], runs[True]
    (part,) = reused.optimizer.partitions
    assert plain.optimizer.state_bytes() - reused.optimizer.state_bytes() == 2 * part.shard  # no fp32 copy
    assert not hasattr(part, "_master") and ops.dtype_of(part.residual) == "int16"
    # the parameters (what forward sees) are the same bf16 numbers, so is the curve; a master
    # differs where a tie moved it, by an ulp per step at most (a nudge, then a rounding)
    assert reused_curve == plain_curve
    assert all(np.array_equal(ops.to_numpy(a), ops.to_numpy(b)) for a, b in zip(plain.params, reused.params))
    want, got = (ops.to_numpy(t.optimizer.partitions[0].master()).view(np.int32).astype(np.int64)
                 for t in (plain, reused))
    assert np.abs(want - got).max() <= steps and np.count_nonzero(want - got) < 1e-3 * want.size
    # the checkpoint holds the joined master: a run resumed at step 3 continues bit-identically
    metrics = tmp_path / "reuse.jsonl"
    common = [*flags, "--reuse-fp32-param", "--train-iters", str(steps), "--save", str(tmp_path / "ckpt"),
              "--save-interval", "3"]
    code, out, err = train(capsys, *common, "--metrics-file", str(metrics))
    assert code == 0, err
    from test_pipeline import iteration_only
    from test_training import losses

    half = iteration_only(tmp_path / "ckpt", 3, tmp_path / "ckpt3")
    code, out, err = train(capsys, *common[:-4], "--load", str(half), "--metrics-file", str(tmp_path / "resumed.jsonl"))
    assert code == 0 and "resumed" in out, err
    whole = losses(metrics)
    assert losses(tmp_path / "resumed.jsonl") == {i: whole[i] for i in range(4, steps + 1)}
    assert [whole[i] for i in range(1, steps + 1)] == reused_curve


@pytest.mark.multiprocess
@pytest.mark.feature("reuse-fp32-param")
def test_reuse_fp32_param_under_data_parallelism(framework, corpus, tmp_path):  # noqa: F811
    """DP2, each rank a slice of its own: the same curve as the fp32 master slice, 2 bytes per
    element of the slice fewer; and with the slices swapped to host memory. In the same launch
    MindSpeed-LLM's O2 scripts' combination
    (--o2-optimizer --o2-gradient on top, buckets reduced during backward): the gradients
    reduce-scattered in bf16, the same training within bf16's rounding."""
    from launch import run_configs
    from test_training import losses

    flags = [*SMALL, "--data-path", corpus, "--bf16", "--use-distributed-optimizer", "--train-iters", "4"]
    if framework == "mindspore":  # the launcher refuses it before any rank starts
        done = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", "launch", "--nproc-per-node", "2", "--",
                               "--ai-framework", framework, *flags, "--reuse-fp32-param"], capture_output=True,
                              text=True, timeout=300, cwd=str(tmp_path))
        assert done.returncode == 2 and "reuse-fp32-param" in done.stderr and "Traceback" not in done.stderr, done
        return
    o2 = [*flags, "--reuse-fp32-param", "--o2-optimizer", "--o2-gradient", "--overlap-grad-reduce",
          "--overlap-param-gather", "--ddp-bucket-size", "3000"]
    swap = [*flags, "--swap-optimizer", "--swap-optimizer-times", "4"]  # each rank's slice moved in 4 pieces
    out = run_configs(framework, 2, [["plain", flags, False], ["reuse", [*flags, "--reuse-fp32-param"], False],
                                     ["o2", o2, False], ["swap", swap, False]], tmp_path)
    assert losses(out / "reuse.jsonl") == losses(out / "plain.jsonl") == losses(out / "swap.jsonl")
    assert "(in host memory: --swap-optimizer)" in (out / "swap.log").read_text()
    plain, half = losses(out / "plain.jsonl"), losses(out / "o2.jsonl")
    assert plain[1] == half[1] and plain != half, (plain, half)
    assert max(abs(plain[i] - half[i]) / plain[i] for i in plain) < 0.02, (plain, half)
    state = {name: float(re.search(r"optimizer state ([0-9.]+) MiB", (out / f"{name}.log").read_text()).group(1))
             for name in ("plain", "reuse")}
    assert state["reuse"] == pytest.approx(state["plain"] * 10 / 12, abs=0.01), state  # master 2 + moments 8 vs 4 + 8


@pytest.mark.feature("swap-optimizer")
def test_the_swapped_optimizer_updates_as_on_the_device_and_resumes(capsys, framework, corpus, tmp_path, monkeypatch):  # noqa: F811
    """--swap-optimizer (MindSpeed-LLM's Qwen3-Next scripts pass it): the distributed optimizer's
    state lives in host memory and each update moves it in --swap-optimizer-times pieces; the
    same curve bit for bit as the state on the device, and a run resumed from its checkpoint
    continues it."""
    from mindspeed_core import device
    from test_training import losses

    flags = [*SMALL, "--data-path", corpus, "--use-distributed-optimizer", "--train-iters", "4"]
    swap = ["--swap-optimizer", "--swap-optimizer-times", "3"]
    code, _, err = train(capsys, *flags, "--metrics-file", str(tmp_path / "device.jsonl"))
    assert code == 0, err
    moved = []
    to_host = device.to_host
    monkeypatch.setattr(device, "to_host", lambda x: (moved.append(tuple(x.shape)), to_host(x))[1])
    code, out, err = train(capsys, *flags, *swap, "--metrics-file", str(tmp_path / "host.jsonl"), "--save",
                           str(tmp_path / "ckpt"), "--save-interval", "2")
    assert code == 0, err
    assert losses(tmp_path / "host.jsonl") == losses(tmp_path / "device.jsonl")
    # per step: each moment in 3 pieces, then the whole master slice
    shard = max(moved)[0]
    assert moved.count((shard,)) >= 4 and len({m for m in moved if m != (shard,)}) >= 2, moved
    from test_pipeline import iteration_only

    half = iteration_only(tmp_path / "ckpt", 2, tmp_path / "ckpt2")
    code, out, err = train(capsys, *flags, *swap, "--load", str(half), "--metrics-file", str(tmp_path / "resumed.jsonl"))
    assert code == 0 and "resumed" in out, err
    whole = losses(tmp_path / "host.jsonl")
    assert losses(tmp_path / "resumed.jsonl") == {i: whole[i] for i in (3, 4)}


@pytest.mark.feature("swap-optimizer")
@pytest.mark.feature("low-precision-optimizer-states")
def test_the_swapped_optimizer_holds_nothing_on_the_device_between_steps(capsys, framework, corpus, monkeypatch):  # noqa: F811
    """The device's share of the optimizer state: all of it without --swap-optimizer, none of it
    between steps with it; what an update brings to the device, counted at each move
    (device.to_device) over two steps with bf16 moments, is at most the piece the log states
    (the master's 4 bytes and the moments' 2 + 2 per element of a third of the slice)."""
    from mindspeed_core import device, ops

    flags = [*SMALL, "--data-path", corpus, "--use-distributed-optimizer", "--train-iters", "2", *LOW_STATES]
    code, out, err = train(capsys, *flags)
    assert code == 0, err
    held = float(re.search(r"optimizer state: ([\d.]+) MiB on this rank", out).group(1))
    assert "between steps" not in out, out  # on the device: all of it
    moved = []
    to_device = device.to_device
    size = {"float32": 4, "bfloat16": 2}
    monkeypatch.setattr(device, "to_device", lambda x: (moved.append(ops.numel(x) * size[ops.dtype_of(x)]),
                                                         to_device(x))[1])
    code, out, err = train(capsys, *flags, "--swap-optimizer", "--swap-optimizer-times", "3")
    assert code == 0, err
    said = re.search(r"optimizer state: ([\d.]+) MiB on this rank.*between steps all of it in host memory "
                     r"\(--swap-optimizer\), ([\d.]+) MiB on the device; an update brings it in 3 pieces of at most "
                     r"([\d.]+) MiB", out)
    assert said and float(said.group(1)) == held and float(said.group(2)) == 0.0, out
    pieces = [sum(moved[k:k + 3]) for k in range(0, len(moved), 3)]  # per piece: master, exp_avg, exp_avg_sq
    assert len(moved) == 2 * 3 * 3 and len(set(pieces)) <= 2, moved  # two steps of three pieces
    assert round(max(pieces) / 2**20, 4) == float(said.group(3)), (pieces, said.group(3))
    assert 3 * max(pieces) >= held * 2**20 * 0.97 and 3 * min(pieces) <= held * 2**20 * 1.03, (pieces, held)


@pytest.mark.parametrize("flags,message", [
    (["--swap-optimizer"], "add --use-distributed-optimizer"),
    (["--swap-optimizer-times", "4"], "qualifies --swap-optimizer"),
])
def test_swap_optimizer_needs_the_distributed_optimizer(capsys, corpus, flags, message):  # noqa: F811
    code, out, err = train(capsys, *MODEL, "--data-path", corpus, "--train-iters", "1", *flags)
    assert code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("flags,want", [
    (["--reuse-fp32-param", "--bf16"], "add --use-distributed-optimizer"),
    (["--reuse-fp32-param", "--use-distributed-optimizer"], "add --bf16"),
])
def test_reuse_fp32_param_needs_bf16_and_the_distributed_optimizer(capsys, framework, corpus, flags, want):  # noqa: F811
    code, out, err = train(capsys, *MODEL, "--data-path", corpus, "--train-iters", "1", *flags)
    # MindSpore: the matrix refuses the flag first (no bf16 on its CPU kernels)
    assert code == 2 and (want if framework == "pytorch" else "reuse-fp32-param") in err, err
    assert "Traceback" not in err


def test_recompute_in_advance_is_refused(capsys, corpus):  # noqa: F811
    code, out, err = train(capsys, *MODEL, "--data-path", corpus, "--train-iters", "1", "--recompute-in-advance")
    assert code == 2 and "recompute-in-advance" in err and "Traceback" not in err, err


def test_measure_refuses_what_it_cannot_measure(capsys, framework):
    code = measure.main(["--ai-framework", framework, *MEASURED_MODEL, "--pipeline-model-parallel-size", "2"])
    assert code == 2 and "one process without pipeline stages" in capsys.readouterr().err


CHUNK = 64  # the measured model's 512 positions in 8 chunks


@pytest.mark.feature("chunk-loss")
def test_chunked_loss_equals_the_whole_loss_and_gradients(framework):
    """--loss-compute-mode chunk: the step's objective (training/losses.py) with the output layer and
    the cross entropy 20 positions at a time (48 = 20 + 20 + 8) gives the loss and gradients of the
    whole logits, with a loss mask (packed SFT) and without."""
    from mindspeed_core import autograd, nn, ops, random
    from mindspeed_core.models.config import ModelConfig
    from mindspeed_core.models.gpt import GPTModel, Tokens
    from mindspeed_core.training.loss_scale import LossScaler
    from mindspeed_core.training.losses import StepLoss

    cfg = ModelConfig(vocab_size=512, hidden_size=32, num_layers=1, num_attention_heads=4, ffn_hidden_size=64,
                      max_position_embeddings=64, init_method_std=0.2)
    random.seed(4)
    model = GPTModel(cfg)
    nn.set_training(model, True)
    rng = np.random.default_rng(5)
    ids, labels = (ops.tensor(rng.integers(0, 512, (2, 48))) for _ in range(2))
    mask = (rng.random((2, 48)) > 0.3).astype(np.float32)
    params = list(nn.parameters(model))
    for tokens in (Tokens(), Tokens(loss_mask=mask)):
        got = {}
        for chunk in (None, 20):
            objective = StepLoss(None, LossScaler(False, 1.0), chunk).of_model(model)
            got[chunk] = autograd.value_and_grad(lambda: objective(ids, labels, tokens), params)()
        (whole, whole_grads), (chunked, chunked_grads) = got[None], got[20]
        assert float(ops.to_numpy(chunked)) == pytest.approx(float(ops.to_numpy(whole)), rel=1e-6)
        for a, b in zip(whole_grads, chunked_grads):
            a, b = ops.to_numpy(a), ops.to_numpy(b)
            np.testing.assert_allclose(b, a, atol=1e-6 * max(np.abs(a).max(), 1e-3), rtol=0)


@pytest.mark.feature("chunk-loss")
def test_chunked_loss_lowers_the_measured_peak_by_the_logits(framework):
    """The measured model's step (measure.py, a fresh process) with a vocabulary of 8192, whose
    logits (64 MiB in float32) outweigh a layer's activations, its loss in 8 chunks: the same loss,
    and a first-step peak lower by at least the whole logits' bytes (without chunks the logits, the
    softmax's saved copy and their gradient are held at once; with them one chunk's)."""
    vocab = ["--vocab-size", "8191"]  # NullTokenizer adds one: 8192
    none = measured(framework, vocab)
    chunked = measured(framework, [*vocab, "--loss-compute-mode", "chunk", "--loss-chunk-size", str(CHUNK)])
    logits = SIZE["b"] * SIZE["s"] * 8192 * 4
    got = none["first_host_peak_bytes"] - chunked["first_host_peak_bytes"]
    print(f"{framework}: measured peak {none['first_host_peak_bytes'] / 2**20:.1f} -> "
          f"{chunked['first_host_peak_bytes'] / 2**20:.1f} MiB, saving {got / 2**20:.1f} MiB; the logits "
          f"{logits / 2**20:.1f} MiB")
    assert chunked["loss"] == pytest.approx(none["loss"], rel=1e-6)
    assert got >= logits, (got, logits)
    if framework == "pytorch":  # what autograd holds at the end of forward: no logits, one input a chunk
        assert none["saved_bytes"] - chunked["saved_bytes"] >= logits, (none, chunked)
