"""Nothing lost: atomic re-saves, a guarded --save folder, exact resume in every mode,
integrity checks, stale temporaries, a launcher that schedulers can stop, Megatron's
NullTokenizer and GPT2BPETokenizer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from launch import free_port
from test_parallel import GQA
from test_training import SMALL, corpus, losses, train  # noqa: F401  (corpus is a fixture)

from mindspeed_core.errors import CheckpointError
from mindspeed_core.training import checkpoint


def _save(root, iteration, value):
    return checkpoint.save(str(root), iteration, {"w": np.full(4, value, np.float32)}, {}, iteration, {"m": 1})


def test_resaving_an_iteration_keeps_a_complete_checkpoint_at_every_instant(tmp_path, monkeypatch):
    _save(tmp_path, 3, 1.0)
    # killed right after the atomic swap, before the old copy is deleted
    real_rmtree = checkpoint.shutil.rmtree

    def dying_rmtree(path, ignore_errors=False):
        if ".tmp-" in path and not ignore_errors:  # the old copy, swapped aside
            raise KeyboardInterrupt
        return real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", dying_rmtree)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 3, 2.0)
    monkeypatch.undo()
    assert checkpoint.load(str(tmp_path), 3)[0]["w"][0] == 2.0  # the new one, complete
    # a filesystem without RENAME_EXCHANGE, killed between its two renames
    monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)
    real_replace, calls = os.replace, []

    def dying_replace(src, dst):
        if os.path.basename(src).startswith("iter_0000003.tmp-"):  # the new folder, after the old went aside
            calls.append(src)
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 3, 3.0)
    monkeypatch.undo()
    assert calls and checkpoint.latest_iteration(str(tmp_path)) == 3 and not (tmp_path / "iter_0000003").exists()
    assert checkpoint.load(str(tmp_path), 3)[0]["w"][0] == 2.0  # found under .old-PID, complete
    # a later run in the same folder cleans the dead save's temporaries but keeps that only copy
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"iter_0000009.tmp-{dead.pid}").mkdir()
    assert checkpoint.remove_stale_temporaries(str(tmp_path)) == [f"iter_0000009.tmp-{dead.pid}"]
    assert [n for n in os.listdir(tmp_path) if ".old-" in n]


def test_stale_temporaries_of_dead_processes_are_removed_live_ones_kept(capsys, corpus, tmp_path):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    assert train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "1", "--save", str(ckpt))[0] == 0
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name in (f"iter_0000002.tmp-{dead.pid}", f"iter_0000001.old-{dead.pid}", f"iter_0000005.tmp-{os.getpid()}"):
        (ckpt / name).mkdir()
    (ckpt / f"latest_checkpointed_iteration.txt.tmp-{dead.pid}").write_text("2")
    code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "2", "--load", str(ckpt),
                           "--save", str(ckpt))
    assert code == 0, err
    left = sorted(os.listdir(ckpt))
    assert f"iter_0000005.tmp-{os.getpid()}" in left  # a live process's save in progress
    assert not [n for n in left if str(dead.pid) in n], left
    assert "removed what interrupted saves left" in out


def test_save_folder_of_another_run_is_refused_unless_resumed_or_overwritten(capsys, corpus, tmp_path):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    assert train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "3", "--save", str(ckpt))[0] == 0
    code, _, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "2", "--save", str(ckpt))
    assert code == 2 and err.count("\n") == 1 and f"--load {ckpt}" in err and "--overwrite-checkpoints" in err
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"  # untouched
    code, _, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "2", "--save", str(ckpt),
                         "--overwrite-checkpoints")
    assert code == 0 and (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2", err


@pytest.mark.parametrize("layout", ["sharded", "whole"])
def test_a_flipped_bit_in_the_data_is_refused_naming_the_file(capsys, corpus, tmp_path, layout):  # noqa: F811
    """Each format's digests: a sharded checkpoint's per piece (a rank reads its slices only)
    and per file, a whole one's (--save-whole) per file."""
    ckpt = tmp_path / "ckpt"
    whole = ["--save-whole"] if layout == "whole" else []
    assert train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "1", "--save", str(ckpt), *whole)[0] == 0
    name = "model.safetensors" if whole else "rank_00000.safetensors"
    path = ckpt / "iter_0000001" / name
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # an exponent bit of the last tensor: it would load as a wild value
    path.write_bytes(bytes(data))
    code, _, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "2", "--load", str(ckpt))
    assert code == 2 and err.count("\n") == 1 and f"{name} is corrupt" in err and "SHA-256" in err, err
    with pytest.raises(CheckpointError, match=f"{name} is corrupt"):
        checkpoint.load(str(ckpt), 1)


