"""Single-device training end to end: learning, resume, and every kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mindspeed_core import cli, io
from mindspeed_core.compat import hf
from mindspeed_core.data import preprocess
from mindspeed_core.data.corpus import stdlib_files
from mindspeed_core.models.config import ModelConfig

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "128", "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--eval-iters", "0", "--log-interval", "1",
         "--make-vocab-size-divisible-by", "8", "--no-progress", "--seed", "7"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    with open(root / "docs.jsonl", "w") as fh:
        for path in stdlib_files(300_000):
            fh.write(json.dumps({"text": open(path, encoding="utf-8", errors="replace").read()}) + "\n")
    import argparse

    parser = argparse.ArgumentParser()
    preprocess.add_args(parser)
    preprocess.run(parser.parse_args(["--input", str(root / "docs.jsonl"), "--output-prefix", str(root / "std"),
                                      "--append-eod"]))
    return str(root / "std_text_document")


def train(capsys, *argv):
    """Run `mindspeed train` in this process; returns (exit code, stdout, stderr)."""
    code = cli.main(["train", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def losses(path):
    return {r["iteration"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r}


def test_the_default_save_folder_is_named_after_the_model_and_guarded(monkeypatch, tmp_path):
    """Without data flags or --save, a run keeps its model in ./checkpoints/<its --model-name
    preset, or its --load-hf folder's name>, guarded as a --save given: another run's
    checkpoints there are refused, not replaced, unless --overwrite-checkpoints."""
    from mindspeed_core.compat import megatron_args
    from mindspeed_core.errors import MindSpeedError
    from mindspeed_core.training import checkpoint, configuration

    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen-mini").mkdir()
    (tmp_path / "Qwen-mini" / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 256}))

    def save(*argv):
        return configuration.configure(megatron_args.training_parser().parse_args(list(argv)), 1).flags.save

    assert save() == os.path.join("checkpoints", "tiny-llama")
    assert save("--model-name", "tiny-qwen3") == os.path.join("checkpoints", "tiny-qwen3")
    assert save("--load-hf", "Qwen-mini/") == os.path.join("checkpoints", "Qwen-mini")
    assert save("--load-hf", "Qwen-mini", "--stage", "sft") == os.path.join("checkpoints", "Qwen-mini-sft")
    held = tmp_path / "checkpoints" / "Qwen-mini"
    (held / "iter_0000003").mkdir(parents=True)
    (held / checkpoint.TRACKER).write_text("3")
    with pytest.raises(MindSpeedError, match=r"the default save folder checkpoints/Qwen-mini already holds another "
                                             r"run's checkpoints \(up to iteration 3\): add --overwrite-checkpoints"):
        save("--load-hf", "Qwen-mini")
    assert save("--load-hf", "Qwen-mini", "--overwrite-checkpoints") == os.path.join("checkpoints", "Qwen-mini")


def test_loss_falls_and_metrics_are_written(capsys, corpus, tmp_path):
    metrics = tmp_path / "m.jsonl"
    code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "30", "--metrics-file", str(metrics),
                           "--eval-iters", "2", "--eval-interval", "15", "--split", "90,10,0", "--sample-tokens", "16")
    assert code == 0, err
    got = losses(metrics)
    assert sorted(got) == list(range(1, 31))
    assert got[30] < got[1] - 1.0, got  # from about ln(264) = 5.6 to clearly lower
    records = [json.loads(line) for line in open(metrics)]
    assert any("eval_loss" in r for r in records)
    last = [r for r in records if "loss" in r][-1]
    assert last["tokens_per_s"] > 0 and 0 < last["mfu"] <= 1 and last["grad_norm"] > 0
    assert "lm loss" in out and "MFU" in out and "sample:" in out


def test_mfu_never_passes_100_percent_when_the_probe_read_low(monkeypatch):
    """A probe on a busy machine reads low: the report probes again, and where the steps still
    beat it, their own rate becomes the peak; either change is said once, with the figures."""
    from mindspeed_core.training import metrics as metrics_mod

    def run(probes, rates):  # reports at these tokens a second (one step each, 1 s apart)
        now = [0.0]
        monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: now[0])
        said = []
        # at 1e7 FLOP a token over 2 devices, 1,000 tokens/s is 5e9 FLOP/s a device
        log = metrics_mod.MetricsLog(None, said.append, flops_per_token=1e7, peak_flops=2e9, devices=2,
                                     reprobe=iter(probes).__next__)
        records = []
        for k, rate in enumerate(rates, 1):
            log.step(rate, k, 5.0, 1e-3, 1.0, 1.0, 4, {})
            now[0] += 1.0
            records.append(log.report(k, len(rates), 5.0, 1e-3, 1.0))
        return [(r["mfu"], r["peak_flops"]) for r in records], [line for line in said if line.startswith("MFU peak")]

    # the probe again still reads below the steps: their rate is the peak from then on
    got, notes = run([3e9], [1000, 500, 1000])
    assert got == [(1.0, 5e9), (0.5, 5e9), (1.0, 5e9)]
    assert len(notes) == 1 and "2.0 -> 5.0 GFLOP/s" in notes[0] and "steps' own rate" in notes[0], notes
    # the probe again reads higher than the steps: it is the peak
    got, notes = run([8e9], [1000, 1000])
    assert got == [(5e9 / 8e9, 8e9), (5e9 / 8e9, 8e9)]
    assert len(notes) == 1 and "2.0 -> 8.0 GFLOP/s" in notes[0] and "probe, run again" in notes[0], notes
    # steps below the probe: nothing changes, nothing is probed (an empty probe list would raise)
    assert run([], [300, 400]) == ([(0.75, 2e9), (1.0, 2e9)], [])


def test_resume_reproduces_the_uninterrupted_run(capsys, corpus, tmp_path):
    full = tmp_path / "full.jsonl"
    code, _, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "8", "--metrics-file", str(full))
    assert code == 0, err
    ckpt = tmp_path / "ckpt"
    code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "8", "--save", str(ckpt),
                           "--save-interval", "4", "--exit-interval", "4", "--metrics-file", str(tmp_path / "a.jsonl"))
    assert code == 0, err
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "8", "--load", str(ckpt),
                           "--save", str(ckpt), "--metrics-file", str(tmp_path / "b.jsonl"))
    assert code == 0, err
    assert "resumed from" in out
    uninterrupted, first, second = losses(full), losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert {**first, **second} == uninterrupted  # bit for bit
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "8"



@pytest.mark.feature("dataloader-cyclic")
def test_cyclic_data_order_trains_and_resumes_bit_for_bit(capsys, corpus, tmp_path, monkeypatch):
    """--dataloader-type cyclic: the trainer reads the cyclic sampler's samples (not the
    global batches in order), and a run resumed at step 2 continues the uninterrupted curve."""
    from mindspeed_core.data import sampler
    from mindspeed_core.training import batches

    read, micro_batch = [], batches.Batches.micro_batch

    def recording(self, split, rows):
        read.append(list(rows))
        return micro_batch(self, split, rows)

    monkeypatch.setattr(batches.Batches, "micro_batch", recording)
    flags = [*SMALL, "--data-path", corpus, "--train-iters", "4", "--dataloader-type", "cyclic"]
    code, _, err = train(capsys, *flags, "--metrics-file", str(tmp_path / "full.jsonl"))
    assert code == 0, err
    order = sampler.for_run("cyclic", 8, 4, 1, 0, 4)
    assert read == [rows for it in range(4) for rows in order.micro_batches(it)]
    assert read[0] != list(range(4)) and sorted(i for rows in read for i in rows) == list(range(32))
    ckpt = tmp_path / "ckpt"
    code, _, err = train(capsys, *flags, "--save", str(ckpt), "--save-interval", "2", "--exit-interval", "2",
                         "--metrics-file", str(tmp_path / "a.jsonl"))
    assert code == 0, err
    code, out, err = train(capsys, *flags, "--load", str(ckpt), "--metrics-file", str(tmp_path / "b.jsonl"))
    assert code == 0 and "resumed from" in out, err
    assert {**losses(tmp_path / "a.jsonl"), **losses(tmp_path / "b.jsonl")} == losses(tmp_path / "full.jsonl")

# The checkpoint flags, each shown by what a resume does: with dropout the random generators'
# state changes the losses, with Adam the optimizer's moments do (a step after the resume).
DROPOUT = [*SMALL, "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "4"]
RESUMES = {"resumed": ("saved", []), "no-load-optim": ("saved", ["--no-load-optim"]),
           "no-load-rng": ("saved", ["--no-load-rng"]),
           "no-load-either": ("saved", ["--no-load-optim", "--no-load-rng"]),
           "from-bare": ("bare", []), "from-bare-whole": ("bare-whole", []),
           "finetune": ("saved", ["--finetune", "--train-iters", "2"])}


@pytest.fixture(scope="module")
def flag_runs(corpus, tmp_path_factory):
    """(checkpoint root, {run: (exit code, stderr, losses by iteration, stdout)}): a dropout run
    of 4 iterations, the same run stopped at 2 with its checkpoint saved in full ("saved"),
    without its optimizer and RNG states ("bare", sharded; "bare-whole", --save-whole), and
    resumed as RESUMES says."""
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    root = tmp_path_factory.mktemp("checkpoint-flags")
    runs = {}

    def run(name, *argv):
        out, err, metrics = StringIO(), StringIO(), root / f"{name}.jsonl"
        with redirect_stdout(out), redirect_stderr(err):
            code = cli.main(["train", *DROPOUT, "--data-path", corpus, "--metrics-file", str(metrics), *argv])
        # a run that fails fails the tests that look at it (a flag's reader removed), not all of them
        runs[name] = (code, err.getvalue(), losses(metrics) if metrics.exists() else {}, out.getvalue())

    run("uninterrupted")
    for name, extra in (("saved", []), ("bare", ["--no-save-optim", "--no-save-rng"]),
                        ("bare-whole", ["--save-whole", "--no-save-optim", "--no-save-rng"])):
        run(f"save-{name}", "--save", str(root / name), "--save-interval", "2", "--exit-interval", "2", *extra)
    for name, (ckpt, extra) in RESUMES.items():
        run(name, "--load", str(root / ckpt), *extra)
    return root, runs


def ran(flag_runs, name):
    """(losses by iteration, stdout) of a run that succeeded."""
    code, err, losses_, out = flag_runs[1][name]
    assert code == 0, (name, err)
    return losses_, out


def test_a_resume_with_dropout_continues_the_random_draws(flag_runs):
    """The control for the flags below: a full resume is the uninterrupted run, bit for bit."""
    resumed, out = ran(flag_runs, "resumed")
    assert "resumed from" in out and resumed == {i: ran(flag_runs, "uninterrupted")[0][i] for i in (3, 4)}


def test_no_load_optim_resumes_with_a_fresh_optimizer(flag_runs):
    """--no-load-optim: the weights and RNG states are loaded, so iteration 3's loss is the full
    resume's; the optimizer starts afresh (no moments, step 1), so iteration 4's weights are not."""
    plain, fresh = ran(flag_runs, "resumed")[0], ran(flag_runs, "no-load-optim")[0]
    assert sorted(fresh) == [3, 4] and fresh[3] == plain[3]
    assert fresh[4] != plain[4], (fresh, plain)


def test_no_load_rng_resumes_with_fresh_dropout_draws(flag_runs):
    """--no-load-rng: the first step after the resume draws other dropout masks than the
    uninterrupted run (same weights, same batch)."""
    (losses_, out), plain = ran(flag_runs, "no-load-rng"), ran(flag_runs, "resumed")[0]
    assert sorted(losses_) == [3, 4] and losses_[3] != plain[3], (losses_, plain)
    assert "--no-load-rng: dropout draws start afresh" in out


@pytest.mark.parametrize("saved", ["bare", "bare-whole"], ids=["sharded", "save-whole"])
def test_no_save_optim_and_no_save_rng_leave_them_out_of_the_checkpoint(flag_runs, saved):
    """--no-save-optim / --no-save-rng: the checkpoint holds no optimizer state and no generator
    states (the full save, the control, holds both); resuming from it is resuming the full
    checkpoint with --no-load-optim --no-load-rng, bit for bit, and says why."""
    from mindspeed_core.training import checkpoint

    root = flag_runs[0]
    for name, held in (("saved", True), (saved, False)):
        assert bool(checkpoint.load(str(root / name), 2)[1]) == held, name
        assert ("default" in checkpoint.load_trainer_state(str(root / name), 2)["rng"][0]) == held, name
    losses_, out = ran(flag_runs, f"from-{saved}")
    assert losses_ == ran(flag_runs, "no-load-either")[0]
    assert "holds no optimizer state (saved with --no-save-optim)" in out
    assert "saved without RNG states (--no-save-rng)" in out


def test_finetune_takes_the_weights_and_starts_at_iteration_one(flag_runs):
    """--finetune: the checkpoint's weights (iteration 1's loss is not a fresh model's on the same
    batch and dropout masks), iteration 0, the data from its start."""
    losses_, out = ran(flag_runs, "finetune")
    assert sorted(losses_) == [1, 2] and losses_[1] != ran(flag_runs, "uninterrupted")[0][1], losses_
    assert "fine-tuning from the weights" in out and "(--finetune)" in out


def test_exit_on_missing_checkpoint_refuses_an_empty_load_folder(capsys, corpus, tmp_path):
    """--exit-on-missing-checkpoint: --load of a folder without a checkpoint is one line and exit
    code 2, nothing trained or saved (as with --finetune); without the flag the run starts from
    scratch."""
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = [*SMALL, "--data-path", corpus, "--train-iters", "1", "--load", str(empty), "--save", str(empty)]
    code, out, err = train(capsys, *argv, "--exit-on-missing-checkpoint")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--load {empty} holds no checkpoint (--exit-on-missing-checkpoint)" in err
    assert not os.listdir(empty) and "iteration" not in out
    code, _, err = train(capsys, *argv, "--finetune")  # no weights to take: never a start from scratch
    assert code == 2 and f"--load: {empty} holds no checkpoint to take the weights from" in err, err
    code, out, err = train(capsys, *argv)
    assert code == 0 and "starting from scratch" in out, err
    assert (empty / "latest_checkpointed_iteration.txt").read_text() == "1"


def test_manual_gc_collects_at_its_interval_only(capsys, corpus, monkeypatch, tmp_path):
    """--manual-gc: Python's collector is off while training and the trainer collects at each
    --manual-gc-interval-th step (and before an evaluation), then the collector is on again;
    without the flag the trainer never collects itself."""
    import gc
    import sys

    from mindspeed_core.training import trainer

    calls, real = [], gc.collect

    def collect(*args, **kwargs):
        if sys._getframe(1).f_code.co_filename == trainer.__file__:  # the trainer's own, not a library's
            calls.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer.gc, "collect", collect)
    argv = [*SMALL, "--data-path", corpus, "--train-iters", "6", "--eval-iters", "0", "--sample-tokens", "0"]
    assert train(capsys, *argv, "--manual-gc", "--manual-gc-interval", "2")[0] == 0
    assert calls == [False, False, False] and gc.isenabled()  # steps 2, 4 and 6, the collector off
    calls.clear()
    assert train(capsys, *argv, "--manual-gc", "--manual-gc-interval", "0")[0] == 0
    assert calls == [] and gc.isenabled()  # off all run, never collected
    assert train(capsys, *argv)[0] == 0
    assert calls == []


def test_nan_loss_stops_cleanly_and_keeps_the_last_checkpoint(capsys, corpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "6", "--lr", "1e30",
                           "--lr-warmup-iters", "0", "--clip-grad", "0", "--save", str(ckpt), "--save-interval", "1")
    assert code == 2
    assert ("the loss became" in err or "no longer finite" in err or "gradient norm became" in err), err
    assert err.count("\n") == 1
    last = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    from mindspeed_core.training import checkpoint

    arrays = checkpoint.load_model_arrays(str(ckpt), last)
    assert arrays and all(np.isfinite(a).all() for a in arrays.values())


def test_bad_checkpoints_are_one_line_errors(capsys, corpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "2", "--save", str(ckpt))[0] == 0
    model_file = ckpt / "iter_0000002" / "rank_00000.safetensors"
    good = model_file.read_bytes()
    model_file.write_bytes(good[: len(good) // 2])
    code, _, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "4", "--load", str(ckpt))
    assert code == 2 and "truncated" in err and "Traceback" not in err
    model_file.write_bytes(good)
    wider = [a if a != "64" else "96" for a in SMALL]
    code, _, err = train(capsys, *wider, "--data-path", corpus, "--train-iters", "4", "--load", str(ckpt))
    assert code == 2 and "different model configuration" in err
    (ckpt / "latest_checkpointed_iteration.txt").write_text("banana")
    code, _, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "4", "--load", str(ckpt))
    assert code == 2 and "iteration number" in err
    code, _, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "4", "--load", str(tmp_path / "none"))
    assert code == 2 and "does not exist" in err


def test_interrupted_save_keeps_the_previous_checkpoint(capsys, corpus, tmp_path, monkeypatch):
    from mindspeed_core.training import checkpoint

    ckpt = tmp_path / "ckpt"
    assert train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "2", "--save", str(ckpt))[0] == 0
    real_save = checkpoint.tensor_files.save
    calls = []

    def dying_save(path, *a, **k):
        calls.append(path)
        if path.endswith(".safetensors"):
            raise KeyboardInterrupt  # killed half-way through writing the next checkpoint
        return real_save(path, *a, **k)

    monkeypatch.setattr(checkpoint.tensor_files, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "4", "--load", str(ckpt), "--save", str(ckpt))
    monkeypatch.undo()
    assert calls and (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (ckpt / "iter_0000004").exists()
    code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "3", "--load", str(ckpt))
    assert code == 0 and "resumed from" in out, err


@pytest.mark.parametrize("when", ["sync", "async"])
def test_a_failed_write_is_one_line_and_keeps_the_previous_checkpoint(capsys, corpus, tmp_path, monkeypatch, when):
    """A rank's file that cannot be written (a full disk), in the training thread or the
    --async-save writer: the run stops with one line naming the iteration and the rank, and the
    tracker still names the last complete checkpoint."""
    from mindspeed_core.training import checkpoint

    ckpt = tmp_path / "ckpt"
    assert train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "2", "--save", str(ckpt))[0] == 0

    def full_disk(path, *a, **k):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(checkpoint.tensor_files, "save", full_disk)
    code, _, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "4", "--load", str(ckpt), "--save",
                         str(ckpt), *(["--async-save"] if when == "async" else []))
    assert code == 2 and err.count("\n") == 1 and "saving iteration 4 failed on rank 0" in err, err
    assert "No space left on device" in err and "the last checkpoint" in err, err
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_bad_data_and_vocab_are_one_line_errors(capsys, corpus, tmp_path):
    code, _, err = train(capsys, *SMALL, "--data-path", str(tmp_path / "missing"), "--train-iters", "2")
    assert code == 2 and "does not exist" in err and err.count("\n") == 1
    small_vocab = ModelConfig(vocab_size=96, hidden_size=32, num_layers=1, num_attention_heads=2, ffn_hidden_size=64,
                              max_position_embeddings=64)
    folder = tmp_path / "hf"
    state = {}
    from mindspeed_core import nn
    from mindspeed_core.models.gpt import GPTModel

    state = nn.state_dict(GPTModel(small_vocab))
    hf.save_folder(str(folder), small_vocab, state)
    code, _, err = train(capsys, "--data-path", corpus, "--load-hf", str(folder), "--seq-length", "32",
                         "--micro-batch-size", "2", "--train-iters", "1", "--no-progress")
    assert code == 2 and "tokenizer has 257 tokens but the model's vocabulary has 96" in err
    code, _, err = train(capsys, *SMALL, "--data-path", corpus, "--global-batch-size", "6", "--train-iters", "1")
    assert code == 2 and "not a multiple" in err


def test_dry_run_and_hf_initialisation(capsys, corpus, tmp_path):
    code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--dry-run")
    assert code == 0, err
    info = json.loads(out)
    assert info["parameters"] > 0 and info["flops_per_token"] > 0 and info["gradient_accumulation"] == 2
    # a model loaded from a Hugging Face folder trains from those weights
    cfg = ModelConfig(vocab_size=264, hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=128,
                      max_position_embeddings=64)
    from mindspeed_core import nn
    from mindspeed_core.models.gpt import GPTModel

    hf.save_folder(str(tmp_path / "init"), cfg, nn.state_dict(GPTModel(cfg)))
    metrics = tmp_path / "m.jsonl"
    code, out, err = train(capsys, "--data-path", corpus, "--load-hf", str(tmp_path / "init"), "--seq-length", "32",
                           "--micro-batch-size", "2", "--train-iters", "2", "--no-progress", "--eval-iters", "0",
                           "--lr", "1e-3", "--log-interval", "1", "--metrics-file", str(metrics))
    assert code == 0, err
    assert len(losses(metrics)) == 2


@pytest.mark.mindspore_process
def test_gate_stops_before_anything_heavy():
    env = {**os.environ, "MINDSPEED_AI_FRAMEWORK": "pytorch"}
    out = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", "train", "--ai-framework", "mindspore",
                          "--swap-attention"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2
    assert "swap-attention" in out.stderr and "unsupported for mindspore" in out.stderr
    assert "training" not in out.stdout  # nothing was built


BF16_TOLERANCE = 2e-3  # worst relative loss difference to fp32 over 20 steps


@pytest.mark.feature("bf16")
def test_bf16_training_where_the_matrix_allows_it(capsys, corpus, tmp_path, framework):
    from mindspeed_core import device, features

    status = features.get("bf16").status(framework, device.type()).kind
    ckpt = tmp_path / "ckpt"
    code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "20", "--bf16", "--save", str(ckpt),
                           "--metrics-file", str(tmp_path / "m.jsonl"))
    if status != "supported":
        assert code == 2 and "bf16" in err and "unsupported" in err
        return
    assert code == 0, err
    got = losses(tmp_path / "m.jsonl")
    assert got[20] < got[1] - 0.5
    # against fp32 from the same seed: bf16 keeps 8 bits of mantissa, so the losses drift
    # apart a little over these 20 steps (measured: worst 4.2e-4 relative)
    code, _, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "20",
                         "--metrics-file", str(tmp_path / "fp32.jsonl"))
    assert code == 0, err
    fp32 = losses(tmp_path / "fp32.jsonl")
    worst = max(abs(got[i] - fp32[i]) / fp32[i] for i in fp32)
    assert 0 < worst < BF16_TOLERANCE, worst
    tensors, _ = io.load(str(ckpt / "iter_0000020" / "rank_00000.safetensors"))  # one rank: every piece
    from mindspeed_core import ops

    dtypes = {k.split("/")[0]: set() for k in tensors}
    for k, t in tensors.items():
        dtypes[k.split("/")[0]].add(ops.dtype_of(t))
    assert dtypes == {"model": {"bfloat16"}, "optimizer": {"float32"}}
    assert any(k.startswith("optimizer/master.") for k in tensors)
    code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "22", "--bf16", "--load", str(ckpt))
    assert code == 0 and "resumed from" in out, err


@pytest.mark.feature("init-norm-weight-fp32")
@pytest.mark.parametrize("distributed", [False, True], ids=["adamw", "distributed-optimizer"])
def test_init_norm_weight_in_fp32_keeps_every_norm_float32_under_bf16(capsys, corpus, tmp_path, framework, distributed):
    """--bf16 --init-norm-weight-in-fp32 (MindSpeed-LLM's DeepSeek-V3.2 and GLM-5 scripts): every
    norm's weight and bias (the layers', the latent attention's, the sparse-attention indexer's
    key LayerNorm, the final one) is saved as a float32 parameter without a master copy and keeps
    updates smaller than bfloat16's step at 1; every other weight is bfloat16 with its master."""
    from mindspeed_core import device, features, ops

    latent = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "16",
              "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--enable-dsa-indexer",
              "--index-topk", "8", "--index-n-heads", "4", "--index-head-dim", "16", "--num-query-groups", "4"]
    ckpt = tmp_path / "ckpt"
    code, _, err = train(capsys, *SMALL, *latent, "--data-path", corpus, "--train-iters", "6", "--bf16",
                         "--init-norm-weight-in-fp32", "--save", str(ckpt), "--metrics-file", str(tmp_path / "m.jsonl"),
                         *(["--use-distributed-optimizer"] if distributed else []))
    if features.get("init-norm-weight-fp32").status(framework, device.type()).kind != "supported":
        assert code == 2 and "unsupported" in err
        return
    assert code == 0, err
    got = losses(tmp_path / "m.jsonl")
    assert got[6] < got[1]
    tensors = {}
    for path in sorted((ckpt / "iter_0000006").glob("rank_*.safetensors")):
        tensors.update(io.load(str(path))[0])
    model = {k.split("/")[1]: t for k, t in tensors.items() if k.startswith("model/")}  # model/<name>/<piece>
    norms = [k for k in model if "norm" in k.rsplit(".", 2)[-2]]
    assert any(".dsa_indexer.k_norm.bias" in k for k in norms) and any("q_layernorm" in k for k in norms)
    assert "decoder.final_layernorm.weight" in norms
    for name, t in model.items():
        assert ops.dtype_of(t) == ("float32" if name in norms else "bfloat16"), name
    masters = {k.split("/")[1][len("master."):] for k in tensors if k.startswith("optimizer/master.")}
    assert masters and not masters & set(norms)
    values = np.concatenate([ops.to_numpy(model[k]).ravel() for k in norms if k.endswith("weight")])
    as_bf16 = ops.to_numpy(ops.cast(ops.tensor(values), "bfloat16")).astype(np.float32)
    assert (values != as_bf16).any()  # steps of 3e-3 from 1: below bfloat16's 2^-7 there


