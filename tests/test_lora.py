"""LoRA (models/lora.py, --lora-* flags) on instruction data, on the bound framework: only
the adapters train, the LoRA forward equals a float64 numpy reference, merging changes no
logit, --lora-load resumes exactly, and bad combinations are one-line errors. Tensor
parallelism's LoRA parity rides in test_parallel's two- and four-rank launches."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

from mindspeed_core import cli, ops
from mindspeed_core.models import lora, registry
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.gpt import load_whole_state
from mindspeed_core.training import checkpoint
from test_finetune import DIALOGUES, MODEL, reference_loss

LORA = ["--lora-r", "4", "--lora-alpha", "8"]
BATCH = ["--micro-batch-size", str(len(DIALOGUES)), "--global-batch-size", str(len(DIALOGUES))]


def train(*flags) -> str:
    """`mindspeed train` on the SFT model; returns what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["train", *MODEL, *BATCH, "--stage", "sft", "--lr", "2e-2", *flags])
    assert code == 0, err.getvalue()
    return out.getvalue()


def preprocess_quietly(tmp, records) -> str:
    with open(tmp / "data.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["preprocess", "--input", str(tmp / "data.jsonl"), "--output-prefix", str(tmp / "data"),
                         "--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "chatml",
                         "--seq-length", "160"]) == 0
    return str(tmp / "data")


def losses(path) -> dict:
    return {r["iteration"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Alpaca conversations; a base checkpoint (full SFT, 2 steps); a LoRA run on it stopped
    after 3 steps; the same LoRA run straight through 4 steps."""
    tmp = tmp_path_factory.mktemp("lora")
    records = [{"instruction": q, "output": a} for q, a in DIALOGUES]
    data = preprocess_quietly(tmp, records)
    base, stopped, straight = tmp / "base", tmp / "lora", tmp / "lora-straight"
    train("--data-path", data, "--train-iters", "2", "--save", str(base))
    said = train("--data-path", data, *LORA, "--load", str(base), "--train-iters", "4", "--exit-interval", "3",
                 "--save", str(stopped), "--metrics-file", str(tmp / "stopped.jsonl"))
    train("--data-path", data, *LORA, "--load", str(base), "--train-iters", "4", "--save", str(straight),
          "--metrics-file", str(tmp / "straight.jsonl"))
    return dict(tmp=tmp, data=data, base=str(base), stopped=str(stopped), straight=str(straight), said=said)


@pytest.mark.feature("lora")
@pytest.mark.feature("sft")
def test_only_the_adapters_train_and_the_optimizer_holds_nothing_else(runs):
    assert "fine-tuning from the weights of" in runs["said"] and "LoRA on a base model" in runs["said"]
    base = checkpoint.load_model_arrays(runs["base"], 2)
    arrays, optimizer, _ = checkpoint.load(runs["stopped"], 3)
    adapters = sorted(n for n in arrays if lora.is_adapter(n))
    targets = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    assert adapters == sorted(f"decoder.layers.{i}.{t}.lora_{f}.weight" for i in range(2) for t in targets
                              for f in "AB")
    assert sorted(set(arrays) - set(adapters)) == sorted(base)
    for name, value in base.items():  # frozen: bit for bit
        assert np.array_equal(arrays[name], value), name
    assert all(np.abs(arrays[n]).max() > 0 for n in adapters if ".lora_B." in n)  # B started at zero and moved
    assert optimizer and all(lora.is_adapter(k.split(".", 1)[1]) for k in optimizer), sorted(optimizer)[:4]


@pytest.mark.feature("lora")
@pytest.mark.feature("sft")
def test_the_lora_forward_equals_numpy_and_merging_changes_no_logit(runs):
    arrays = checkpoint.load_model_arrays(runs["stopped"], 3)
    cfg = ModelConfig.from_dict(checkpoint.read_meta(runs["stopped"], 3)["model"])
    assert cfg.lora.r == 4 and cfg.lora.scale == 2.0
    # the reference folds W + (alpha / r) B A itself, in float64
    folded = {k: np.asarray(v, np.float64) for k, v in arrays.items() if not lora.is_adapter(k)}
    for name in arrays:
        if ".lora_A." in name:
            b = np.asarray(arrays[name.replace(".lora_A.", ".lora_B.")], np.float64)
            folded[name.replace(".lora_A.weight", ".weight")] += 2.0 * b @ np.asarray(arrays[name], np.float64)
    want = reference_loss(folded, cfg)
    metrics = runs["tmp"] / "lr0.jsonl"
    said = train("--data-path", runs["data"], *LORA, "--load", runs["stopped"], "--finetune", "--lr", "0",
                 "--train-iters", "1", "--metrics-file", str(metrics))
    assert "(--finetune)" in said
    got = losses(metrics)[1]
    assert abs(got - want) <= 1e-5 * want, (got, want)
    # merged into the base weights: a model without adapters gives the same logits
    merged_cfg, merged = lora.merge(cfg, arrays)
    assert merged_cfg.lora is None and sorted(merged) == sorted(folded)
    ids = ops.tensor(np.arange(40, 90, dtype=np.int64)[None])
    logits = []
    for c, state in ((cfg, arrays), (merged_cfg, merged)):
        model = registry.for_config(c).build(c)
        load_whole_state(model, state)
        logits.append(ops.to_numpy(model(ids)).astype(np.float64))
    scale = np.abs(logits[0]).max()
    assert np.abs(logits[0] - logits[1]).max() <= 1e-5 * scale


@pytest.mark.feature("lora")
@pytest.mark.feature("sft")
def test_lora_load_resumes_the_adapters_exactly(runs):
    metrics = runs["tmp"] / "resumed.jsonl"
    said = train("--data-path", runs["data"], *LORA, "--load", runs["base"], "--lora-load", runs["stopped"],
                 "--train-iters", "4", "--metrics-file", str(metrics))
    assert "resumed the LoRA adapters from" in said
    resumed, straight, stopped = (losses(metrics), losses(runs["tmp"] / "straight.jsonl"),
                                  losses(runs["tmp"] / "stopped.jsonl"))
    assert list(resumed) == [4] and list(stopped) == [1, 2, 3]
    assert [stopped[i] for i in (1, 2, 3)] == [straight[i] for i in (1, 2, 3)]
    assert resumed[4] == straight[4], (resumed, straight)


@pytest.mark.parametrize("flags, message", [
    ([*LORA, "--lora-load", "{stopped}"], "give the base model with --load or --load-hf"),
    (["--load", "{base}", "--lora-load", "{stopped}"], "give the same --lora-r / --lora-target-modules"),
    (["--load", "{base}", "--lora-load", "{stopped}", "--lora-r", "8"], "pass the same --lora-* flags"),
    (["--load", "{stopped}"], "holds LoRA adapters (rank 4, alpha 8.0"),
    (["--load", "{base}", "--lora-load", "{base}", *LORA], "holds no LoRA adapters"),
    (["--lora-target-modules", "linear_q"], "invalid choice"),
    ([*LORA, "--num-experts", "4"], "LoRA on mixture-of-experts models is not built yet"),
])
def test_bad_lora_options_are_one_line_errors(capsys, runs, flags, message):
    flags = [f.format(**runs) for f in flags]
    code = cli.main(["train", *MODEL, *BATCH, "--stage", "sft", "--data-path", runs["data"], "--train-iters", "1",
                     *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err