def _resume_matches(capsys, corpus, tmp_path, *flags):  # noqa: F811
    """Losses of an interrupted and resumed run equal the uninterrupted run's, bit for bit."""
    argv = [*SMALL, "--data-path", corpus, "--train-iters", "8", *flags]
    assert train(capsys, *argv, "--metrics-file", str(tmp_path / "full.jsonl"))[0] == 0
    ckpt = tmp_path / "ckpt"
    assert train(capsys, *argv, "--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4",
                 "--metrics-file", str(tmp_path / "a.jsonl"))[0] == 0
    code, out, err = train(capsys, *argv, "--load", str(ckpt), "--save", str(ckpt),
                           "--metrics-file", str(tmp_path / "b.jsonl"))
    assert code == 0 and "resumed from" in out, err
    full = losses(tmp_path / "full.jsonl")
    assert {**losses(tmp_path / "a.jsonl"), **losses(tmp_path / "b.jsonl")} == full
    return full


def test_resume_with_dropout_is_exact(capsys, corpus, tmp_path):  # noqa: F811
    full = _resume_matches(capsys, corpus, tmp_path, "--attention-dropout", "0.2", "--hidden-dropout", "0.2")
    assert len(set(full.values())) == len(full)


@pytest.mark.feature("fp16")
def test_resume_with_fp16_loss_scaling_is_exact(capsys, corpus, tmp_path, framework):  # noqa: F811
    from mindspeed_core import device, features

    if features.get("fp16").status(framework, device.type()).kind != "supported":
        code, _, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "1", "--fp16")
        assert code == 2 and "fp16" in err  # refused by the gate, as the matrix says
        return
    # dropout too, so that both the generator states and the loss scale must come back
    _resume_matches(capsys, corpus, tmp_path, "--fp16", "--hidden-dropout", "0.1")
    state = json.loads((tmp_path / "ckpt" / "iter_0000004" / "trainer_state.json").read_text())
    assert state["loss_scale"] <= 2.0 ** 16 and state["clean_steps"] >= 0 and len(state["rng"]) == 1


# ---- the launcher ---------------------------------------------------------------------------

def _tagged(tag: str, also: bytes = b"") -> list[str]:
    """"pid: command line" of the processes started with this tag (and ``also``) in their environment."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read()
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"MINDSPEED_TEST_TAG={tag}".encode() in env and also in env and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd[:120]}")
    return found


def _start_job(framework, corpus, tmp_path, tag):  # noqa: F811
    cmd = [sys.executable, "-m", "mindspeed_core.cli", "launch", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "--log-dir", str(tmp_path / "logs"), "--", "--ai-framework", framework, *GQA,
           "--data-path", corpus, "--train-iters", "100000", "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINDSPEED_TEST_TAG": tag}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 240
    while not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists():  # the ranks are training
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.5)
    return proc


def _gone_within(tag, seconds):
    deadline = time.time() + seconds
    while _tagged(tag) and time.time() < deadline:
        time.sleep(0.5)
    return _tagged(tag)


@pytest.mark.multiprocess
@pytest.mark.feature("data-parallel")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_stops_every_process_of_the_job(framework, corpus, tmp_path, signum):  # noqa: F811
    tag = f"sig-{os.getpid()}-{time.time()}"
    proc = _start_job(framework, corpus, tmp_path, tag)
    try:
        sent = time.time()
        proc.send_signal(signum)  # to `mindspeed launch` alone, as Slurm or Kubernetes would
        out, err = proc.communicate(timeout=60)
        left = _gone_within(tag, max(1.0, 30 - (time.time() - sent)))
        elapsed = time.time() - sent
    finally:
        for line in _tagged(tag):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert not left, left
    assert elapsed < 30, f"{elapsed:.0f}s"
    assert proc.returncode == 128 + signum, err[-2000:]
    assert f"{signal.Signals(signum).name} received" in err
    assert checkpoint.latest_iteration(str(tmp_path / "ckpt")) >= 2  # the last checkpoint is intact
    checkpoint.load(str(tmp_path / "ckpt"), checkpoint.latest_iteration(str(tmp_path / "ckpt")))


@pytest.mark.multiprocess
@pytest.mark.feature("data-parallel")
def test_the_framework_launcher_dying_is_named_and_its_ranks_stopped(framework, corpus, tmp_path):  # noqa: F811
    """torchrun killed (its ranks run in sessions of their own and would train on), or
    msrun's scheduler killed (reported as the scheduler, not as rank 0)."""
    tag = f"die-{os.getpid()}-{time.time()}"
    proc = _start_job(framework, corpus, tmp_path, tag)
    try:
        if framework == "pytorch":
            victim = next(int(x.split(":")[0]) for x in _tagged(tag) if "torch.distributed.run" in x)
            named = "torchrun itself died first"
        else:
            victim = next(int(x.split(":")[0]) for x in _tagged(tag, b"MS_ROLE=MS_SCHED"))
            named = "the msrun scheduler died first (not a rank)"
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        out, err = proc.communicate(timeout=120)
        elapsed = time.time() - killed
        left = _gone_within(tag, 30)
    finally:
        for line in _tagged(tag):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert proc.returncode != 0 and named in err, err[-2000:]
    assert not left, left
    # the launcher stops the orphaned ranks itself (msrun's would wait out the heartbeat, ~30 s)
    assert elapsed < 15, f"the job took {elapsed:.0f}s to stop"