@pytest.mark.feature("hy-v3-group-routing")
def test_a_hy_v3_folder_trains_routed_within_the_scripts_groups(capsys, corpus, tmp_path):
    """MindSpeed-LLM's hunyuan3 script on a HY-V3 folder (whose experts route over all of them):
    --moe-router-num-groups 4 --moe-router-group-topk 1 make the run choose each token's two experts
    inside one group of two, said in a note; the folder's own model chooses across groups."""
    from mindspeed_core import nn, ops, random
    from mindspeed_core.models import families, registry, router
    from mindspeed_core.models.config import ModelConfig
    from mindspeed_core.training import checkpoint

    cfg = families.preset("tiny-hy-v3", vocab_size=320, num_layers=2, moe_layers=(1,))
    random.seed(0)
    hf.save_folder(str(tmp_path / "hf"), cfg, nn.state_dict(registry.for_config(cfg).build(cfg)))
    code, _, err = train(capsys, "--load-hf", str(tmp_path / "hf"), "--data-path", corpus, "--seq-length", "32",
                         "--micro-batch-size", "2", "--train-iters", "2", "--eval-iters", "0", "--no-progress",
                         "--sample-tokens", "0", "--moe-router-num-groups", "4", "--moe-router-group-topk", "1",
                         "--save", str(tmp_path / "ckpt"))
    assert code == 0, err
    assert err.count("routes each token within its best 1 of 4 expert groups") == 1, err
    trained = ModelConfig.from_dict(checkpoint.read_meta(str(tmp_path / "ckpt"), 2)["model"]).moe
    logits = np.random.default_rng(3).normal(0.0, 2.0, (256, 8)).astype(np.float32)
    for moe, grouped in ((trained, True), (cfg.moe, False)):
        experts = router.select(router.scores_of(ops.tensor(logits), moe), moe)
        same_group = (experts[:, 0] // 2 == experts[:, 1] // 2).all()
        assert same_group == grouped, (moe.num_groups, experts[:8])


@pytest.mark.feature("multi-latent-attention")
def test_the_minicpm3_preset_trains_and_exports(capsys, corpus, tmp_path):
    """MiniCPM3's layer (latent attention, MiniCPM's scalings, tied embeddings) trains from its
    preset, and its checkpoint is a minicpm3 Hugging Face folder."""
    metrics = tmp_path / "m.jsonl"
    code, out, err = train(capsys, "--model-name", "tiny-minicpm3", "--data-path", corpus, "--train-iters", "3",
                           "--seq-length", "32", "--micro-batch-size", "2", "--eval-iters", "0", "--no-progress",
                           "--sample-tokens", "0", "--lr", "3e-3", "--log-interval", "1", "--metrics-file", str(metrics),
                           "--save", str(tmp_path / "ckpt"))
    assert code == 0, err
    got = losses(metrics)
    assert sorted(got) == [1, 2, 3] and got[3] < got[1]
    assert cli.main(["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                     str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf")]) == 0
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["model_type"] == "minicpm3" and written["dim_model_base"] == 32 and written["scale_emb"] == 12.0


