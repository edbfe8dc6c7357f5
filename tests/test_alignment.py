"""Preference alignment and reward models (mindspeed train --stage dpo | simpo | orm | prm,
training/alignment.py), on a tiny model, in this process.

Every loss is checked against a reference computed here in float64 numpy from the saved
weights and the preprocessed token files: the replies' log-likelihoods by numeric.py's own
forward pass, then each paper's formula written out again. The parallel layouts of these
stages are in test_parallel.py (their curves equal these single-process ones).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from mindspeed_core import cli
from mindspeed_core.data.indexed import IndexedDataset
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.training import checkpoint

import numeric

IGNORE = -100
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "64", "--seq-length", "96", "--make-vocab-size-divisible-by", "8",
         "--tokenizer-type", "ByteLevel", "--eval-iters", "0", "--log-interval", "1", "--no-progress",
         "--split", "100,0,0", "--seed", "3", "--sample-tokens", "0", "--micro-batch-size", "4",
         "--global-batch-size", "4"]  # one micro-batch of every pair: a step's loss is the mean over all of them
PAIRS = [("add 2 and 3", "5", "6"), ("name a colour", "blue", "seven"), ("say hi", "hi there", "bye"),
         ("count to 3", "1 2 3", "3 2 1")]
# step-labelled sums: '@' ends a step, '+' / '-' says whether it was right
STEPS = [("1+1=2@2+2=5@", ["+", "-"]), ("3+4=7@", ["+"]), ("9+0=8@1+2=3@5+5=10@", ["-", "+", "+"]),
         ("6+1=7@7+1=9@", ["+", "-"])]


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)


def train(*flags) -> str:
    code = cli.main(["train", *MODEL, *flags])
    assert code == 0, flags
    return flags[flags.index("--metrics-file") + 1] if "--metrics-file" in flags else ""


def records(path) -> dict:
    return {r["iteration"]: r for r in map(json.loads, open(path)) if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Preference pairs and step-labelled sums preprocessed; a base model (the starting
    weights, saved by a step at lr 0); DPO from it for 3 of 4 planned steps (saved at 3)."""
    root = tmp_path_factory.mktemp("alignment")
    write_jsonl(root / "pairs.jsonl", [{"instruction": q, "chosen": c, "rejected": r} for q, c, r in PAIRS])
    write_jsonl(root / "steps.jsonl", [{"input": text, "value": labels} for text, labels in STEPS])
    pairs, steps = str(root / "out" / "pairs"), str(root / "out" / "steps")
    assert cli.main(["preprocess", "--input", str(root / "pairs.jsonl"), "--output-prefix", pairs, "--handler-name",
                     "AlpacaStylePairwiseHandler", "--prompt-type", "chatml", "--seq-length", "96"]) == 0
    assert cli.main(["preprocess", "--input", str(root / "steps.jsonl"), "--output-prefix", steps, "--handler-name",
                     "AlpacaStyleProcessRewardHandler", "--placeholder-token", "@", "--reward-tokens", "+", "-",
                     "--seq-length", "96"]) == 0
    base, dpo = str(root / "base"), str(root / "dpo")
    train("--stage", "dpo", "--data-path", pairs, "--train-iters", "1", "--lr", "0", "--save", base)
    train("--stage", "dpo", "--data-path", pairs, "--load", base, "--finetune", "--train-iters", "4", "--lr", "1e-2",
          "--save", dpo, "--save-interval", "3", "--exit-interval", "3", "--metrics-file", str(root / "dpo.jsonl"))
    return {"root": root, "pairs": pairs, "steps": steps, "base": base, "dpo": dpo, "dpo_metrics": root / "dpo.jsonl"}


def weights(folder: str, iteration: int):
    cfg = ModelConfig.from_dict(checkpoint.read_meta(folder, iteration)["model"])
    return checkpoint.load_model_arrays(folder, iteration), cfg


def sequences(prefix: str, key: str) -> list[np.ndarray]:
    ds = IndexedDataset(f"{prefix}_packed_{key}_document")
    return [ds[s].astype(np.int64) for s in range(len(ds))]


def reply_log_likelihoods(state, cfg, prefix: str, side: str) -> tuple[np.ndarray, np.ndarray]:
    """(sum of log p over each reply's trained tokens, their count), per pair, float64."""
    sums, counts = [], []
    for ids, labels in zip(sequences(prefix, side + "_input_ids"), sequences(prefix, side + "_labels")):
        trained = labels[1:] != IGNORE
        sums.append(float(numeric.token_log_probs(state, cfg, ids)[trained].sum()))
        counts.append(int(trained.sum()))
    return np.array(sums), np.array(counts)


def log_sigmoid(x):
    return -np.log1p(np.exp(-x))


