"""Online RL (mindspeed train --stage grpo, training/grpo.py) on a tiny model, in this process.

The objective is checked against the GRPO formula written out again here in float64 numpy,
on log-probabilities from numeric.py's own forward pass; the loop against a reward it can
learn quickly (the share of digits in a completion), whose mean must rise.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mindspeed_core import cli, nn, ops, random
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.gpt import GPTModel
from mindspeed_core.training import grpo

import numeric

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "64", "--seq-length", "32", "--make-vocab-size-divisible-by", "8",
         "--tokenizer-type", "ByteLevel", "--eval-iters", "0", "--no-progress", "--split", "100,0,0", "--seed", "3",
         "--sample-tokens", "0"]

# ---- rewards and advantages ------------------------------------------------------------------

@pytest.mark.framework_free
@pytest.mark.parametrize("text, answer", [
    ("so the total is #### 42", "42"), ("#### 1,234.", "1234"), ("a \\boxed{7} then \\boxed{3.0}", "3"),
    ("#### 2.5", "2.5"), ("#### x + 1", "x + 1"), ("no answer here", None)])
def test_final_answer(text, answer):
    assert grpo.final_answer(text) == answer


@pytest.mark.framework_free
def test_accuracy_and_format_rewards():
    completions = ["<think>2 and 3</think> #### 5", "#### 6", "\\boxed{5}", "<think>x</think>"]
    assert grpo.accuracy_reward(completions, ["#### 5", "5", "5", "5"], [""] * 4) == [1.0, 0.0, 1.0, 0.0]
    assert grpo.format_reward(completions, [None] * 4, [""] * 4) == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(MindSpeedError, match="needs reference answers"):
        grpo.accuracy_reward(["#### 1"], [None], [""])


@pytest.mark.framework_free
def test_group_advantages():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    got = grpo.group_advantages(rewards, 4)
    first = np.array([0.5, -0.5, -0.5, 0.5]) / (np.std([1, 0, 0, 1], ddof=1) + grpo.SCALE_EPS)
    np.testing.assert_allclose(got, np.concatenate([first, np.zeros(4)]))
    np.testing.assert_allclose(grpo.group_advantages(rewards, 4, "none"), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


@pytest.mark.framework_free
def test_reward_functions_by_import_path():
    functions = grpo.reward_functions(["accuracy", "grpo_rewards:digits"])
    total, each = grpo.score(functions, [1.0, 0.5], ["#### 12", "ab"], ["12", "3"], ["", ""])
    np.testing.assert_allclose(each, [[1.0, 0.0], [2 / 7, 0.0]])
    np.testing.assert_allclose(total, [1.0 + 1 / 7, 0.0])
    with pytest.raises(MindSpeedError, match="one finite number per completion"):
        grpo.score(grpo.reward_functions(["grpo_rewards:wrong_length"]), [1.0], ["a", "b"], [None, None], ["", ""])
    for bad, message in (("nothing", "nor package.module:function"), ("grpo_rewards:absent", "cannot import it"),
                         ("no_such_module:f", "cannot import it")):
        with pytest.raises(MindSpeedError, match=message):
            grpo.reward_functions([bad])


# ---- the objective against numpy -------------------------------------------------------------

def _settings(**given) -> grpo.Settings:
    """GRPO's settings as the flags' defaults make them (clip range 0.2 / 0.28), with ``given``."""
    return grpo.Settings(**{**dict(num_generations=4, max_completion_length=8, temperature=1.0, top_k=0, top_p=1.0,
                                   clip_ratio=0.2, clip_ratio_high=0.28, kl_coef=0.0, loss_type="grpo",
                                   kl_correction=False, scale_rewards="group", ppo_epochs=1,
                                   reward_funcs=("accuracy",), reward_model=None, reward_weights=(1.0,)), **given})


def _numpy_grpo(logp, old, ref, mask, advantages, low, high, beta, loss_type, max_length):
    ratio = np.exp(logp - old)
    a = advantages[:, None]
    per_token = -np.minimum(ratio * a, np.clip(ratio, 1 - low, 1 + high) * a)
    if beta:
        q = ref - logp
        per_token = per_token + beta * (np.exp(q) - q - 1)
    if loss_type == "grpo":
        return float(np.mean((per_token * mask).sum(1) / mask.sum(1)))
    if loss_type == "bnpo":
        return float((per_token * mask).sum() / mask.sum())
    if loss_type == "dapo":  # this micro-batch's share: the step's tokens over its micro-batches (here 17)
        return float((per_token * mask).sum() / 17.0)
    return float((per_token * mask).sum() / (mask.shape[0] * max_length))


@pytest.mark.feature("stage-grpo")
@pytest.mark.parametrize("loss_type, beta, temperature", [("grpo", 0.04, 1.0), ("bnpo", 0.0, 1.0),
                                                          ("dr_grpo", 0.1, 0.7), ("dapo", 0.04, 1.0)])
def test_objective_equals_numpy(loss_type, beta, temperature):
    """(log-probabilities at the sampling temperature, as the completions were drawn)"""
    random.seed(5)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                      vocab_size=64, max_position_embeddings=32)
    model = GPTModel(cfg)
    state = {n: ops.to_numpy(p).astype(np.float64) for n, p in nn.named_parameters(model)}
    rng = np.random.default_rng(0)
    rows, length, max_length = 4, 12, 8
    tokens = rng.integers(1, 64, (rows, length + 1))
    mask = np.zeros((rows, length), np.float32)
    for i, (start, end) in enumerate([(3, 11), (5, 12), (2, 6), (4, 9)]):  # each row's completion tokens
        mask[i, start:end] = 1.0
    logits = np.stack([numeric.gpt_logits(state, cfg, row[:-1]) for row in tokens]) / temperature
    logp = np.take_along_axis(numeric.log_softmax(logits), tokens[:, 1:, None], axis=-1)[..., 0]
    old = logp + rng.normal(0, 0.3, logp.shape)  # ratios on both sides of the clip range
    ref = logp + rng.normal(0, 0.3, logp.shape)
    advantages = np.array([1.2, -0.7, 0.3, -1.5])
    objective = grpo.Objective(_settings(kl_coef=beta, loss_type=loss_type, max_completion_length=max_length,
                                         temperature=temperature))
    ids = ops.tensor(np.ascontiguousarray(tokens[:, :-1]))
    target = grpo.Rollout(ops.tensor(np.ascontiguousarray(tokens[:, 1:])), mask, advantages, old.astype(np.float32),
                          ref.astype(np.float32), tokens_per_micro_batch=17.0)
    got = float(ops.to_numpy(objective(model, model(ids), target)))
    want = _numpy_grpo(logp, old.astype(np.float32), ref.astype(np.float32), mask, advantages, 0.2, 0.28, beta,
                       loss_type, max_length)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
    clip_fraction, kl = objective.take_stats()
    ratio = np.exp(logp - old)
    clipped = ((ratio < 0.8) & (advantages[:, None] < 0)) | ((ratio > 1.28) & (advantages[:, None] > 0))
    assert clip_fraction == pytest.approx((clipped * mask).sum() / mask.sum(), abs=1e-6) and clip_fraction > 0
    q = ref - logp
    assert kl == (pytest.approx(((np.exp(q) - q - 1) * mask).sum() / mask.sum(), rel=1e-4) if beta else 0.0)


# ---- the loop --------------------------------------------------------------------------------

def sums_corpus(root) -> str:
    """Sums of two digits as instruction data (the answers after GSM8K's ####), preprocessed for
    --seq-length 32; every prompt is 4 tokens."""
    rng = np.random.default_rng(0)
    with open(root / "sums.jsonl", "w") as fh:
        for a, b in rng.integers(0, 5, (64, 2)):
            fh.write(json.dumps({"instruction": f"{a}+{b}=", "output": f"#### {a + b}"}) + "\n")
    prefix = str(root / "out" / "sums")
    assert cli.main(["preprocess", "--input", str(root / "sums.jsonl"), "--output-prefix", prefix, "--handler-name",
                     "AlpacaStyleInstructionHandler", "--tokenizer-type", "ByteLevel", "--seq-length", "32"]) == 0
    return prefix


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    return {"root": root, "data": sums_corpus(root)}


def records(path) -> list[dict]:
    return [r for r in map(json.loads, open(path)) if "loss" in r]


@pytest.mark.feature("stage-grpo")
@pytest.mark.feature("sampling-generation")
def test_the_reward_rises(prompts, tmp_path, capsys):
    """10 iterations of 4 prompts x 8 completions of 8 tokens, rewarded by their share of
    digits (about 4% of the byte vocabulary at the start): the mean reward of the last five
    iterations must be at least 0.3 above the first three's (measured: 0.04 -> 0.7 on both
    frameworks, about 0.9 by the tenth); every figure is logged."""
    metrics = str(tmp_path / "m.jsonl")
    assert cli.main(["train", *MODEL, "--stage", "grpo", "--data-path", prompts["data"], "--num-generations", "8",
                     "--global-batch-size", "4", "--micro-batch-size", "16", "--max-completion-length", "8",
                     "--reward-funcs", "grpo_rewards:digits", "accuracy", "--reward-weights", "1", "0.5",
                     "--train-iters", "10", "--lr", "5e-2", "--lr-decay-style", "constant", "--log-interval", "1",
                     "--metrics-file", metrics]) == 0
    out = capsys.readouterr().out
    assert "reward grpo rewards:digits" not in out  # names are made safe for boards
    rows = records(metrics)
    assert [r["iteration"] for r in rows] == list(range(1, 11))
    reward = [r["train_reward_grpo_rewards_digits"] for r in rows]
    first, last = np.mean(reward[:3]), np.mean(reward[-5:])
    assert last >= first + 0.3, reward
    for r in rows:  # the total is the weighted sum of the functions' means
        assert r["train_reward"] == pytest.approx(r["train_reward_grpo_rewards_digits"] + 0.5 * r["train_reward_accuracy"],
                                                  abs=1e-5)
        assert {"train_clip_fraction", "train_kl", "train_completion_length", "train_reward_std"} <= set(r)
        assert 0 < r["train_entropy"] < np.log(264)  # nats, of the distributions drawn from
        assert 0 < r["train_completion_length"] <= 8 and r["train_kl"] >= 0
        assert {"rollout", "forward-backward", "optimizer"} <= set(r["timers"])
    assert max(r["train_kl"] for r in rows) > 0  # the policy moved away from the reference


@pytest.mark.feature("stage-grpo")
def test_two_epochs_clip_against_the_drawing_policy(prompts, tmp_path):
    """With --ppo-epochs 2 the second step's ratios are to the policy that drew the rollouts
    (recorded before the first step): at a large learning rate some are clipped."""
    metrics = str(tmp_path / "m.jsonl")
    assert cli.main(["train", *MODEL, "--stage", "grpo", "--data-path", prompts["data"], "--num-generations", "4",
                     "--global-batch-size", "2", "--micro-batch-size", "8", "--max-completion-length", "6",
                     "--reward-funcs", "grpo_rewards:digits", "--ppo-epochs", "2", "--kl-coef", "0",
                     "--train-iters", "3", "--lr", "1e-1", "--log-interval", "1", "--metrics-file", metrics]) == 0
    rows = records(metrics)
    assert len(rows) == 3 and all(r["train_kl"] == 0 for r in rows)
    assert max(r["train_clip_fraction"] for r in rows) > 0


@pytest.mark.feature("stage-grpo")
def test_dapo_does_not_depend_on_the_micro_batches(prompts, tmp_path):
    """dapo averages over the step's completion tokens: one micro-batch of 8 completions or two
    of 4 give the same steps."""
    runs = []
    for size in ("8", "4"):
        metrics = str(tmp_path / f"m{size}.jsonl")
        assert cli.main(["train", *MODEL, "--stage", "grpo", "--data-path", prompts["data"], "--num-generations", "4",
                         "--global-batch-size", "2", "--micro-batch-size", size, "--max-completion-length", "6",
                         "--reward-funcs", "grpo_rewards:digits", "--grpo-loss-type", "dapo", "--train-iters", "2",
                         "--lr", "3e-2", "--log-interval", "1", "--metrics-file", metrics]) == 0
        runs.append(records(metrics))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in runs[1]] == pytest.approx([r[key] for r in runs[0]], rel=1e-5, abs=1e-7), key
    assert runs[0][1]["loss"] != 0


@pytest.mark.feature("stage-grpo")
@pytest.mark.feature("handler-alpaca-ppo")
def test_prompt_only_data(prompts, tmp_path, capsys):
    """PPOAlpacaStyleInstructionHandler's prompts (no replies): rewards that need no reference
    train on them; the exact-answer reward says what it misses, in one line."""
    records_in = [{"instruction": f"{a}+{b}=", "output": f"#### {a + b}"} for a in range(4) for b in range(4)]
    (tmp_path / "ppo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records_in))
    prefix = str(tmp_path / "out" / "ppo")
    assert cli.main(["preprocess", "--input", str(tmp_path / "ppo.jsonl"), "--output-prefix", prefix,
                     "--handler-name", "PPOAlpacaStyleInstructionHandler", "--tokenizer-type", "ByteLevel",
                     "--seq-length", "32"]) == 0
    common = ["train", *MODEL, "--stage", "grpo", "--data-path", prefix, "--num-generations", "4",
              "--global-batch-size", "2", "--micro-batch-size", "8", "--max-completion-length", "6",
              "--train-iters", "2", "--log-interval", "1"]
    metrics = str(tmp_path / "m.jsonl")
    assert cli.main([*common, "--reward-funcs", "grpo_rewards:digits", "--metrics-file", metrics]) == 0
    assert len(records(metrics)) == 2
    capsys.readouterr()
    assert cli.main([*common, "--reward-funcs", "accuracy"]) != 0
    err = capsys.readouterr().err
    assert "--reward-funcs accuracy needs reference answers" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flags, message", [
    (["--num-generations", "1", "--micro-batch-size", "2"], "need --num-generations 2 or more"),
    (["--global-batch-size", "2", "--micro-batch-size", "3"], "not a multiple of --micro-batch-size 3"),
    (["--reward-weights", "1", "2"], "--reward-weights gives 2 weights for 1 --reward-funcs"),
    (["--reward-funcs", "no_such_module:f"], "cannot import it"),
    (["--max-completion-length", "30"], "do not fit --seq-length 32"),
    (["--reward-funcs"], "--stage grpo needs a reward"),
    (["--reward-model", "/nonexistent/orm"], "--reward-model /nonexistent/orm does not exist"),
])
def test_bad_grpo_options_are_one_line_errors(prompts, capsys, flags, message):
    argv = ["train", *MODEL, "--stage", "grpo", "--data-path", prompts["data"], "--train-iters", "1",
            "--num-generations", "4", "--global-batch-size", "2", "--micro-batch-size", "8", *flags]
    assert cli.main(argv) != 0
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flags, message", [
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "drop --sequence-parallel"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2"], "drop --expert-model-parallel-size"),
])
def test_grpo_refuses_the_layouts_its_generator_cannot_run(prompts, flags, message):
    """(on four ranks, as a launch would configure them)"""
    from mindspeed_core.compat import megatron_args
    from mindspeed_core.training import configuration

    args = megatron_args.training_parser().parse_args([*MODEL, "--stage", "grpo", "--data-path", prompts["data"],
                                                       "--num-generations", "4", "--micro-batch-size", "4", *flags])
    with pytest.raises(MindSpeedError, match=message):
        configuration.configure(args, 4)


def test_grpo_without_data_says_what_to_preprocess(capsys):
    assert cli.main(["train", "--stage", "grpo", "--train-iters", "1"]) != 0
    err = capsys.readouterr().err
    assert "--stage grpo trains on preprocessed instruction (prompts with reference answers) data" in err, err


@pytest.mark.feature("stage-grpo")
@pytest.mark.feature("sft")
def test_the_documented_example_runs_as_written(framework, tmp_path):
    """The GRPO block of docs/rl.md as written (bash, fresh processes, --ai-framework added to its
    `mindspeed train` lines), at a tenth of its iterations: fine-tuning on half-wrong sums, then
    GRPO with the exact-answer reward, then the plot. The same code path as the full block, which
    takes minutes here; that GRPO raises a reward is test_the_reward_rises' proof, and the page's
    measured rise was measured with the block as written."""
    import os
    import pathlib
    import subprocess
    import sys

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "rl.md").read_text()
    block = page[page.index("<!-- grpo-example -->"):]
    block = block[block.index("```bash\n") + 8:block.index("\n```\n", block.index("```bash\n"))]
    assert block.count("mindspeed train ") == 2
    script = block.replace("mindspeed train ", f"mindspeed train --ai-framework {framework} ")
    for full, reduced in (("--train-iters 30 ", "--train-iters 3 "), ("--train-iters 300 ", "--train-iters 30 ")):
        assert script.count(full) == 1, full
        script = script.replace(full, reduced)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    done = subprocess.run(["bash", "-e", "-c", script], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    reward = [r["train_reward"] for r in records(tmp_path / "rl" / "grpo.jsonl")]
    assert len(reward) == 3 and all(0 <= r <= 1 for r in reward), reward
    assert (tmp_path / "rl" / "reward.png").stat().st_size > 0


TRL_CASES = [("grpo", False), ("bnpo", False), ("dr_grpo", True)]  # (loss type, --use-bias-correction-kl)


@pytest.mark.feature("stage-grpo")
def test_loss_and_gradients_equal_trls(tmp_path):
    """TRL's GRPOTrainer (its own _compute_loss, in an environment of its own: trl_reference.py)
    on the same weights, completions, advantages and old / reference log-probabilities, at a
    sampling temperature of 0.8, with ratios both sides of the clip range and the KL term (and
    TRL's default weighting of it by the ratio, --use-bias-correction-kl), for each of
    TRL_CASES: the same loss, and the same gradient of every weight (ours put in Hugging Face's
    layout by the weight converter, which is linear)."""
    import os
    import subprocess

    from mindspeed_core import autograd
    from mindspeed_core.compat import hf

    trl_python = os.environ.get("MINDSPEED_TRL_PYTHON")
    if not trl_python:
        pytest.skip("MINDSPEED_TRL_PYTHON (a Python with trl installed) is not set; .ci/run makes one")
    random.seed(7)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                      vocab_size=64, max_position_embeddings=32)
    model = GPTModel(cfg)
    names = [n for n, _ in nn.named_parameters(model)]
    state = {n: ops.to_numpy(p) for n, p in nn.named_parameters(model)}
    hf.save_folder(str(tmp_path / "hf"), cfg, state)
    rng = np.random.default_rng(1)
    rows, prompt, completion, temperature = 4, 5, 6, 0.8
    tokens = rng.integers(2, 64, (rows, prompt + completion))
    completion_mask = np.ones((rows, completion), np.int64)
    completion_mask[1, 4:] = completion_mask[3, 2:] = 0  # two completions ended early
    logits = np.stack([numeric.gpt_logits({n: v.astype(np.float64) for n, v in state.items()}, cfg, row[:-1])
                       for row in tokens]) / temperature
    policy = np.take_along_axis(numeric.log_softmax(logits), tokens[:, 1:, None], axis=-1)[:, prompt - 1:, 0]
    old = (policy + rng.normal(0, 0.3, policy.shape)).astype(np.float32)
    reference = (policy + rng.normal(0, 0.3, policy.shape)).astype(np.float32)
    advantages = np.array([1.1, -0.6, 0.4, -0.9], np.float32)
    np.savez(tmp_path / "batch.npz", prompt_ids=tokens[:, :prompt], completion_ids=tokens[:, prompt:],
             completion_mask=completion_mask, advantages=advantages, old=old, reference=reference)
    settings = [{"beta": 0.05, "epsilon": 0.2, "epsilon_high": 0.28, "loss_type": loss_type,
                 "temperature": temperature, "max_completion_length": completion, "num_generations": 2,
                 "kl_correction": correction} for loss_type, correction in TRL_CASES]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINDSPEED", "PYTHON"))}
    done = subprocess.run([trl_python, os.path.join(os.path.dirname(__file__), "trl_reference.py"),
                           str(tmp_path / "batch.npz"), str(tmp_path / "hf"), json.dumps(settings),
                           str(tmp_path / "trl")], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]

    def ours_layout(x):  # [rows, completion] -> [rows, positions]: completion token j is read at prompt - 1 + j
        out = np.zeros((rows, prompt + completion - 1), np.float32)
        out[:, prompt - 1:] = x
        return out

    for k, (loss_type, correction) in enumerate(TRL_CASES):
        settings = _settings(kl_coef=0.05, loss_type=loss_type, max_completion_length=completion,
                             temperature=temperature, kl_correction=correction)
        target = grpo.Rollout(ops.tensor(np.ascontiguousarray(tokens[:, 1:])), ours_layout(completion_mask),
                              advantages, ours_layout(old), ours_layout(reference))
        objective = grpo.Objective(settings)
        loss, grads = autograd.value_and_grad(lambda ids: objective(model, model(ids), target),
                                              nn.parameters(model))(ops.tensor(np.ascontiguousarray(tokens[:, :-1])))
        ours = hf.to_hf_state(cfg, {n: ops.to_numpy(g) for n, g in zip(names, grads)})
        theirs = dict(np.load(tmp_path / f"trl{k}.npz"))
        assert float(ops.to_numpy(loss)) == pytest.approx(float(theirs.pop("loss")), rel=1e-5, abs=1e-7), loss_type
        assert sorted(theirs) == sorted(ours)
        for name, want in theirs.items():
            worst = float(np.max(np.abs(ours[name] - want))) / max(float(np.max(np.abs(want))), 1e-12)
            assert worst < 1e-4, (loss_type, name, worst)


@pytest.fixture(scope="module")
def reward_model(prompts):
    return train_reward_model(prompts["root"])


def train_reward_model(root) -> str:
    """An outcome reward model (--stage orm, three steps from scratch) on pairs of answers to the
    sums: the right one chosen, one off by one rejected. Returns its checkpoint folder."""
    with open(root / "pairs.jsonl", "w") as fh:
        for a in range(5):
            for b in range(5):
                fh.write(json.dumps({"instruction": f"{a}+{b}=", "chosen": f"#### {a + b}",
                                     "rejected": f"#### {a + b + 1}"}) + "\n")
    pairs = str(root / "out" / "pairs")
    assert cli.main(["preprocess", "--input", str(root / "pairs.jsonl"), "--output-prefix", pairs, "--handler-name",
                     "AlpacaStylePairwiseHandler", "--tokenizer-type", "ByteLevel", "--seq-length", "32"]) == 0
    folder = str(root / "orm")
    assert cli.main(["train", *MODEL, "--stage", "orm", "--data-path", pairs, "--micro-batch-size", "4",
                     "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-2", "--save", folder]) == 0
    return folder


@pytest.mark.feature("stage-grpo")
@pytest.mark.feature("stage-orm")
def test_a_reward_model_scores_completions(prompts, reward_model, tmp_path):
    """--reward-model: the value where the model has read a completion's last token, as a float64
    numpy forward of its weights gives it; then GRPO runs on it alone."""
    from mindspeed_core.training import checkpoint

    rm = grpo.RewardModel(reward_model, 264)
    prompt, replies = [ord(c) for c in "3+4="], [[ord(c) for c in "#### 7"], [ord(c) for c in "#### 8"], [ord("#")]]
    ids, _, mask = grpo.rows_of([prompt] * 3, replies, [True, False, True], 32, 0, 256)
    got = rm.score(ids, mask, 2)
    iteration = checkpoint.latest_iteration(reward_model)
    state = checkpoint.load_model_arrays(reward_model, iteration)
    cfg = ModelConfig.from_dict(checkpoint.read_meta(reward_model, iteration)["model"])
    head = {k: v.astype(np.float64) for k, v in {**state, "output_layer.weight": state["rm_head.weight"]}.items()}
    want = [numeric.gpt_logits(head, cfg, np.array(prompt + reply + ([256] if stop else [])))[-1, 0]
            for reply, stop in zip(replies, [True, False, True])]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    metrics = str(tmp_path / "m.jsonl")
    assert cli.main(["train", *MODEL, "--stage", "grpo", "--data-path", prompts["data"], "--num-generations", "4",
                     "--global-batch-size", "2", "--micro-batch-size", "8", "--max-completion-length", "6",
                     "--reward-funcs", "--reward-model", reward_model, "--train-iters", "2", "--log-interval", "1",
                     "--metrics-file", metrics]) == 0
    rows = records(metrics)
    assert all(r["train_reward"] == pytest.approx(r["train_reward_model"], abs=1e-6) for r in rows)
    assert all(r["train_reward_std"] > 0 for r in rows)


def test_the_reward_model_is_checked_from_its_configuration_alone(prompts, reward_model, tmp_path, monkeypatch):
    """The check before any rank starts reads no weights (the trainer reads them once); a
    language model's folder (config.json alone is enough to tell) is a one-line error."""
    from mindspeed_core.compat import hf, megatron_args
    from mindspeed_core.training import checkpoint, configuration

    def parsed(folder, *extra):
        return megatron_args.training_parser().parse_args(
            [*MODEL, "--stage", "grpo", "--data-path", prompts["data"], "--num-generations", "4",
             "--micro-batch-size", "4", "--reward-funcs", "--reward-model", folder, *extra])

    read = []
    monkeypatch.setattr(checkpoint, "load_model_arrays", lambda *a, **k: read.append(a))
    configuration.configure(parsed(reward_model), 1)
    assert read == []
    # a policy padded to another vocabulary than the reward model's: said before any rank starts
    with pytest.raises(MindSpeedError, match="has a vocabulary of 264 tokens, the policy 384"):
        configuration.configure(parsed(reward_model, "--make-vocab-size-divisible-by", "128"), 1)
    lm = tmp_path / "lm"
    lm.mkdir()
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=264)
    (lm / "config.json").write_text(json.dumps(hf.hf_config(cfg)))
    with pytest.raises(MindSpeedError, match="is a language model, not a reward model"):
        configuration.configure(parsed(str(lm)), 1)