@pytest.mark.feature("bf16")
@pytest.mark.parametrize("distributed", [False, True], ids=["adamw", "distributed-optimizer"])
def test_a_float32_checkpoint_resumes_under_bf16_with_its_weights_as_masters(capsys, corpus, tmp_path, framework,
                                                                              distributed):
    """A float32 save holds no master weights (its weights are the masters): --bf16 resuming it
    takes them from the saved weights, not from the bf16-rounded parameters. At lr 0 the bf16
    run's own save then holds the float32 weights as masters, bit for bit."""
    from mindspeed_core import device, features
    from mindspeed_core.training import checkpoint

    flags = [*SMALL, "--data-path", corpus, *(["--use-distributed-optimizer"] if distributed else [])]
    code, _, err = train(capsys, *flags, "--train-iters", "2", "--save", str(tmp_path / "fp32"))
    assert code == 0, err
    code, out, err = train(capsys, *flags, "--train-iters", "3", "--bf16", "--lr", "0", "--min-lr", "0",
                           "--load", str(tmp_path / "fp32"), "--save", str(tmp_path / "bf16"))
    if features.get("bf16").status(framework, device.type()).kind != "supported":
        assert code == 2 and "bf16" in err and "unsupported" in err
        return
    assert code == 0 and "resumed" in out, err
    weights, _, _ = checkpoint.load(str(tmp_path / "fp32"), 2)
    _, optimizer, _ = checkpoint.load(str(tmp_path / "bf16"), 3)
    masters = {k[len("master."):]: v for k, v in optimizer.items() if k.startswith("master.")}
    assert sorted(masters) == sorted(weights)
    rounded = 0
    for name, value in weights.items():
        np.testing.assert_array_equal(masters[name], value, err_msg=name)
        rounded += int(np.any(value.astype(np.float32).view(np.uint32) & 0xFFFF))  # bits bf16 drops
    assert rounded == len(weights)  # each of them would have lost bits as a bf16 parameter


