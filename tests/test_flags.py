"""No accepted flag is silently ignored: each flag of `mindspeed train` is gated by a row of
the feature matrix, or changes what `--dry-run` prints (the resolved configuration, or the
one-line refusal when the value cannot be used here), or is on the short list below. A flag
the dry run only echoes (its "run" settings: what to save, load, log and when) shows nothing
acting there, so each such flag names the behavioural test that shows what it does
(RUN_SETTING_TESTS)."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest

from mindspeed_core import cli, features
from mindspeed_core.compat import megatron_args

# Accepted and deliberately without effect, kept so that Megatron / MindSpeed-LLM scripts run
# unchanged. Each entry says why.
ACCEPTED_NO_OPS = {
    # MindSpeed-LLM's flags without effect here: each reason is in compat/megatron_args.py (and --help)
    *megatron_args.ACCEPTED_NO_OPS,
    # Megatron-LM's switch for its low-precision state dtypes: alone it keeps fp32 states (its
    # --exp-avg-dtype / --exp-avg-sq-dtype take effect, and are refused without it)
    "--use-precision-aware-optimizer",
    # Megatron honours --num-query-groups only together with this switch; here
    # --num-query-groups takes effect on its own, so the switch adds nothing.
    "--group-query-attention",
    # Megatron-core 0.16's switch for what is now Megatron's default (and ours): encoding
    # with the tokenizer's special tokens; --tokenizer-hf-no-include-special-tokens turns it off.
    "--tokenizer-hf-include-special-tokens",
    # MindSpeed-LLM needs "general" for packed sequences under CP; here every CP mask is built
    # from each token's column and document, so both values mean the same.
    "--cp-attention-mask-type",
}
# A value of a flag that takes effect otherwise, accepted and deliberately without effect.
NO_OP_VALUES = {
    # MindSpeed-LLM's PLM scaling computes RoPE's own frequencies over the rotated features at
    # --rotary-base: what no scaling computes here
    ("--rope-scaling-type", "plm"),
}
# The walk's own instrument: every run below passes it.
INSTRUMENT = {"--dry-run"}

# Flags whose only mark on the dry run is their echo in its "run" settings, and the test (in
# tests/) that runs each and checks what it does: the walk fails on an echoed flag without one.
RUN_SETTING_TESTS = {
    "--split": "test_training.py::test_loss_falls_and_metrics_are_written",
    "--save": "test_training.py::test_resume_reproduces_the_uninterrupted_run",
    "--save-interval": "test_faults.py::test_dead_rank_stops_the_job_and_the_run_resumes",
    "--load": "test_training.py::test_resume_reproduces_the_uninterrupted_run",
    "--overwrite-checkpoints": "test_reliability.py::test_save_folder_of_another_run_is_refused_unless_resumed_or_overwritten",
    "--eval-interval": "test_training.py::test_loss_falls_and_metrics_are_written",
    "--eval-iters": "test_training.py::test_loss_falls_and_metrics_are_written",
    "--log-interval": "test_operations.py::test_tensorboard_shows_what_the_metrics_file_holds",
    "--exit-interval": "test_training.py::test_resume_reproduces_the_uninterrupted_run",
    "--metrics-file": "test_training.py::test_loss_falls_and_metrics_are_written",
    "--sample-tokens": "test_training.py::test_loss_falls_and_metrics_are_written",
    "--exit-on-missing-checkpoint": "test_training.py::test_exit_on_missing_checkpoint_refuses_an_empty_load_folder",
    "--no-load-optim": "test_training.py::test_no_load_optim_resumes_with_a_fresh_optimizer",
    "--no-load-rng": "test_training.py::test_no_load_rng_resumes_with_fresh_dropout_draws",
    "--no-save-optim": "test_training.py::test_no_save_optim_and_no_save_rng_leave_them_out_of_the_checkpoint",
    "--no-save-rng": "test_training.py::test_no_save_optim_and_no_save_rng_leave_them_out_of_the_checkpoint",
    "--manual-gc": "test_training.py::test_manual_gc_collects_at_its_interval_only",
    "--manual-gc-interval": "test_training.py::test_manual_gc_collects_at_its_interval_only",
    "--no-progress": "test_training.py::test_dry_run_and_hf_initialisation",
}

# Two models, so that a switch that is already the default of one shows on the other:
# the LLaMA-style default and GPT-2 (LayerNorm, GELU, learned positions, tied, biases).
BASES = (
    ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
     "--micro-batch-size", "2", "--train-iters", "2", "--data-path", "/nonexistent/corpus"],
    ["--model-name", "tiny-gpt2", "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2",
     "--data-path", "/nonexistent/corpus"],
)

# Values for flags whose type gives no obvious probe value.
VALUES = {
    "--data-path": ["/elsewhere/corpus"], "--split": ["90,10,0"], "--noop-layers": ["1"], "--qk-clip-alpha": ["0.25"],
    "--tokenizer-type": ["NullTokenizer"], "--tokenizer-name-or-path": ["/nonexistent/tokenizer"],
    "--vocab-file": ["/nonexistent/vocab.json"], "--merge-file": ["/nonexistent/merges.txt"],
    "--model-name": ["tiny-qwen3"], "--load-hf": ["/nonexistent/hf"], "--device": ["npu"],
    "--num-query-groups": ["2"], "--kv-channels": ["16"], "--seq-length": ["8"],
    "--max-position-embeddings": ["64"], "--num-attention-heads": ["2"], "--hidden-size": ["64"],
    "--dpo-label-smoothing": ["0.25"], "--simpo-label-smoothing": ["0.25"], "--reward-tokens": ["+", "-"],
    "--lr-warmup-fraction": ["0.5"], "--padded-vocab-size": ["512"], "--enable-thinking": ["false"],
    "--local-rank": ["0"], "--spec": ["mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec"],
    "--model-type-hf": ["qwen3"], "--long-factor": ["2,2,3,3"], "--short-factor": ["1,1,1.5,1.5"],
    "--long-mscale": ["1.5"], "--short-mscale": ["1.25"], "--moe-input-jitter-eps": ["0.01"],
    "--dataloader-type": ["cyclic"],  # single is what runs here; the others are gated
    "--window-size": ["3,0"], "--softmax-type": ["learnable"],
    "--reward-funcs": ["format"], "--reward-weights": ["2"], "--clip-ratio": ["0.3"], "--clip-ratio-high": ["0.3"],
    "--top-p": ["0.5"],
    "--index-head-dim": ["8"], "--index-topk-pattern": ["FS"],
}


# a latent attention with a query latent (sparse attention's indexer reads it)
LATENT = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "8", "--qk-head-dim", "8",
          "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--qk-layernorm"]
# Flags that qualify another one (as in Megatron): probed with the flag they qualify.
REQUIRES = {
    "--context-parallel-algo": ["--context-parallel-size", "2"],
    "--ulysses-degree-in-cp": ["--context-parallel-size", "2", "--context-parallel-algo", "hybrid_cp_algo"],
    "--recompute-method": ["--recompute-granularity", "full"],
    "--window-attn-skip-freq": ["--window-size", "3,0"],
    "--recompute-num-layers": ["--recompute-granularity", "full"],
    "--vocab-file": ["--tokenizer-type", "GPT2BPETokenizer"],
    "--merge-file": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{where}/vocab.json"],
    "--vocab-size": ["--tokenizer-type", "NullTokenizer"],
    "--initial-loss-scale": ["--fp16"],
    "--pad-to-multiple-of": ["--no-pad-to-seq-lengths", "--stage", "sft"],
    "--recompute-activation-function-num-layers": ["--recompute-activation-function"],
    # the --moe-* flags qualify --num-experts (Megatron ignores them without it)
    **{flag: ["--num-experts", "4"] for flag in (
        "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
        "--moe-router-score-function", "--moe-router-pre-softmax", "--moe-router-topk-scaling-factor",
        "--moe-router-num-groups", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff", "--moe-z-loss-coeff",
        "--moe-router-enable-expert-bias", "--moe-expert-capacity-factor", "--moe-layer-freq",
        "--first-k-dense-replace")},
    "--moe-input-jitter-eps": ["--num-experts", "4"],
    # MindSpeed-LLM's scripts pass it with --loss-compute-mode default, where it reads nothing (as there)
    "--loss-chunk-size": ["--loss-compute-mode", "chunk"],
    # float32 norms among bfloat16 weights: in float32 training every weight is float32 already
    "--init-norm-weight-in-fp32": ["--bf16"],
    # sparse attention's flags qualify --enable-dsa-indexer, on latent attention with a query latent
    **{flag: [*LATENT, *(["--enable-dsa-indexer"] if flag != "--enable-dsa-indexer" else [])]
       for flag in ("--enable-dsa-indexer", "--index-topk", "--index-n-heads", "--index-head-dim",
                    "--indexer-loss-coeff", "--index-topk-freq", "--apply-rope-no-in-complex", "--index-topk-pattern",
                    "--indexer-dense-warmup")},
    "--index-skip-topk-offset": [*LATENT, "--enable-dsa-indexer", "--index-topk-freq", "2"],
    "--enable-mla-scale-q-lora": LATENT, "--enable-mla-scale-kv-lora": LATENT,
    "--num-zero-experts": ["--num-experts", "4"],
    "--seq-aux": ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01"],
    "--n-shared-experts": ["--num-experts", "4"],
    "--router-gating-in-fp32": ["--num-experts", "4"],
    # longrope's lists and scales qualify --rope-scaling-type longrope (heads of 8 dimensions: 4 factors)
    "--long-factor": ["--rope-scaling-type", "longrope", "--short-factor", "1,1,1,1",
                      "--rope-scaling-original-max-position-embeddings", "4"],
    "--short-factor": ["--rope-scaling-type", "longrope", "--long-factor", "2,2,2,2",
                       "--rope-scaling-original-max-position-embeddings", "4"],
    **{flag: ["--rope-scaling-type", "longrope", "--long-factor", "2,2,2,2", "--short-factor", "1,1,1,1",
              "--rope-scaling-original-max-position-embeddings", "4", other, "1.1"]
       for flag, other in (("--long-mscale", "--short-mscale"), ("--short-mscale", "--long-mscale"))},
    "--add-dense-bias": ["--disable-bias-linear"],  # Megatron's default already biases the attention's output
    "--shared-expert-gate": ["--num-experts", "4", "--moe-shared-expert-intermediate-size", "8"],
    "--moe-router-group-topk": ["--num-experts", "4", "--moe-router-num-groups", "2"],
    "--norm-topk-prob": ["--num-experts", "4", "--moe-router-load-balancing-type", "softmax_topk"],
    "--moe-router-bias-update-rate": ["--num-experts", "4", "--moe-router-enable-expert-bias"],
    "--moe-token-drop-policy": ["--num-experts", "4", "--moe-expert-capacity-factor", "1.0"],
    "--moe-pad-expert-input-to-capacity": ["--num-experts", "4", "--moe-expert-capacity-factor", "1.0"],
    # the preference and reward stages' settings qualify their --stage (MindSpeed-LLM ignores them elsewhere)
    **{flag: ["--stage", "dpo"] for flag in ("--dpo-loss-type", "--dpo-beta", "--dpo-label-smoothing")},
    **{flag: ["--stage", "simpo"] for flag in ("--simpo-beta", "--simpo-gamma", "--simpo-label-smoothing")},
    "--reward-tokens": ["--stage", "prm"],
    # online RL's settings and its rollouts' sampling qualify --stage grpo (generate's sampling is its own verb's)
    **{flag: ["--stage", "grpo"] for flag in (
        "--num-generations", "--max-completion-length", "--reward-funcs", "--reward-model", "--reward-weights",
        "--scale-rewards",
        "--grpo-loss-type", "--kl-coef", "--use-bias-correction-kl", "--clip-ratio", "--clip-ratio-high", "--ppo-epochs", "--temperature",
        "--top-k", "--top-p")},
    # the other --lora-* flags qualify the adapters that --lora-r switches on
    **{flag: ["--lora-r", "4"] for flag in ("--lora-alpha", "--lora-dropout")},
    "--tokenizer-hf-no-include-special-tokens": ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path",
                                                 "{where}/tokenizer.json"],
}


def _probes(action: argparse.Action, framework: str, where: str) -> list[list[str]]:
    """Values to try: every non-default choice, else one valid value."""
    flag = action.option_strings[0]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return [[flag]]
    if flag == "--ai-framework":
        return [[flag, "mindspore" if framework == "pytorch" else "pytorch"]]
    if flag in VALUES:
        return [[flag, *VALUES[flag]]]
    if action.choices:
        return [[flag, str(c)] for c in action.choices if c != action.default]
    if action.type is megatron_args.PROBABILITY:
        return [[flag, "0.25"]]
    if action.type is not None and action.type.__name__ == "parse":  # the parser's typed numbers
        return [[flag, "3"]]
    return [[flag, f"{where}/{flag.strip('-')}"]]


def _tiny_hf_tokenizer(path):
    """A tokenizer.json whose post-processor puts <s> first (the flags about special tokens)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path))