def test_launcher_checks_training_flags_once_before_any_rank_starts(capsys, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from mindspeed_core import cli

    monkeypatch.chdir(tmp_path)

    def launch(*argv):  # `mindspeed launch` in this process: what it says, its exit code
        code = cli.main(["launch", *argv])
        said = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=said.out, stderr=said.err)

    for argv, fragment in (
            (["--nproc-per-node", "2", "--", "--tensor-model-parallel-size", "2", "--num-attention-heads", "3",
              "--num-query-groups", "3", "--hidden-size", "48"], "does not divide the attention heads"),
            (["--nproc-per-node", "2", "--", "--hidden-size", "-1"], "--hidden-size"),
            (["--nproc-per-node", "0", "--"], "--nproc-per-node"),
            (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "--"], "--node-rank 2 must be below"),
            (["--nproc-per-node", "2", "--ai-framework", "pytorch", "--", "--ai-framework", "mindspore"], "disagree")):
        out = launch(*argv)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and fragment in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and not out.stdout
    import socket

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        out = launch("--nproc-per-node", "2", "--master-port", str(busy.getsockname()[1]), "--", "--train-iters", "1")
    assert out.returncode == 2 and "already in use" in out.stderr and "--master-port" in out.stderr, out.stderr
    # a fresh process: this one is bound to the suite's framework already
    out = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", "launch", "--ai-framework", "mindspore",
                          "--nproc-per-node", "2", "--print-command", "--", "--train-iters", "1"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "msrun" in out.stdout and "train --ai-framework mindspore" in out.stdout


# ---- Megatron's tokenizers ------------------------------------------------------------------

def test_null_tokenizer_matches_megatron_core_and_trains(capsys, tmp_path):
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as Reference

    from mindspeed_core.data.tokenizer import build_tokenizer

    ours, ref = build_tokenizer("NullTokenizer", vocab_size=50), Reference(50)
    assert (ours.vocab_size, ours.eod) == (ref.vocab_size, ref.eod)
    assert ours.encode("3 14 15 9") == ref.text_to_ids("3 14 15 9") and ours.decode([3, 14]) == ref.ids_to_text([3, 14])
    rng = np.random.default_rng(0)
    with open(tmp_path / "ids.jsonl", "w") as fh:
        for _ in range(40):
            fh.write(json.dumps({"text": " ".join(map(str, rng.integers(0, 50, 100)))}) + "\n")
    from mindspeed_core import cli

    assert cli.main(["preprocess", "--input", str(tmp_path / "ids.jsonl"), "--output-prefix", str(tmp_path / "ids"),
                     "--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--append-eod"]) == 0
    code, out, err = train(capsys, *SMALL, "--data-path", str(tmp_path / "ids_text_document"), "--tokenizer-type",
                           "NullTokenizer", "--vocab-size", "50", "--train-iters", "2")
    assert code == 0 and "lm loss" in out, err