def policy_and_reference(runs):
    policy, cfg = weights(runs["dpo"], 3)
    reference, _ = weights(runs["base"], 1)
    return {(who, side): reply_log_likelihoods(state, cfg, runs["pairs"], side)
            for who, state in (("policy", policy), ("reference", reference)) for side in ("chosen", "rejected")}


@pytest.mark.feature("stage-dpo")
def test_dpo_starts_at_log_2_and_its_margin_rises(runs):
    got = records(runs["dpo_metrics"])
    assert sorted(got) == [1, 2, 3]  # --exit-interval 3
    # the policy is the reference at the start: every reward and margin is zero, the loss log 2
    assert abs(got[1]["loss"] - math.log(2)) < 1e-6 and got[1]["train_margin"] == 0.0, got[1]
    margins = [got[i]["train_margin"] for i in (1, 2, 3)]
    assert margins[0] < margins[1] < margins[2], margins
    assert got[3]["train_accuracy"] == 1.0 and got[3]["loss"] < got[1]["loss"], got[3]


@pytest.mark.feature("stage-dpo")
@pytest.mark.parametrize("loss_type, smoothing", [("sigmoid", "0.1"), ("hinge", "0"), ("ipo", "0")])
def test_dpo_losses_equal_numpy(runs, tmp_path, loss_type, smoothing):
    """The DPO checkpoint of iteration 3 resumed for one step at lr 0: its loss is the policy's
    (those weights) against the reference kept in the checkpoint (the base model's)."""
    metrics = train("--stage", "dpo", "--data-path", runs["pairs"], "--load", runs["dpo"], "--train-iters", "4",
                    "--lr", "0", "--dpo-loss-type", loss_type, "--dpo-label-smoothing", smoothing, "--dpo-beta", "0.5",
                    "--metrics-file", str(tmp_path / "m.jsonl"))
    got = records(metrics)[4]["loss"]
    ll = policy_and_reference(runs)
    (pc, nc), (pr, nr) = ll["policy", "chosen"], ll["policy", "rejected"]
    (rc, _), (rr, _) = ll["reference", "chosen"], ll["reference", "rejected"]
    beta, e = 0.5, float(smoothing)
    if loss_type == "ipo":  # per-token averages
        z = (pc / nc - pr / nr) - (rc / nc - rr / nr)
        want = np.mean((z - 1 / (2 * beta)) ** 2)
    else:
        z = (pc - pr) - (rc - rr)
        want = np.mean(-(1 - e) * log_sigmoid(beta * z) - e * log_sigmoid(-beta * z) if loss_type == "sigmoid"
                       else np.maximum(0.0, 1 - beta * z))
    assert abs(got - want) <= 1e-5 * max(abs(want), 1.0), (got, want)


@pytest.mark.feature("stage-simpo")
def test_simpo_loss_equals_numpy(runs, tmp_path):
    metrics = train("--stage", "simpo", "--data-path", runs["pairs"], "--load", runs["dpo"], "--finetune",
                    "--train-iters", "1", "--lr", "0", "--simpo-beta", "2", "--simpo-gamma", "0.5",
                    "--simpo-label-smoothing", "0.1", "--metrics-file", str(tmp_path / "m.jsonl"))
    got = records(metrics)[1]
    policy, cfg = weights(runs["dpo"], 3)
    (pc, nc), (pr, nr) = (reply_log_likelihoods(policy, cfg, runs["pairs"], side) for side in ("chosen", "rejected"))
    z = 2 * (pc / nc - pr / nr) - 0.5
    want = np.mean(-0.9 * log_sigmoid(z) - 0.1 * log_sigmoid(-z))
    assert abs(got["loss"] - want) <= 1e-5 * want, (got["loss"], want)
    assert abs(got["train_margin"] - np.mean(2 * (pc / nc - pr / nr))) < 1e-5


@pytest.mark.feature("stage-orm")
def test_reward_model_loss_equals_numpy(runs, tmp_path):
    """A reward model from the base language model (its output layer dropped, a scalar head
    added), trained two steps, resumed for one at lr 0: the Bradley-Terry loss of the head's
    values at each reply's last token."""
    orm = str(tmp_path / "orm")
    train("--stage", "orm", "--data-path", runs["pairs"], "--load", runs["base"], "--finetune", "--train-iters", "2",
          "--lr", "1e-2", "--save", orm)
    metrics = train("--stage", "rm", "--data-path", runs["pairs"], "--load", orm, "--train-iters", "3", "--lr", "0",
                    "--metrics-file", str(tmp_path / "m.jsonl"))
    got = records(metrics)[3]["loss"]
    state, cfg = weights(orm, 2)
    assert cfg.reward_head and state["rm_head.weight"].shape == (1, 32) and "output_layer.weight" not in state
    head = {**state, "output_layer.weight": state["rm_head.weight"]}  # numeric's forward, a one-value head

    def rewards(side):
        return np.array([numeric.gpt_logits(head, cfg, ids)[-1, 0]
                         for ids in sequences(runs["pairs"], side + "_input_ids")])

    chosen, rejected = rewards("chosen"), rewards("rejected")
    want = np.mean(-log_sigmoid(chosen - rejected))
    assert abs(got - want) <= 1e-5 * want, (got, want)
    # a reward model scores replies; generation refuses it in one line
    assert cli.main(["generate", "--load", orm, "--prompt", "hi"]) == 2