def _dry_run(capsys, argv, progress=False):
    code = cli.main(["train", "--dry-run", *([] if progress else ["--no-progress"]), *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err.strip()


def _flags():
    parser = megatron_args.training_parser()
    return [a for a in parser._actions if a.option_strings and a.option_strings[0] != "-h"]


def _gates(flag: str, argv: list[str]) -> list[str]:
    args = megatron_args.training_parser().parse_args(argv)
    return [f.id for f in features.active_features(args) if any(x.split()[0] == flag for x in f.flags)]


def _effects(capsys, flag, probe, where) -> list[str]:
    effects = []
    for base in BASES:
        base = [*base, *(a.format(where=where) for a in REQUIRES.get(flag, []))]
        gates = _gates(flag, [*base, *probe])
        if gates:
            effects.append(f"gated by {gates}")
        if flag == "--no-progress":  # every run of the walk passes it: compare with its absence
            before, after = _dry_run(capsys, base), _dry_run(capsys, base, progress=True)
        else:
            before, after = _dry_run(capsys, base), _dry_run(capsys, [*base, *probe])
        if before != after:
            effects.append(ECHOED if _only_echoed(before, after) else "changes the dry run")
    return effects


ECHOED = "echoed in the dry run's run settings"


def _only_echoed(before, after) -> bool:
    """Both dry runs printed a configuration, and they differ only in its "run" settings."""
    (code_a, a, _), (code_b, b, _) = before, after
    if code_a or code_b:
        return False
    return {k: v for k, v in a.items() if k != "run"} == {k: v for k, v in b.items() if k != "run"}


@pytest.mark.parametrize("action", _flags(), ids=lambda a: a.option_strings[0])
def test_every_flag_is_gated_or_takes_effect_or_is_a_listed_no_op(capsys, framework, tmp_path, action):
    flag = action.option_strings[0]
    if flag in INSTRUMENT:
        return
    (tmp_path / "vocab.json").write_text("{}")
    _tiny_hf_tokenizer(tmp_path / "tokenizer.json")
    for probe in _probes(action, framework, str(tmp_path)):
        effects = _effects(capsys, flag, probe, str(tmp_path))
        if flag in ACCEPTED_NO_OPS or tuple(probe[:2]) in NO_OP_VALUES:
            assert not effects, f"{' '.join(probe)} is listed as a no-op but {effects}: take it off the list"
        else:
            assert effects, f"{' '.join(probe)} is accepted but changes nothing: make it take effect, gate it in " \
                            f"the matrix, or list it (with the reason) in ACCEPTED_NO_OPS"
        if set(effects) == {ECHOED}:
            assert flag in RUN_SETTING_TESTS, f"{flag} is only echoed by the dry run: name the test that shows it act " \
                                              "in RUN_SETTING_TESTS"
            module, test = RUN_SETTING_TESTS[flag].split("::")
            source = (pathlib.Path(__file__).with_name(module)).read_text()
            assert f"def {test}(" in source and f'"{flag}"' in source, (flag, RUN_SETTING_TESTS[flag])


def test_the_walk_catches_a_flag_that_does_nothing(capsys, monkeypatch, tmp_path):
    """A flag the parser accepts and nothing reads fails the walk."""
    original = megatron_args.add_training_args

    def with_dead_flag(parser):
        original(parser)
        parser.add_argument("--dead-flag", action="store_true")

    monkeypatch.setattr(megatron_args, "add_training_args", with_dead_flag)
    dead = next(a for a in _flags() if a.option_strings[0] == "--dead-flag")
    with pytest.raises(AssertionError, match="changes nothing"):
        test_every_flag_is_gated_or_takes_effect_or_is_a_listed_no_op(capsys, "pytorch", tmp_path, dead)


def test_the_walk_asks_an_echoed_flag_for_its_test(capsys, monkeypatch, tmp_path):
    """A flag the dry run only echoes, without a test named in RUN_SETTING_TESTS, fails the walk."""
    monkeypatch.delitem(RUN_SETTING_TESTS, "--manual-gc")
    echoed = next(a for a in _flags() if a.option_strings[0] == "--manual-gc")
    with pytest.raises(AssertionError, match="only echoed by the dry run"):
        test_every_flag_is_gated_or_takes_effect_or_is_a_listed_no_op(capsys, "pytorch", tmp_path, echoed)
