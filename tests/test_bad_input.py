"""Every bad input a careless or hostile user can give: exit status 2, exactly one line on
stderr, no traceback, and nothing written. The table runs on the selected framework (CI runs
it under both)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mindspeed_core import cli
from test_training import SMALL, corpus  # noqa: F401  (corpus is a fixture)


def _jsonl(tmp, raw: bytes):
    (tmp / "in.jsonl").write_bytes(raw)
    return ["preprocess", "--input", str(tmp / "in.jsonl"), "--output-prefix", str(tmp / "out" / "ds")]


def _checkpoint(tmp, corpus, damage):  # noqa: F811
    """A real checkpoint of SMALL, damaged by ``damage(folder)``; resuming it must fail."""
    ckpt = tmp / "ckpt"
    assert cli.main(["train", *SMALL, "--data-path", corpus, "--train-iters", "1", "--save", str(ckpt)]) == 0
    damage(ckpt)
    return ["train", *SMALL, "--data-path", corpus, "--train-iters", "2", "--load", str(ckpt)]


def _torch_dist(tmp, corpus, damage):  # noqa: F811
    """A real checkpoint of SMALL with Megatron's torch_dist files beside ours, those damaged by
    ``damage(iteration folder)``: resuming it must fail (a folder we load is one megatron-core
    can load)."""
    ckpt = tmp / "ckpt"
    assert cli.main(["train", *SMALL, "--data-path", corpus, "--train-iters", "1", "--save", str(ckpt),
                     "--ckpt-format", "torch_dist"]) == 0
    damage(ckpt / "iter_0000001")
    return ["train", *SMALL, "--data-path", corpus, "--train-iters", "2", "--load", str(ckpt)]


def _garble(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2:] = b"\x00" * (len(data) - len(data) // 2)
    path.write_bytes(bytes(data))


def _flip_header_byte(ckpt):
    path = ckpt / "iter_0000001" / "rank_00000.safetensors"
    data = bytearray(path.read_bytes())
    data[8 + data[8:].index(b'"shape":[') + 9] = ord("x")  # the first shape's first digit
    path.write_bytes(bytes(data))


def _edit_meta(edit):
    """A damage that rewrites iter_0000001/meta.json through ``edit(meta)``."""
    def damage(ckpt):
        path = ckpt / "iter_0000001" / "meta.json"
        meta = json.loads(path.read_text())
        edit(meta)
        path.write_text(json.dumps(meta))
    return damage


def _first_model_record(meta):
    return next(iter(meta["index"]["model"].values()))


def _hf(tmp, corpus, config, extra=None):  # noqa: F811
    folder = tmp / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for name, text in (extra or {}).items():
        (folder / name).write_text(text)
    return ["train", "--load-hf", str(folder), "--data-path", corpus, "--seq-length", "16", "--train-iters", "1",
            "--eval-iters", "0"]


LLAMA = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 64}

# (id, builder(tmp, corpus) -> argv, a fragment the one line must hold)
CASES = [
    # preprocessing
    ("pre-binary", lambda t, c: _jsonl(t, b'{"text": "ok"}\n\xff\xfe\x00binary\n'), "in.jsonl:2 is not UTF-8"),
    ("pre-surrogate", lambda t, c: _jsonl(t, b'{"text": "a\\ud800b"}\n'), "lone surrogate"),
    ("pre-null-line", lambda t, c: _jsonl(t, b"null\n"), "is a JSON NoneType, not an object"),
    ("pre-number-line", lambda t, c: _jsonl(t, b"42\n"), "is a JSON int, not an object"),
    ("pre-list-line", lambda t, c: _jsonl(t, b'["text"]\n'), "is a JSON list, not an object"),
    ("pre-null-text", lambda t, c: _jsonl(t, b'{"text": null}\n'), "'text' is null, not text"),
    ("pre-number-text", lambda t, c: _jsonl(t, b'{"text": 7}\n'), "'text' is int, not text"),
    ("pre-unwritable", lambda t, c: _jsonl(t, b'{"text": "a"}\n')[:-1] + ["/proc/nowhere/ds"], "not writable"),
    ("pre-output-under-file", lambda t, c: _jsonl(t, b'{"text": "a"}\n')[:-1] + [str(t / "in.jsonl" / "ds")],
     "not a folder"),
    ("pre-workers-0", lambda t, c: _jsonl(t, b'{"text": "a"}\n') + ["--workers", "0"], "--workers"),
    ("pre-null-tokenizer-text", lambda t, c: _jsonl(t, b'{"text": "1 two"}\n') + ["--tokenizer-type", "NullTokenizer",
                                                                                  "--vocab-size", "10"],
     "space-separated token ids"),
    # training flags
    *[(f"train-{flag}-{value}", (lambda flag, value: lambda t, c: ["train", *SMALL, "--data-path", c,
                                                                    f"--{flag}", value, "--save", str(t / "ckpt")])(flag, value),
       f"--{flag}")
      for flag, value in (("num-attention-heads", "0"), ("num-attention-heads", "-4"), ("num-query-groups", "0"),
                          ("make-vocab-size-divisible-by", "0"), ("hidden-size", "0"), ("ffn-hidden-size", "-1"),
                          ("num-layers", "0"), ("global-batch-size", "0"), ("attention-dropout", "1"),
                          ("attention-dropout", "-0.1"), ("hidden-dropout", "nan"), ("seed", "-1"),
                          ("seed", "99999999999"), ("lr", "-1e-3"), ("lr", "inf"), ("eval-iters", "-1"),
                          ("micro-batch-size", "0"), ("seq-length", "0"), ("tensor-model-parallel-size", "0"),
                          ("adam-beta2", "1"), ("clip-grad", "-1"))],
    ("train-unknown-flag", lambda t, c: ["train", *SMALL, "--data-path", c, "--no-such-flag"], "unrecognized"),
    # the fp32 switch of a layer not built here (Hunyuan's): the matrix's row
    ("train-input-norm-fp32", lambda t, c: ["train", *SMALL, "--data-path", c, "--input-layernorm-in-fp32"],
     "input-layernorm-fp32"),
    ("train-param-gather-without-distopt", lambda t, c: ["train", *SMALL, "--data-path", c, "--overlap-param-gather"],
     "add --use-distributed-optimizer"),
    ("train-blend-nan", lambda t, c: ["train", *SMALL, "--data-path", "nan", c, "1", c], "must be a positive number"),
    ("train-blend-inf", lambda t, c: ["train", *SMALL, "--data-path", "inf", c, "1", c], "must be a positive number"),
    ("train-split-negative", lambda t, c: ["train", *SMALL, "--data-path", c, "--split", "100,-10,10"],
     "each zero or positive"),
    ("train-split-zero", lambda t, c: ["train", *SMALL, "--data-path", c, "--split", "0,0,0"], "has no positive part"),
    ("train-split-text", lambda t, c: ["train", *SMALL, "--data-path", c, "--split", "98,x"], "must be numbers"),
    ("train-blend-odd", lambda t, c: ["train", *SMALL, "--data-path", "0.5", c, c], "weight/prefix pairs"),
    ("train-mtp-scaling-without-modules", lambda t, c: ["train", *SMALL, "--data-path", c,
                                                        "--mtp-loss-scaling-factor", "0.3"],
     "--mtp-loss-scaling-factor qualifies the multi-token prediction modules of --mtp-num-layers"),
    # multi-token prediction: every depth needs targets, and a module is a layer of its own
    ("train-mtp-past-the-sequence", lambda t, c: ["train", *SMALL, "--data-path", c, "--mtp-num-layers", "10",
                                                  "--seq-length", "8"], "depths 8 and beyond have no targets"),
    ("train-mtp-deeper-than-the-model", lambda t, c: ["train", *SMALL, "--data-path", c, "--mtp-num-layers", "3"],
     "--mtp-num-layers 3 exceeds the model's 2 layers"),
    # --optimizer muon: what it does not run with, and its settings
    *[(f"train-muon-{case}", (lambda extra: lambda t, c: ["train", *SMALL, "--data-path", c, "--optimizer", "muon",
                                                          *extra])(extra), fragment)
      for case, extra, fragment in (
          # (MindSpore's CPU refuses fp16 itself first, in the same words)
          ("fp16", ["--fp16"], "fp16 (--fp16) is "),
          ("distributed-swap", ["--use-distributed-optimizer", "--swap-optimizer"],
           "--swap-optimizer with Muon's layer-wise distributed optimizer is not built here"),
          ("coefficients", ["--muon-coefficient-type", "polar_express"],
           "--muon-coefficient-type 'polar_express' is not built here: choose quintic or simple"),
          ("ns-steps-0", ["--muon-num-ns-steps", "0"], "--muon-num-ns-steps"),
          ("lion", ["--muon-scalar-optimizer", "lion"], "--muon-scalar-optimizer lion is not built here"))],
    ("train-dist-muon-save-whole", lambda t, c: ["train", *SMALL, "--data-path", c, "--optimizer", "dist_muon",
                                                 "--save-whole", "--save", str(t / "ckpt")],
     "--save-whole with Muon's layer-wise distributed optimizer is not built here"),
    ("train-dist-muon-swap", lambda t, c: ["train", *SMALL, "--data-path", c, "--optimizer", "dist_muon",
                                           "--swap-optimizer"],
     "--swap-optimizer with Muon's layer-wise distributed optimizer is not built here"),
    ("train-dist-muon-qk-clip", lambda t, c: ["train", *SMALL, "--data-path", c, "--optimizer", "dist_muon",
                                              "--qk-clip"],
     "--qk-clip with --optimizer dist_muon is not built here"),
    ("train-muon-flag-with-adamw", lambda t, c: ["train", *SMALL, "--data-path", c, "--muon-momentum", "0.9"],
     "--muon-momentum qualifies --optimizer muon, and this run uses AdamW"),
    # --qk-clip: its values, and models without logits it can clip
    *[(f"train-qk-clip-{case}", (lambda extra: lambda t, c: ["train", *SMALL, "--data-path", c, *extra])(extra),
       fragment)
      for case, extra, fragment in (
          ("alpha", ["--qk-clip", "--qk-clip-alpha", "1.5"], "--qk-clip-alpha"),
          ("threshold-alone", ["--qk-clip-threshold", "50"], "--qk-clip-threshold qualifies --qk-clip"),
          ("mla", ["--qk-clip", "--multi-latent-attention", "--num-query-groups", "4", "--kv-lora-rank", "16",
                   "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"],
           "this model has latent attention (MLA)"),
          ("qk-norm", ["--qk-clip", "--qk-layernorm"], "--qk-layernorm normalises their outputs again"),
          ("packed", ["--log-max-attention-logit", "--reset-attention-mask"],
           "--log-max-attention-logit with --reset-attention-mask is not built here"))],
    # --moe-fb-overlap beside what it does not combine with
    ("train-fb-overlap-and-a2a-overlap", lambda t, c: ["train", *SMALL, "--data-path", c, "--num-experts", "4",
                                                       "--moe-fb-overlap", "--moe-alltoall-overlap-comm"],
     "both overlap the dispatch's all-to-all"),
    ("train-fb-overlap-and-zero-memory", lambda t, c: ["train", *SMALL, "--data-path", c, "--num-experts", "4",
                                                       "--moe-fb-overlap", "--moe-zero-memory", "level1"],
     "--moe-fb-overlap with --moe-zero-memory level1 is not built here"),
    ("train-save-under-file", lambda t, c: ["train", *SMALL, "--data-path", c, "--save", str(t / "f" / "ckpt")],
     "is not a folder"),
    ("train-save-is-file", lambda t, c: ["train", *SMALL, "--data-path", c, "--save", str(t / "f")], "is a file"),
    ("train-save-readonly", lambda t, c: ["train", *SMALL, "--data-path", c, "--save", "/proc/ckpt"], "not writable"),
    ("train-null-tokenizer-no-size", lambda t, c: ["train", *SMALL, "--data-path", c, "--tokenizer-type",
                                                   "NullTokenizer"], "needs --vocab-size"),
    ("train-gpt2-no-files", lambda t, c: ["train", *SMALL, "--data-path", c, "--tokenizer-type", "GPT2BPETokenizer"],
     "needs --vocab-file"),
    # checkpoints
    ("ckpt-binary-tracker", lambda t, c: _checkpoint(t, c, lambda k: (k / "latest_checkpointed_iteration.txt")
                                                     .write_bytes(b"\x00\xff1")), "does not hold an iteration number"),
    ("ckpt-non-ascii-tracker", lambda t, c: _checkpoint(t, c, lambda k: (k / "latest_checkpointed_iteration.txt")
                                                        .write_text("١")), "does not hold an iteration number"),
    ("ckpt-meta-list", lambda t, c: _checkpoint(t, c, lambda k: (k / "iter_0000001" / "meta.json").write_text("[1]")),
     "not a JSON object"),
    ("ckpt-meta-binary", lambda t, c: _checkpoint(t, c, lambda k: (k / "iter_0000001" / "meta.json")
                                                  .write_bytes(b"\xff\xfe")), "not JSON"),
    # meta.json against the folder, the tracker, the run state and the tensors (issue 59 item 3)
    ("ckpt-meta-other-iteration", lambda t, c: _checkpoint(t, c, _edit_meta(lambda m: m.update(iteration=2))),
     "says iteration 2, but its folder and the tracker say 1"),
    ("ckpt-meta-tp", lambda t, c: _checkpoint(t, c, _edit_meta(lambda m: m["parallel"].update(tp=2))),
     "records TP=2, but its trainer_state.json was saved at TP=1"),
    ("ckpt-meta-tp-zero", lambda t, c: _checkpoint(t, c, _edit_meta(lambda m: m["parallel"].update(tp=0))),
     "records no valid layout"),
    ("ckpt-meta-dtype", lambda t, c: _checkpoint(t, c, _edit_meta(lambda m: _first_model_record(m).update(
        dtype="bfloat16"))), "as float32, but meta.json's index records model tensor"),
    # Megatron's torch_dist files beside ours (issue 59 items 6 and 12)
    ("ckpt-td-config-not-json", lambda t, c: _torch_dist(t, c, lambda f: (f / "metadata.json").write_text("{")),
     "metadata.json is corrupt (not JSON)"),
    ("ckpt-td-zarr", lambda t, c: _torch_dist(t, c, lambda f: (f / "metadata.json").write_text(
        '{"sharded_backend": "zarr"}')), "names the sharded backend 'zarr'"),
    ("ckpt-td-distcp", lambda t, c: _torch_dist(t, c, lambda f: _garble(f / "__0_0.distcp")), "__0_0.distcp"),
    ("ckpt-td-no-metadata", lambda t, c: _torch_dist(t, c, lambda f: (f / ".metadata").unlink()),
     "has no .metadata: megatron-core cannot load it"),
    ("ckpt-td-no-common", lambda t, c: _torch_dist(t, c, lambda f: (f / "common.pt").unlink()),
     "has no common.pt: megatron-core cannot load it"),
    ("ckpt-header-byte", lambda t, c: _checkpoint(t, c, _flip_header_byte), "corrupt"),
    ("ckpt-state-garbled", lambda t, c: _checkpoint(t, c, lambda k: (k / "iter_0000001" / "trainer_state.json")
                                                    .write_text("{}")), "SHA-256"),
    # Hugging Face folders
    ("hf-not-object", lambda t, c: _hf(t, c, "[1, 2]"), "not an object"),
    ("hf-missing-key", lambda t, c: _hf(t, c, {k: v for k, v in LLAMA.items() if k != "hidden_size"}), "'hidden_size'"),
    ("hf-zero-heads", lambda t, c: _hf(t, c, {**LLAMA, "num_attention_heads": 0}), "num_attention_heads"),
    ("hf-string-size", lambda t, c: _hf(t, c, {**LLAMA, "hidden_size": "64"}), "hidden_size"),
    ("hf-huge", lambda t, c: _hf(t, c, {**LLAMA, "hidden_size": 65536, "intermediate_size": 262144,
                                     "num_hidden_layers": 64}), "GiB available"),
    ("hf-index-absolute", lambda t, c: _hf(t, c, LLAMA, {"model.safetensors.index.json": json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "/etc/passwd"}})}), "not a file inside that folder"),
    ("hf-index-parent", lambda t, c: _hf(t, c, LLAMA, {"model.safetensors.index.json": json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "../x.safetensors"}})}), "not a file inside that folder"),
]


def _tree(root):
    return {os.path.relpath(os.path.join(d, f), root) for d, dirs, fs in os.walk(root) for f in fs + dirs}


def assert_refused_in_one_line(capsys, tmp_path, argv, fragment):
    """``argv`` exits 2 with one line on stderr holding ``fragment``, no traceback, and leaves
    ``tmp_path`` as it was."""
    capsys.readouterr()
    before = _tree(tmp_path)
    code = cli.main(argv)
    out = capsys.readouterr()
    assert code == 2, (out.out[-2000:], out.err)
    assert out.err.count("\n") == 1 and "Traceback" not in out.err, out.err
    assert fragment in out.err, out.err
    assert _tree(tmp_path) == before, _tree(tmp_path) - before


@pytest.mark.parametrize("case, build, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(capsys, corpus, tmp_path, case, build, fragment):  # noqa: F811
    (tmp_path / "f").write_text("a file where a folder would go")
    assert_refused_in_one_line(capsys, tmp_path, build(tmp_path, corpus), fragment)


# the rows refused from the flags alone (no data, checkpoint or Hugging Face weights read)
FLAG_ROWS = [case for case in CASES if case[0].startswith("train-")]


@pytest.mark.parametrize("case, build, fragment", FLAG_ROWS, ids=[c[0] for c in FLAG_ROWS])
def test_check_args_refuses_what_train_refuses(capsys, corpus, tmp_path, case, build, fragment):  # noqa: F811
    """`mindspeed check-args` runs train's configuration (configuration.configure, the one
    function both call): every flag row of the table is its refusal too, in the same words."""
    (tmp_path / "f").write_text("a file where a folder would go")
    argv = build(tmp_path, corpus)
    assert argv[0] == "train"
    assert_refused_in_one_line(capsys, tmp_path, ["check-args", *argv[1:]], fragment)


def test_token_ids_beyond_the_tokenizer_stop_at_the_first_batch(capsys, corpus, tmp_path):  # noqa: F811
    from mindspeed_core.data import indexed

    writer = indexed.IndexedDatasetWriter(str(tmp_path / "wide"), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(20):
        writer.add_document(rng.integers(0, 1000, 200))  # made with a 1000-token vocabulary
    writer.finalize()
    code = cli.main(["train", *SMALL, "--data-path", str(tmp_path / "wide"), "--train-iters", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "outside the ByteLevel tokenizer's 257 ids" in err and "vocabulary of at least" in err


def test_safetensors_header_bit_flips_are_all_clear_errors(tmp_path):
    """Every single-bit flip in a header either still parses to the same tensors or is a
    CheckpointError: never another exception type (24% were before)."""
    from mindspeed_core import tensor_files
    from mindspeed_core.errors import CheckpointError

    path = tmp_path / "t.safetensors"
    tensor_files.save(str(path), {"a.weight": tensor_files.HostTensor(np.arange(12, dtype=np.float32).reshape(3, 4)),
                                  "b": tensor_files.HostTensor(np.ones(5, np.float16))}, {"k": 1})
    good = path.read_bytes()
    header_len = int.from_bytes(good[:8], "little")
    rng = np.random.default_rng(0)
    outcomes = {"error": 0, "same": 0}
    for bit in rng.choice((8 + header_len) * 8, 400, replace=False):
        data = bytearray(good)
        data[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(data))
        try:
            tensors, _ = tensor_files.load(str(path))
        except CheckpointError:
            outcomes["error"] += 1
            continue
        outcomes["same"] += 1  # a flip in padding or in a name: the file still describes valid tensors
    assert outcomes["error"] > 300, outcomes