@pytest.mark.framework_free
def test_transformers_reads_an_exported_reward_model(runs, tmp_path):
    """The base model's weights with a random scalar head, exported as a reward model:
    transformers' sequence classifier (one label) scores a reply as our numpy forward of the
    same weights does (1e-4). No framework of ours runs."""
    import dataclasses

    from mindspeed_core.compat import hf

    lm, cfg = weights(runs["base"], 1)
    cfg = dataclasses.replace(cfg, reward_head=True)
    state = {k: v for k, v in lm.items() if not k.startswith("output_layer.")}
    state["rm_head.weight"] = numeric.rng(5).normal(0, 0.5, (1, cfg.hidden_size)).astype(np.float32)
    head = {**state, "output_layer.weight": state["rm_head.weight"]}
    ids = sequences(runs["pairs"], "chosen_input_ids")[0]
    want = numeric.gpt_logits(head, cfg, ids)[-1, 0]
    folder = tmp_path / "hf"
    hf.save_folder(str(folder), cfg, state)
    assert json.load(open(folder / "config.json"))["architectures"] == ["LlamaForSequenceClassification"]
    again, rm_state = hf.load_folder(str(folder))
    assert again.reward_head and np.array_equal(rm_state["rm_head.weight"], state["rm_head.weight"])
    np.save(tmp_path / "ids.npy", ids[None])
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_AI_FRAMEWORK"}
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "hf_reference.py"), "--check",
                          str(folder), str(tmp_path / "ids.npy"), str(tmp_path / "score.npy")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert abs(float(np.load(tmp_path / "score.npy")[0, 0]) - want) < 1e-4


@pytest.mark.feature("stage-prm")
def test_process_reward_loss_equals_numpy(runs, tmp_path):
    """The cross entropy over the logits of '+' and '-' where each step ends (the '@'), the
    mean over every step of the batch."""
    metrics = train("--stage", "prm", "--reward-tokens", "+", "-", "--data-path", runs["steps"], "--load",
                    runs["base"], "--finetune", "--train-iters", "1", "--lr", "0",
                    "--metrics-file", str(tmp_path / "m.jsonl"))
    got = records(metrics)[1]
    state, cfg = weights(runs["base"], 1)
    candidates = [ord("+"), ord("-")]
    losses, right = [], []
    for ids, labels in zip(sequences(runs["steps"], "input_ids"), sequences(runs["steps"], "labels")):
        logits = numeric.gpt_logits(state, cfg, ids)[:, candidates]
        for t in np.flatnonzero(labels != IGNORE):
            assert ids[t] == ord("@")
            k = candidates.index(int(labels[t]))
            losses.append(-numeric.log_softmax(logits[t])[k])
            right.append(int(np.argmax(logits[t]) == k))
    assert len(losses) == 8
    assert abs(got["loss"] - np.mean(losses)) <= 1e-5 * np.mean(losses), (got["loss"], np.mean(losses))
    assert abs(got["train_step_accuracy"] - np.mean(right)) < 1e-6


@pytest.mark.parametrize("flags, message", [
    (["--stage", "dpo"], "--stage dpo trains on preprocessed preference data: give --data-path"),
    (["--stage", "dpo", "--data-path", "{steps}"], "a preference --data-path is the --output-prefix"),
    (["--stage", "dpo", "--data-path", "{pairs}", "--dpo-loss-type", "hinge", "--dpo-label-smoothing", "0.1"],
     "--dpo-label-smoothing applies to the sigmoid loss"),
    (["--stage", "dpo", "--data-path", "{pairs}", "--dpo-label-smoothing", "0.5"], "--dpo-label-smoothing"),
    (["--stage", "prm", "--data-path", "{steps}"], "--stage prm needs --reward-tokens"),
    (["--stage", "prm", "--data-path", "{steps}", "--reward-tokens", "+", "x"],
     "labels a step with token 45, which is not one of --reward-tokens + x"),
    (["--stage", "simpo", "--data-path", "{pairs}", "--compile"], "--compile with a preference or reward stage is not built yet"),
])
def test_bad_alignment_options_are_one_line_errors(capsys, runs, flags, message):
    flags = [f.format(**{k: str(v) for k, v in runs.items()}) for f in flags]
    code = cli.main(["train", *MODEL, "--train-iters", "1", *flags])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