def test_gpt2_bpe_tokenizer_matches_transformers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Tokenizer

    from mindspeed_core.data.tokenizer import build_tokenizer

    texts = ["Hello world, it's a test.", "def f(x):\n    return x  # ünïcödé", "数字 123 and emoji 🙂",
             "<|endoftext|> inside text", "  spaces   and\ttabs\n\n"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(texts * 30, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.model.save(str(tmp_path))  # vocab.json, merges.txt
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                           merge_file=str(tmp_path / "merges.txt"))
    ref = GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert ours.eod == ref.convert_tokens_to_ids("<|endoftext|>") and ours.vocab_size == len(ref.get_vocab())
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


def _load_everything(root, shapes):
    """What a resume reads of a sharded checkpoint, in this process: meta.json, each tensor whole
    and as a one-rank layout's slice, the step count and the run state."""
    from mindspeed_core.parallel.plan import ParamPlan
    from mindspeed_core.parallel.state import ParallelState
    from mindspeed_core.training import sharded_checkpoint as sc

    it = checkpoint.latest_iteration(str(root))
    shards, ps, out = checkpoint.reader(str(root), it), ParallelState(1, 0), {}
    for section in ("model", "optimizer"):
        out.update({(section, n, "whole"): a for n, a in shards.whole(section).items()})
        for name in sorted(shards.names(section)):
            out[section, name, "read"] = shards.read(section, sc.held(name, shapes[section, name], ParamPlan(name), ps))
    out["steps"] = shards.steps
    out["state"] = json.dumps(checkpoint.load_trainer_state(str(root), it), sort_keys=True)
    return out


def _fuzz_edit(meta, rng):
    """One random edit of a sharded checkpoint's meta.json: its pieces (offsets, shapes, files,
    entries, digests, pieces dropped, doubled or taken from a tensor of the same shape), a
    tensor's shape or dtype, the iteration, the layout. Returns what it did."""
    records = [(s, n, r) for s, tensors in meta["index"].items() for n, r in tensors.items()]
    section, name, record = rng.choice(records)
    piece = rng.choice(record["pieces"])
    kind = rng.choice(["offset", "shape", "whole-shape", "dtype", "iteration", "drop", "double", "swap", "entry",
                       "file", "digest", "rank", "tp"])
    if kind in ("offset", "shape", "whole-shape"):
        dims = piece[2 if kind == "offset" else 3] if kind != "whole-shape" else record["shape"]
        if not dims or rng.random() < 0.15:
            dims.append(rng.choice([0, 1, 2]))
        else:
            d = rng.randrange(len(dims))
            dims[d] = max(0, dims[d] + rng.choice([-64, -3, -1, 1, 2, 64, 10 ** 6]))
    elif kind == "dtype":
        record["dtype"] = rng.choice(["bfloat16", "float16", "int8", "float64", None, 4])
    elif kind == "iteration":
        meta["iteration"] = rng.choice([0, 2, -1, "1", None, 1.0, 10 ** 9])
    elif kind == "drop":
        record["pieces"].remove(piece)
    elif kind == "double":
        record["pieces"].append(list(piece))
    elif kind == "swap":  # another tensor's pieces of the same shape (or any other's)
        same = [r for s, n, r in records if r is not record and r["shape"] == record["shape"]] or \
               [r for s, n, r in records if r is not record]
        other = rng.choice(same)
        record["pieces"], other["pieces"] = other["pieces"], record["pieces"]
    elif kind == "entry":
        piece[1] = rng.choice([f"{section}/{name}/1", "model/other/0", "", piece[1] + "x"])
    elif kind == "file":
        piece[0] = rng.choice(["rank_00001.safetensors", "rank_00000.safetensors.bak", "trainer_state.json"])
    elif kind == "digest":
        piece[4] = rng.choice(["0" * 64, piece[4][::-1], ""])
    elif kind == "rank":
        meta["sha256"]["rank_00001.safetensors"] = "0" * 64
    else:
        meta["parallel"]["tp"] = rng.choice([2, 4, 0, "1", None])
    return f"{kind} of {section} tensor {name}"


@pytest.mark.feature("sharded-checkpoints")
def test_a_fuzzed_index_is_refused_in_one_line_or_loads_the_same_values(capsys, corpus, tmp_path):  # noqa: F811
    """Seeded random edits of a real sharded checkpoint's meta.json (issue 59, deliver 2): each
    either is refused with one CheckpointError line before a value is used, or loads exactly
    what the untouched checkpoint holds. Any other outcome (another exception, other values)
    fails."""
    import random
    import shutil

    ckpt = tmp_path / "ckpt"
    assert train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "1", "--save", str(ckpt))[0] == 0
    meta_path = ckpt / "iter_0000001" / "meta.json"
    good = meta_path.read_text()
    meta = json.loads(good)
    shapes = {(s, n): tuple(r["shape"]) for s, tensors in meta["index"].items() for n, r in tensors.items()}
    clean = _load_everything(ckpt, shapes)
    outcomes = {"refused": 0, "same": 0}
    for seed in range(48):
        rng = random.Random(seed)
        edited = json.loads(good)
        did = [_fuzz_edit(edited, rng) for _ in range(rng.choice([1, 1, 2]))]
        meta_path.write_text(json.dumps(edited))
        try:
            got = _load_everything(ckpt, shapes)
        except CheckpointError as exc:
            assert "\n" not in str(exc), (seed, did, str(exc))
            outcomes["refused"] += 1
            continue
        finally:
            meta_path.write_text(good)
        assert got.keys() == clean.keys(), (seed, did)
        assert all(np.array_equal(got[k], clean[k]) if isinstance(clean[k], np.ndarray) else got[k] == clean[k]
                   for k in clean), (seed, did)
        outcomes["same"] += 1
    assert outcomes["refused"] > 30, outcomes
    shutil.rmtree(ckpt)