@pytest.mark.feature("fp16")
def test_fp16_training_with_loss_scaling(capsys, corpus, tmp_path, framework):
    from mindspeed_core import device, features

    status = features.get("fp16").status(framework, device.type()).kind
    code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "20", "--fp16",
                           "--metrics-file", str(tmp_path / "m.jsonl"))
    if status != "supported":
        assert code == 2 and "fp16" in err and "unsupported" in err
        return
    assert code == 0, err
    got = losses(tmp_path / "m.jsonl")
    assert got[20] < got[1] - 0.5


@pytest.mark.feature("fp16")
def test_fp16_overflow_skips_the_step_halves_the_scale_and_training_continues(corpus, framework):
    import math

    from mindspeed_core import device, ops
    from mindspeed_core.compat import megatron_args
    from mindspeed_core.training.trainer import Trainer

    if not device.supports_dtype("float16"):
        pytest.skip("float16 math is not available on this device (the matrix marks it unsupported)")
    start = 2.0 ** 40  # fp16 holds at most 65504: the scaled gradients overflow at once
    args = megatron_args.training_parser().parse_args([*SMALL, "--data-path", corpus, "--train-iters", "40", "--fp16",
                                                       "--initial-loss-scale", str(start)])
    trainer = Trainer(args)
    trainer.build()
    before = [ops.to_numpy(p).copy() for p in trainer.params]
    loss, _, norm = trainer.train_step(0)
    assert math.isnan(norm) and math.isfinite(loss)  # skipped, with the loss still reported
    assert trainer.scaler.scale == start / 2 and trainer.optimizer.steps == 0
    for a, p in zip(before, trainer.params):
        np.testing.assert_array_equal(ops.to_numpy(p), a)
    halvings = 1
    for it in range(1, 40):
        _, _, norm = trainer.train_step(it)
        if math.isfinite(norm):
            break
        halvings += 1
    assert math.isfinite(norm) and trainer.scaler.scale == start / 2 ** halvings, (halvings, trainer.scaler.scale)
    assert trainer.optimizer.steps == 1
    assert any(not np.array_equal(ops.to_numpy(p), a) for a, p in zip(before, trainer.params))


def test_loss_scaler_grows_after_clean_steps_and_restarts_the_count_on_overflow():
    from mindspeed_core.training.loss_scale import GROWTH_INTERVAL, LossScaler

    scaler = LossScaler(dynamic=True, initial=8.0)
    assert all(scaler.step_allowed(True) for _ in range(GROWTH_INTERVAL - 1)) and scaler.scale == 8.0
    assert scaler.step_allowed(True) and scaler.scale == 16.0
    assert not scaler.step_allowed(False) and (scaler.scale, scaler.clean_steps) == (8.0, 0)
    restored = LossScaler(dynamic=True)
    restored.load_state(scaler.state())
    assert restored.state() == {"loss_scale": 8.0, "clean_steps": 0}
    fixed = LossScaler(dynamic=False)  # bf16 / fp32: scale 1, never a skipped step
    assert fixed.step_allowed(False) and fixed.scale == 1.0 and fixed.scale_loss(3.0) == 3.0


def test_megatron_entry_script_dry_run(corpus):
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[1] / "tools" / "pretrain_gpt.py"
    out = subprocess.run([sys.executable, str(script), *SMALL, "--data-path", corpus, "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["seq_length"] == 32
