"""The bad-input promise on every verb beyond pre-training: preprocessing with each handler,
training per stage, generate, chat, evaluate per task, convert both ways, plot, plan, launch
and the matrix commands. Each row: exit status 2, exactly one line on stderr naming the
input, no traceback, and the directory tree as it was (nothing written, nothing lost). The
table runs on the selected framework (CI runs it under both)."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest

from mindspeed_core import cli
from mindspeed_core.compat import mcore, torch_pickle
from test_bad_input import assert_refused_in_one_line
from test_training import SMALL, corpus  # noqa: F401  (corpus is a fixture)

ALPACA = ["--handler-name", "AlpacaStyleInstructionHandler"]
SHAREGPT = ["--handler-name", "SharegptStyleInstructionHandler"]
ALPACA_PAIRS = ["--handler-name", "AlpacaStylePairwiseHandler"]
SHAREGPT_PAIRS = ["--handler-name", "SharegptStylePairwiseHandler"]
PRM = ["--handler-name", "AlpacaStyleProcessRewardHandler", "--placeholder-token", "@", "--reward-tokens", "+", "-"]
GOOD_ALPACA = {"instruction": "Add", "input": "1 2", "output": "3"}
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--train-iters", "1", "--eval-iters", "0", "--no-progress"]
PLAN_MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
              "--global-batch-size", "8", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1023",
              "--matmul-tflops", "0.1", "--elementwise-gelems", "1", "--link-gbps", "1", "--link-latency-us", "30",
              "--baseline-gb", "0.3"]


@pytest.fixture(scope="module")
def made(corpus, tmp_path_factory):  # noqa: F811
    """What the rows damage copies of: our checkpoint, its Megatron conversion (TP2, iterations 1
    and 2, and another model's), its Hugging Face export, and process-reward data."""
    root = tmp_path_factory.mktemp("made")
    assert cli.main(["train", *SMALL, "--data-path", corpus, "--train-iters", "1", "--save", str(root / "ckpt"),
                     "--eval-iters", "0", "--sample-tokens", "0"]) == 0
    assert cli.main(["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(root / "ckpt"),
                     "--save-dir", str(root / "hf")]) == 0
    from mindspeed_core.training import model_source

    source = model_source.read_ours(str(root / "ckpt"))
    for it in (1, 2):
        mcore.save(str(root / f"mg{it}"), it, source.cfg, source.state, mcore.Layout(tp=2), "float32")
    other = model_source.read_hf(str(root / "hf"))
    wider = dict(other.cfg.to_dict(), hidden_size=other.cfg.hidden_size * 2, kv_channels=None, ffn_hidden_size=None)
    from mindspeed_core.models.config import ModelConfig

    wide_cfg = ModelConfig.from_dict(wider)
    rng = np.random.default_rng(0)
    wide_state = {k: rng.standard_normal(_wide_shape(k, v.shape, source.cfg, wide_cfg)).astype(np.float32)
                  for k, v in source.state.items()}
    mcore.save(str(root / "mgwide"), 1, wide_cfg, wide_state, mcore.Layout(tp=2), "float32")
    (root / "steps.jsonl").write_text(json.dumps({"input": "1+1=2 @ 2+2=4 @", "value": ["+", "+"]}) + "\n"
                                      + json.dumps({"input": "1+1=3 @", "value": ["-"]}) + "\n")
    assert cli.main(["preprocess", "--input", str(root / "steps.jsonl"), "--output-prefix", str(root / "steps"),
                     *PRM]) == 0
    return root


def _wide_shape(name, shape, small, wide):
    """A tensor's shape in the wider model (every hidden and MLP width scaled)."""
    scale = {small.hidden_size: wide.hidden_size, small.ffn_hidden_size: wide.ffn_hidden_size,
             2 * small.ffn_hidden_size: 2 * wide.ffn_hidden_size, small.qkv_width: wide.qkv_width}
    return tuple(scale.get(d, d) for d in shape)


def _write(t, name, content):
    path = t / name
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return str(path)


def _records(t, records, name="in.jsonl"):
    return _write(t, name, "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def _pre(t, records, *flags, raw=None):
    source = _write(t, "in.jsonl", raw) if raw is not None else _records(t, records)
    return ["preprocess", "--input", source, "--output-prefix", str(t / "out" / "ds"), *flags]


def _copy(m, t, name):
    shutil.copytree(m / name, t / name)
    return t / name


def _edit_meta(m, t, **changes):
    ckpt = _copy(m, t, "ckpt")
    meta_path = ckpt / "iter_0000001" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["model"].update(changes)
    meta_path.write_text(json.dumps(meta))
    return str(ckpt)


def _edit_hf(m, t, **changes):
    folder = _copy(m, t, "hf")
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _holding(m, t, folder, *argv):
    """``argv``, once our checkpoint is copied into ``folder`` (of the test's own folder)."""
    shutil.copytree(m / "ckpt", t / folder)
    return list(argv)


def _grpo_resuming(m, t, reward):
    """GRPO on sums (instruction data made here) from a copy of our checkpoint, saving into that
    copy, rewarded by ``reward``."""
    _records(t, [{"instruction": f"{a}+{b}=", "output": f"#### {a + b}"} for a in range(4) for b in range(4)],
             "sums.jsonl")
    assert cli.main(["preprocess", "--input", str(t / "sums.jsonl"), "--output-prefix", str(t / "sums"), *ALPACA,
                     "--tokenizer-type", "ByteLevel", "--seq-length", "32"]) == 0
    run = str(_copy(m, t, "ckpt"))
    return ["train", *SMALL, "--stage", "grpo", "--data-path", str(t / "sums"), "--split", "100,0,0", "--load", run,
            "--finetune", "--save", run, "--train-iters", "1", "--num-generations", "2", "--global-batch-size", "2",
            "--micro-batch-size", "4", "--max-completion-length", "4", "--sample-tokens", "0", "--reward-funcs", reward]


def _mixed_ranks(m, t, other: str):
    """mg1 with its second tensor-parallel rank taken from ``other``."""
    folder = _copy(m, t, "mg1")
    theirs = m / other / "iter_{:07d}".format(2 if other == "mg2" else 1) / "mp_rank_01" / mcore.FILE
    shutil.copy(theirs, folder / "iter_0000001" / "mp_rank_01" / mcore.FILE)
    return str(folder)


def _rank_pickle(m, t, obj):
    folder = _copy(m, t, "mg1")
    torch_pickle.save(str(folder / "iter_0000001" / "mp_rank_01" / mcore.FILE), obj)
    return str(folder)


def _mmlu(t, text, name="x_test.csv"):
    _write(t, f"mmlu/test/{name}", text)
    return str(t / "mmlu")


def _convert(load_type, save_type, load, save, *flags):
    return ["convert", "--load-model-type", load_type, "--save-model-type", save_type, "--load-dir", str(load),
            "--save-dir", str(save), *flags]


def _gen(m, *flags):
    return ["generate", "--load", str(m / "ckpt"), *flags]


def _eval(m, t, task, path, *flags):
    short = ["--max-new-tokens", "4"] if task == "gsm8k" else []  # the model has 32 positions
    return ["evaluate", "--load", str(m / "ckpt"), "--task", task, "--task-data-path", path, *short,
            "--results-file", str(t / "r.json"), *flags]


def _metrics(t, *records):
    return _records(t, records, "m.jsonl")


GOOD_METRIC = {"iteration": 1, "loss": 2.0}

# (id, builder(tmp, made, corpus) -> argv, a fragment the one line must hold)
CASES = [
    # ---- preprocess: instruction handlers ---------------------------------------------------
    ("alpaca-not-object", lambda t, m, c: _pre(t, ["[1]"], *ALPACA), "not an object"),
    ("alpaca-no-instruction", lambda t, m, c: _pre(t, [{"output": "x"}], *ALPACA), "the instruction"),
    ("alpaca-number-output", lambda t, m, c: _pre(t, [{"instruction": "a", "output": 5}], *ALPACA), "int, not text"),
    ("alpaca-history-not-list", lambda t, m, c: _pre(t, [{**GOOD_ALPACA, "history": "x"}], *ALPACA),
     "history must be a list"),
    ("alpaca-history-turn", lambda t, m, c: _pre(t, [{**GOOD_ALPACA, "history": [["only one"]]}], *ALPACA),
     "history turn 0"),
    ("alpaca-surrogate", lambda t, m, c: _pre(t, ['{"instruction": "a\\ud800", "output": "b"}'], *ALPACA),
     "lone surrogate"),
    # past the 128 records under which no worker pool is started: the bad one is met in a worker
    ("alpaca-surrogate-workers", lambda t, m, c: _pre(t, [GOOD_ALPACA] * 130 + ['{"instruction": "x", "output": '
                                                                                 '"\\udc00"}'], *ALPACA,
                                                      "--workers", "2"), "in.jsonl:131"),
    ("alpaca-binary", lambda t, m, c: _pre(t, None, *ALPACA, raw=b'{"instruction": "a", "output": "\xff"}\n'),
     "not UTF-8"),
    ("alpaca-map-keys-list", lambda t, m, c: _pre(t, [GOOD_ALPACA], *ALPACA, "--map-keys", '{"prompt": ["a"]}'),
     "maps to a JSON list"),
    ("alpaca-map-keys-object", lambda t, m, c: _pre(t, [GOOD_ALPACA], *ALPACA, "--map-keys", '{"prompt": {"a": 1}}'),
     "maps to a JSON dict"),
    ("alpaca-map-keys-unknown", lambda t, m, c: _pre(t, [GOOD_ALPACA], *ALPACA, "--map-keys", '{"bogus": "x"}'),
     "is not a column"),
    ("alpaca-map-keys-not-json", lambda t, m, c: _pre(t, [GOOD_ALPACA], *ALPACA, "--map-keys", "{prompt"),
     "--map-keys is not JSON"),
    ("alpaca-map-keys-array", lambda t, m, c: _pre(t, [GOOD_ALPACA], *ALPACA, "--map-keys", "[1]"),
     "must be a JSON object"),
    ("alpaca-pack-no-seq", lambda t, m, c: _pre(t, [GOOD_ALPACA], *ALPACA, "--pack"), "--pack needs --seq-length"),
    ("alpaca-all-dropped", lambda t, m, c: _pre(t, [GOOD_ALPACA] * 2, *ALPACA, "--seq-length", "2"),
     "no sample of"),
    ("alpaca-empty-file", lambda t, m, c: _pre(t, [], *ALPACA), "holds no records"),
    ("sharegpt-system-only", lambda t, m, c: _pre(t, [{"conversations": [{"from": "system", "value": "Be nice."}]}],
                                                  *SHAREGPT), "only a system message"),
    ("sharegpt-empty", lambda t, m, c: _pre(t, [{"conversations": []}], *SHAREGPT), "non-empty list"),
    ("sharegpt-ends-user", lambda t, m, c: _pre(t, [{"conversations": [{"from": "human", "value": "hi"}]}],
                                                *SHAREGPT), "ends with the user's turn"),
    ("sharegpt-order", lambda t, m, c: _pre(t, [{"conversations": [{"from": "gpt", "value": "hi"},
                                                                   {"from": "human", "value": "x"}]}], *SHAREGPT),
     "message 0 is from 'gpt'"),
    ("sharegpt-message-not-object", lambda t, m, c: _pre(t, [{"conversations": ["hi", "there"]}], *SHAREGPT),
     "message 0 is not an object"),
    ("sharegpt-tags-numbers", lambda t, m, c: _pre(t, [{"conversations": []}], *SHAREGPT, "--map-keys",
                                                   '{"tags": {"user_tag": 1}}'), "tags takes"),
    ("sharegpt-content-null", lambda t, m, c: _pre(t, [{"conversations": [{"from": "human", "value": None},
                                                                          {"from": "gpt", "value": "x"}]}], *SHAREGPT),
     "missing, not text"),
    # ---- preprocess: preference pairs --------------------------------------------------------
    ("pairs-identical", lambda t, m, c: _pre(t, [{"instruction": "a", "chosen": "same", "rejected": "same"}],
                                             *ALPACA_PAIRS), "the same text"),
    ("pairs-no-rejected", lambda t, m, c: _pre(t, [{"instruction": "a", "chosen": "x"}], *ALPACA_PAIRS),
     "the rejected reply"),
    ("pairs-pack", lambda t, m, c: _pre(t, [{"instruction": "a", "chosen": "x", "rejected": "y"}], *ALPACA_PAIRS,
                                        "--pack", "--seq-length", "64"), "is not packed"),
    ("sharegpt-pairs-human-reply", lambda t, m, c: _pre(t, [{"conversations": [{"from": "human", "value": "q"}],
                                                             "chosen": {"from": "human", "value": "a"},
                                                             "rejected": {"from": "gpt", "value": "b"}}],
                                                        *SHAREGPT_PAIRS), "the chosen reply is from 'human'"),
    ("sharegpt-pairs-identical", lambda t, m, c: _pre(t, [{"conversations": [{"from": "human", "value": "q"}],
                                                           "chosen": {"from": "gpt", "value": "a"},
                                                           "rejected": {"from": "gpt", "value": "a"}}],
                                                      *SHAREGPT_PAIRS), "the same text"),
    ("sharegpt-pairs-ends-assistant", lambda t, m, c: _pre(t, [{"conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "chosen": "x", "rejected": "y"}],
        *SHAREGPT_PAIRS), "ends with the user's turn"),
    # ---- preprocess: process reward ----------------------------------------------------------
    ("prm-no-steps", lambda t, m, c: _pre(t, [{"input": "no placeholder", "value": []}], *PRM),
     "no step ends with the placeholder"),
    ("prm-count", lambda t, m, c: _pre(t, [{"input": "a @ b @", "value": ["+"]}], *PRM), "2 steps end"),
    ("prm-value-not-list", lambda t, m, c: _pre(t, [{"input": "a @", "value": "+"}], *PRM),
     "must be a list of step labels"),
    ("prm-label-unknown", lambda t, m, c: _pre(t, [{"input": "a @", "value": ["?"]}], *PRM),
     "is not one of --reward-tokens"),
    ("prm-multi-token-label", lambda t, m, c: _pre(t, [{"input": "a @", "value": ["good"]}],
                                                   "--handler-name", "AlpacaStyleProcessRewardHandler",
                                                   "--placeholder-token", "@"), "in.jsonl:1: the step label"),
    ("prm-map-keys-unknown", lambda t, m, c: _pre(t, [{"input": "a @", "value": ["+"]}], *PRM, "--map-keys",
                                                  '{"solution": "x"}'), "not a column of process-reward data"),
    ("prm-placeholder-two-tokens", lambda t, m, c: _pre(t, [{"input": "a", "value": []}],
                                                        "--handler-name", "AlpacaStyleProcessRewardHandler",
                                                        "--placeholder-token", "two tokens"), "--placeholder-token"),
    ("pre-missing-input", lambda t, m, c: ["preprocess", "--input", str(t / "none.jsonl"), "--output-prefix",
                                           str(t / "o")], "does not exist"),
    ("pre-unknown-handler", lambda t, m, c: _pre(t, [GOOD_ALPACA], "--handler-name", "Nope"), "invalid choice"),
    # ---- train, per stage --------------------------------------------------------------------
    ("train-dpo-no-data", lambda t, m, c: ["train", *MODEL, "--stage", "dpo"], "preference data: give --data-path"),
    ("train-prm-no-data", lambda t, m, c: ["train", *MODEL, "--stage", "prm"], "step-labelled data"),
    ("train-dpo-pretrain-data", lambda t, m, c: ["train", *MODEL, "--stage", "dpo", "--data-path", c],
     "is the --output-prefix"),
    ("train-prm-no-reward-tokens", lambda t, m, c: ["train", *MODEL, "--stage", "prm", "--data-path",
                                                    str(m / "steps")], "--stage prm needs --reward-tokens"),
    ("train-prm-wrong-tokens-save", lambda t, m, c: ["train", *MODEL, "--stage", "prm", "--data-path",
                                                     str(m / "steps"), "--reward-tokens", "+", "x", "--save",
                                                     str(t / "s" / "new")], "not one of --reward-tokens"),
    ("train-dpo-cp", lambda t, m, c: ["train", *MODEL, "--stage", "dpo", "--context-parallel-size", "2"],
     "alignment-context-parallel"),
    ("train-simpo-compile", lambda t, m, c: ["train", *MODEL, "--stage", "simpo", "--compile"], "compile-alignment"),
    ("train-moe-cp-compile", lambda t, m, c: ["train", *MODEL, "--num-experts", "4", "--context-parallel-size", "2",
                                             "--compile"], "moe-compile-routing"),
    ("train-lora-mla-qkv", lambda t, m, c: ["train", *MODEL, "--multi-latent-attention", "--lora-r", "4"],
     "lora-latent-attention-qkv"),
    # MindSpeed-LLM's minimax_spec: --q-lora-rank is its query norm's width; a TP size copying key heads
    ("train-minimax-norm-width", lambda t, m, c: ["train", *MODEL, "--num-query-groups", "2", "--spec",
                                                  "mindspeed_llm.tasks.models.spec.minimax_spec", "layer_spec",
                                                  "--qk-layernorm", "--num-experts", "4", "--q-lora-rank", "7"],
     "it is the width of the query norm, 4 heads x 8 = 32"),
    ("train-minimax-tp-copies", lambda t, m, c: ["train", *MODEL, "--num-query-groups", "2", "--spec",
                                                 "mindspeed_llm.tasks.models.spec.minimax_spec", "layer_spec",
                                                 "--qk-layernorm", "--num-experts", "4",
                                                 "--tensor-model-parallel-size", "4"], "copies the 2 key heads"),
    ("train-per-token-compile", lambda t, m, c: ["train", *MODEL, "--data-path", c, "--compile",
                                                 "--calculate-per-token-loss"],
     "--calculate-per-token-loss averages the language model's loss"),
    ("train-sparsemixer-compile", lambda t, m, c: ["train", *MODEL, "--num-experts", "4",
                                                   "--moe-router-load-balancing-type", "sparsemixer_topk", "--compile"],
     "moe-compile-routing"),
    ("train-lora-r-huge", lambda t, m, c: ["train", *MODEL, "--data-path", c, "--lora-r", "1000"],
     "exceeds the hidden size"),
    ("train-lora-load-missing", lambda t, m, c: ["train", *SMALL, "--data-path", c, "--load", str(m / "ckpt"),
                                                 "--lora-r", "4", "--lora-load", str(t / "missing")],
     "--lora-load"),
    ("train-lora-load-no-base", lambda t, m, c: ["train", *MODEL, "--data-path", c, "--lora-r", "4", "--lora-load",
                                                 str(m / "ckpt")], "give the base model"),
    ("train-load-iterations-no-tracker", lambda t, m, c: [
        "train", *SMALL, "--data-path", c, "--load",
        str(shutil.copytree(m / "ckpt" / "iter_0000001", t / "half" / "iter_0000001").parent)],
     "holds iteration folders but no"),
    # the default save folder (no data flags, no --save) is guarded as a --save given
    ("train-default-save-held", lambda t, m, c: _holding(m, t, "checkpoints/tiny-llama", "train", "--train-iters",
                                                         "1", "--no-progress"),
     "the default save folder checkpoints/tiny-llama already holds another run's checkpoints"),
    ("train-load-file", lambda t, m, c: ["train", *SMALL, "--data-path", c, "--load", _write(t, "x.txt", "x")],
     "is a file"),
    ("train-finetune-no-load", lambda t, m, c: ["train", *MODEL, "--data-path", c, "--finetune"],
     "--finetune takes the weights"),
    # (refused as exclusive, or first by the matrix where the device has neither: MindSpore's CPU)
    ("train-bf16-fp16", lambda t, m, c: ["train", *MODEL, "--data-path", c, "--bf16", "--fp16"], "--bf16"),
    ("train-o2-no-bf16", lambda t, m, c: ["train", *MODEL, "--data-path", c, "--o2-optimizer"], "--o2-optimizer"),
    ("train-reuse-fp32", lambda t, m, c: ["train", *MODEL, "--data-path", c, "--reuse-fp32-param"],
     "--reuse-fp32-param"),
    ("train-rope-no-type", lambda t, m, c: ["train", *MODEL, "--data-path", c, "--rope-scaling-factor", "2"],
     "needs --rope-scaling-type"),
    ("train-unknown-preset", lambda t, m, c: ["train", "--model-name", "gpt-9", "--data-path", c], "unknown --model-name"),
    ("train-noop-load-hf", lambda t, m, c: ["train", *MODEL, "--data-path", c, "--load-hf", str(m / "hf"),
                                            "--noop-layers", "7"], "--noop-layers 7: layer numbers must be distinct"),
    ("train-global-batch", lambda t, m, c: ["train", *MODEL, "--data-path", c, "--global-batch-size", "3"],
     "is not a multiple"),
    ("train-load-hf-edited", lambda t, m, c: ["train", "--seq-length", "32", "--eval-iters", "0", "--data-path",
                                              c, "--load-hf", _edit_hf(m, t, intermediate_size=99)],
     "does not belong to these weights"),
    ("train-load-hf-flag-disagrees", lambda t, m, c: ["train", *MODEL, "--data-path", c, "--load-hf", str(m / "hf")],
     "--hidden-size 32 disagrees with the Hugging Face folder's config.json"),
    # a user's reward function that raises: named in one line, the checkpoint it resumed kept
    ("train-grpo-reward-raises", lambda t, m, c: _grpo_resuming(m, t, "grpo_rewards:boom"),
     "reward function grpo_rewards:boom raised RuntimeError: boom"),
    # ---- generate ---------------------------------------------------------------------------
    ("gen-no-model", lambda t, m, c: ["generate", "--prompt", "x"], "--load CHECKPOINT_DIR or --load-hf"),
    ("gen-load-missing", lambda t, m, c: ["generate", "--load", str(t / "nope"), "--prompt", "x"], "does not exist"),
    ("gen-load-file", lambda t, m, c: ["generate", "--load", _write(t, "x.txt", "x"), "--prompt", "x"], "is a file"),
    ("gen-load-empty", lambda t, m, c: ["generate", "--load", str(t), "--prompt", "x"], "no checkpoint in"),
    ("gen-prompt-not-utf8", lambda t, m, c: _gen(m, "--prompt", "\udcff\udcfe"), "is not UTF-8"),
    ("gen-prompt-file-binary", lambda t, m, c: _gen(m, "--prompt-file", _write(t, "p.txt", b"ok\n\xff\xfe\n")),
     "p.txt:2 is not UTF-8"),
    ("gen-prompt-file-missing", lambda t, m, c: _gen(m, "--prompt-file", str(t / "none.txt")), "--prompt-file"),
    ("gen-prompt-file-folder", lambda t, m, c: _gen(m, "--prompt-file", str(t)), "is a folder"),
    ("gen-prompt-empty", lambda t, m, c: _gen(m, "--prompt", " "), "an empty prompt"),
    ("gen-prompt-file-blank", lambda t, m, c: _gen(m, "--prompt-file", _write(t, "b.txt", "\n  \n")),
     "b.txt holds no prompt"),
    ("gen-beams-past-vocab", lambda t, m, c: _gen(m, "--prompt", "x", "--task", "beam_search", "--num-beams", "99999"),
     "--num-beams 99999 is more than the model's"),
    ("gen-task-evaluation", lambda t, m, c: _gen(m, "--prompt", "x", "--task", "greedy", "mmlu"),
     "--task mmlu is an evaluation"),
    ("gen-length-penalty-nan", lambda t, m, c: _gen(m, "--prompt", "x", "--length-penalty", "nan"),
     "--length-penalty"),
    ("gen-temperature-nan", lambda t, m, c: _gen(m, "--prompt", "x", "--temperature", "nan"), "--temperature"),
    ("gen-temperature-zero", lambda t, m, c: _gen(m, "--prompt", "x", "--temperature", "0"), "--temperature"),
    ("gen-top-p", lambda t, m, c: _gen(m, "--prompt", "x", "--top-p", "2"), "--top-p"),
    ("gen-top-k-negative", lambda t, m, c: _gen(m, "--prompt", "x", "--top-k", "-1"), "--top-k"),
    ("gen-beams-zero", lambda t, m, c: _gen(m, "--prompt", "x", "--num-beams", "0"), "--num-beams"),
    ("gen-too-long", lambda t, m, c: _gen(m, "--prompt", "x", "--max-new-tokens", "1000"), "passes the model's"),
    ("gen-pipeline-one-process", lambda t, m, c: _gen(m, "--prompt", "x", "--pipeline-model-parallel-size", "2"),
     "--pipeline-model-parallel-size 2 needs 2 ranks: start it with `mindspeed launch --nproc-per-node 2"),
    ("gen-pipeline-past-layers", lambda t, m, c: _gen(m, "--prompt", "x", "--pipeline-model-parallel-size", "4"),
     "pipeline parallel size 4 does not divide the 2 layers"),
    ("gen-context-parallel", lambda t, m, c: _gen(m, "--prompt", "x", "--context-parallel-size", "2"),
     "tensor, pipeline and expert parallelism only: drop --context-parallel-size"),
    ("gen-evaluation-task", lambda t, m, c: _gen(m, "--prompt", "x", "--task", "mmlu"), "is an evaluation"),
    ("gen-meta-negative-hidden", lambda t, m, c: ["generate", "--load", _edit_meta(m, t, hidden_size=-32), "--prompt",
                                                  "x"], "hidden_size must be a positive integer"),
    ("gen-meta-string-heads", lambda t, m, c: ["generate", "--load", _edit_meta(m, t, num_attention_heads="2"),
                                               "--prompt", "x"], "num_attention_heads"),
    ("gen-meta-bogus-family", lambda t, m, c: ["generate", "--load", _edit_meta(m, t, family="bogus"), "--prompt",
                                               "x"], "family must be one of"),
    ("gen-meta-huge-vocab", lambda t, m, c: ["generate", "--load", _edit_meta(m, t, vocab_size=10 ** 12), "--prompt",
                                             "x"], "GiB available"),
    ("gen-meta-float-vocab", lambda t, m, c: ["generate", "--load", _edit_meta(m, t, vocab_size=1e12), "--prompt",
                                              "x"], "vocab_size"),
    ("gen-meta-other-mlp", lambda t, m, c: ["generate", "--load", _edit_meta(m, t, ffn_hidden_size=64), "--prompt",
                                            "x"], "does not belong to these weights"),
    ("gen-megatron-no-tokenizer", lambda t, m, c: ["generate", "--load", str(m / "mg1"), "--prompt", "x"],
     "give its tokenizer"),
    ("gen-hf-edited", lambda t, m, c: ["generate", "--load-hf", _edit_hf(m, t, intermediate_size=99), "--prompt", "x",
                                       "--tokenizer-type", "ByteLevel"], "does not belong to these weights"),
    # ---- chat -------------------------------------------------------------------------------
    ("chat-with-prompt", lambda t, m, c: _gen(m, "--task", "chat", "--prompt", "x"), "reads its messages"),
    ("chat-tensor-parallel", lambda t, m, c: _gen(m, "--task", "chat", "--tensor-model-parallel-size", "2"),
     "runs in one process"),
    ("chat-pipeline", lambda t, m, c: _gen(m, "--task", "chat", "--pipeline-model-parallel-size", "2"),
     "--task chat runs in one process: drop --pipeline-model-parallel-size"),
    ("chat-unknown-template", lambda t, m, c: _gen(m, "--task", "chat", "--prompt-type", "nope"), "nope"),
    ("chat-history-negative", lambda t, m, c: _gen(m, "--task", "chat", "--history-turns", "-1"), "--history-turns"),
    # ---- evaluate ---------------------------------------------------------------------------
    ("eval-no-task", lambda t, m, c: ["evaluate", "--load", str(m / "ckpt"), "--task-data-path", str(t)],
     "--task: choose one of"),
    ("eval-two-tasks", lambda t, m, c: _eval(m, t, "mmlu", str(t))[:5] + ["gsm8k"] + _eval(m, t, "mmlu", str(t))[5:],
     "--task mmlu gsm8k: evaluate runs one task at a time"),
    ("eval-no-data", lambda t, m, c: ["evaluate", "--load", str(m / "ckpt"), "--task", "mmlu"],
     "needs --task-data-path"),
    ("eval-tensor-parallel", lambda t, m, c: _eval(m, t, "mmlu", str(t), "--tensor-model-parallel-size", "2"),
     "needs 2 ranks: start it with `mindspeed launch --nproc-per-node 2"),
    ("eval-results-folder", lambda t, m, c: _eval(m, t, "perplexity", _write(t, "a.txt", "text"))[:-1] + [str(t)],
     "is a folder"),
    ("eval-results-unwritable", lambda t, m, c: _eval(m, t, "perplexity", _write(t, "a.txt", "text"))[:-1]
     + ["/proc/none/r.json"], "not writable"),
    ("eval-mmlu-empty", lambda t, m, c: _eval(m, t, "mmlu", _mmlu(t, "")), "holds no questions"),
    ("eval-mmlu-binary", lambda t, m, c: _eval(m, t, "mmlu", _mmlu(t, b"q,a,b,c,d,A\n\x00\xff\xfe\n")),
     "x_test.csv:2 is not UTF-8"),
    ("eval-mmlu-latin1", lambda t, m, c: _eval(m, t, "mmlu", _mmlu(t, "caf\xe9,a,b,c,d,A\n".encode("latin-1"))),
     "x_test.csv:1 is not UTF-8"),
    ("eval-mmlu-answer", lambda t, m, c: _eval(m, t, "mmlu", _mmlu(t, "q,a,b,c,d,E\n")), "the answer must be one of"),
    ("eval-mmlu-columns", lambda t, m, c: _eval(m, t, "mmlu", _mmlu(t, "q,a,b\n")), "has 6 columns"),
    ("eval-mmlu-no-files", lambda t, m, c: _eval(m, t, "mmlu", str(t)), "no *_test.csv"),
    ("eval-mmlu-shot-no-dev", lambda t, m, c: _eval(m, t, "mmlu", _mmlu(t, "q,a,b,c,d,A\n"), "--shot", "1"),
     "needs the dev split"),
    ("eval-ceval-columns", lambda t, m, c: _eval(m, t, "ceval", _write(t, "ce/val/x_val.csv", "q,A\n1,2\n").rsplit(
        "/val/", 1)[0]), "needs the columns"),
    ("eval-gsm8k-number", lambda t, m, c: _eval(m, t, "gsm8k", _records(t, [{"question": "1+1?", "answer": 2}],
                                                                         "test.jsonl")), "'answer' is a JSON int"),
    ("eval-gsm8k-no-number", lambda t, m, c: _eval(m, t, "gsm8k", _records(t, [{"question": "1+1?", "answer": "2"}],
                                                                            "test.jsonl")), "does not end with"),
    ("eval-gsm8k-not-json", lambda t, m, c: _eval(m, t, "gsm8k", _records(t, ["{oops"], "test.jsonl")), "not JSON"),
    ("eval-gsm8k-binary", lambda t, m, c: _eval(m, t, "gsm8k", _write(t, "test.jsonl", b'{"question": "\xff"}\n')),
     "test.jsonl:1 is not UTF-8"),
    ("eval-boolq-keys", lambda t, m, c: _eval(m, t, "boolq", _records(t, [{"question": "q"}], "dev.jsonl")),
     "needs the keys"),
    ("eval-boolq-answer", lambda t, m, c: _eval(m, t, "boolq", _records(t, [{"question": "q", "passage": "p",
                                                                              "answer": "maybe"}], "dev.jsonl")),
     "a BoolQ answer is true/false"),
    ("eval-ppl-binary", lambda t, m, c: _eval(m, t, "perplexity", _write(t, "b.txt", b"abc\n\xff\xfe\x00")),
     "b.txt:2 is not UTF-8"),
    ("eval-ppl-number-text", lambda t, m, c: _eval(m, t, "perplexity", _records(t, [{"text": 7}], "p.jsonl")),
     "'text' is a JSON int"),
    ("eval-ppl-missing", lambda t, m, c: _eval(m, t, "perplexity", str(t / "none")), "no such file or folder"),
    ("eval-ppl-empty-folder", lambda t, m, c: _eval(m, t, "perplexity", str((t / "empty").mkdir() or t / "empty")),
     "no .txt or .jsonl files"),
    ("eval-unknown-task", lambda t, m, c: _eval(m, t, "greedy", str(t)), "generation tasks run with"),
    # ---- convert -----------------------------------------------------------------------------
    ("conv-hf-hf", lambda t, m, c: _convert("hf", "hf", m / "hf", t / "o"), "converts nothing"),
    ("conv-same-folder", lambda t, m, c: _convert("mg", "mg", m / "ckpt", m / "ckpt"), "is --load-dir"),
    ("conv-save-not-empty", lambda t, m, c: _convert("mg", "hf", m / "ckpt", (_write(t, "o/x", "x"), t / "o")[1]),
     "is not empty"),
    ("conv-load-missing", lambda t, m, c: _convert("mg", "hf", t / "none", t / "o"), "does not exist"),
    ("conv-load-empty", lambda t, m, c: _convert("mg", "hf", (t / "e").mkdir() or t / "e", t / "o"), "holds neither"),
    ("conv-hf-edited", lambda t, m, c: _convert("hf", "mg", _edit_hf(m, t, intermediate_size=99), t / "o"),
     "does not belong to these weights"),
    ("conv-hf-layers-edited", lambda t, m, c: _convert("hf", "mg", _edit_hf(m, t, num_hidden_layers=1), t / "o"),
     "does not belong to these weights"),
    ("conv-mg-other-iteration", lambda t, m, c: _convert("mg", "hf", _mixed_ranks(m, t, "mg2"), t / "o"),
     "come from different saves"),
    ("conv-mg-other-model", lambda t, m, c: _convert("mg", "hf", _mixed_ranks(m, t, "mgwide"), t / "o"),
     "describe another model"),
    ("conv-mg-rank-int", lambda t, m, c: _convert("mg", "hf", _rank_pickle(m, t, 5), t / "o"),
     "is not a Megatron checkpoint"),
    ("conv-mg-rank-model-int", lambda t, m, c: _convert(
        "mg", "hf", _rank_pickle(m, t, {**torch_pickle.load(str(m / "mg1" / "iter_0000001" / "mp_rank_00" / mcore.FILE)),
                                        "model": 5}), t / "o"), "not a dict of tensors"),
    ("conv-ours-edited", lambda t, m, c: _convert("mg", "hf", _edit_meta(m, t, family="bogus"), t / "o"),
     "family must be one of"),
    # refused after the source is read, when only the export can tell: no --save-dir left behind
    ("conv-hf-no-architecture", lambda t, m, c: _convert("mg", "hf", _edit_meta(m, t, scale_emb=12.0), t / "new"),
     "no scale_emb setting in transformers"),
    ("conv-ours-other-mlp", lambda t, m, c: _convert("mg", "mg", _edit_meta(m, t, ffn_hidden_size=64), t / "o"),
     "does not belong to these weights"),
    # MindSpeed-LLM's exports name the no-op layers again: they must be the checkpoint's
    ("conv-hf-other-noop", lambda t, m, c: _convert("mg", "hf", m / "ckpt", t / "o", "--noop-layers", "0"),
     "holds no-op layers none"),
    ("conv-model-type", lambda t, m, c: _convert("mg", "hf", m / "ckpt", t / "o", "--model-type-hf", "qwen2"),
     "--model-type-hf qwen2, but"),
    # a model without DeepSeek's latent attention (the tiny-deepseek-v3 preset's routing on GQA) says what exports
    ("conv-deepseek-without-mla", lambda t, m, c: _convert("mg", "hf", m / "ckpt", t / "o", "--model-type-hf",
                                                           "deepseek3"), "is multi-latent attention, which this model"),
    ("conv-noop-mg", lambda t, m, c: _convert("mg", "mg", m / "ckpt", t / "o", "--noop-layers", "0"),
     "--noop-layers adds no-op layers"),
    ("conv-tp-heads", lambda t, m, c: _convert("mg", "mg", m / "ckpt", t / "o", "--target-tensor-parallel-size",
                                               "3"), "3"),
    ("conv-dtype", lambda t, m, c: _convert("mg", "mg", m / "ckpt", t / "o", "--params-dtype", "fp8"),
     "invalid choice"),
    # ---- plot --------------------------------------------------------------------------------
    ("plot-missing", lambda t, m, c: ["plot", str(t / "none.jsonl"), "-o", str(t / "c.png")], "no such metrics file"),
    ("plot-not-json", lambda t, m, c: ["plot", _metrics(t, "{x"), "-o", str(t / "c.png")], "not a JSON line"),
    ("plot-iteration-text", lambda t, m, c: ["plot", _metrics(t, GOOD_METRIC, {"iteration": "x", "loss": 1.0}), "-o",
                                             str(t / "c.png")], "the iteration is 'x'"),
    ("plot-iteration-null", lambda t, m, c: ["plot", _metrics(t, {"iteration": None, "loss": 1.0}), "-o",
                                             str(t / "c.png")], "the iteration is None"),
    ("plot-no-loss", lambda t, m, c: ["plot", _metrics(t, {"iteration": 1}), "-o", str(t / "c.png")],
     "no training losses"),
    ("plot-output-folder", lambda t, m, c: ["plot", _metrics(t, GOOD_METRIC), "-o",
                                            str((t / "d.png").mkdir() or t / "d.png")], "is a folder"),
    ("plot-output-not-png", lambda t, m, c: ["plot", _metrics(t, GOOD_METRIC), "-o", str(t / "c.jpg")],
     "name it *.png"),
    ("plot-output-unwritable", lambda t, m, c: ["plot", _metrics(t, GOOD_METRIC), "-o", "/proc/none/c.png"],
     "not writable"),
    ("plot-labels", lambda t, m, c: ["plot", _metrics(t, GOOD_METRIC), "-o", str(t / "c.png"), "--labels", "a", "b"],
     "--labels gives 2 names for 1 runs"),
    ("plot-title-formula", lambda t, m, c: ["plot", _metrics(t, GOOD_METRIC), "-o", str(t / "c.png"), "--title",
                                            "cost $\\bogus{1}$"], "starts a formula"),
    ("plot-label-formula", lambda t, m, c: ["plot", _metrics(t, GOOD_METRIC), "-o", str(t / "c.png"), "--labels",
                                            "$\\bogus{x}$"], "starts a formula"),
    # ---- plan --------------------------------------------------------------------------------
    ("plan-devices-huge", lambda t, m, c: ["plan", *PLAN_MODEL, "--devices", "1000000000", "--memory-per-device", "4"],
     "uses that many devices"),
    ("plan-no-batch", lambda t, m, c: ["plan", *[a for a in PLAN_MODEL if a not in ("--global-batch-size", "8")],
                                       "--devices", "2", "--memory-per-device", "4"], "give --seq-length and"),
    ("plan-tiny-memory", lambda t, m, c: ["plan", *PLAN_MODEL, "--devices", "2", "--memory-per-device", "0.01"],
     "no layout fits"),
    ("plan-devices-zero", lambda t, m, c: ["plan", *PLAN_MODEL, "--devices", "0", "--memory-per-device", "4"],
     "--devices"),
    ("plan-no-devices", lambda t, m, c: ["plan", *PLAN_MODEL, "--memory-per-device", "4"], "--devices"),
    ("plan-headroom", lambda t, m, c: ["plan", *PLAN_MODEL, "--devices", "2", "--memory-per-device", "4",
                                       "--memory-headroom", "1.5"], "--memory-headroom"),
    ("plan-no-layout", lambda t, m, c: ["plan", *PLAN_MODEL, "--devices", "7", "--memory-per-device", "4"],
     "no layout of 7 devices"),
    # ---- launch ------------------------------------------------------------------------------
    ("launch-bad-host", lambda t, m, c: ["launch", "--nproc-per-node", "2", "--master-addr", "not a host!!", "--",
                                         *MODEL, "--data-path", c], "neither an address nor a host name"),
    ("launch-node-rank", lambda t, m, c: ["launch", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2",
                                          "--", *MODEL], "must be below --nnodes"),
    ("launch-frameworks", lambda t, m, c: ["launch", "--nproc-per-node", "1", "--ai-framework", "pytorch", "--",
                                           "--ai-framework", "mindspore", *MODEL], "disagree"),
    ("launch-bad-flag", lambda t, m, c: ["launch", "--nproc-per-node", "1", "--", "--no-such-flag"], "unrecognized"),
    ("launch-nproc-zero", lambda t, m, c: ["launch", "--nproc-per-node", "0", "--", *MODEL], "--nproc-per-node"),
    # experts whole on each TP rank with EP: megatron-core's layout across TP needs SP and EP dividing TP x CP x DP
    ("launch-ep-over-tp-no-sp", lambda t, m, c: ["launch", "--nproc-per-node", "2", "--", *MODEL,
                                                 "--tensor-model-parallel-size", "2", "--num-experts", "4",
                                                 "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
                                                 "1"], "add --sequence-parallel"),
    ("launch-ep-over-tp-too-wide", lambda t, m, c: ["launch", "--nproc-per-node", "2", "--", *MODEL,
                                                    "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                    "--num-experts", "8", "--expert-model-parallel-size", "4",
                                                    "--expert-tensor-parallel-size", "1"],
     "does not divide tensor x context x data parallel sizes"),
    ("launch-port", lambda t, m, c: ["launch", "--nproc-per-node", "1", "--master-port", "70000", "--", *MODEL],
     "--master-port"),
    ("launch-generate-bad-flag", lambda t, m, c: ["launch", "--nproc-per-node", "1", "--", "generate", "--top-p",
                                                  "7"], "--top-p"),
    ("launch-gated", lambda t, m, c: ["launch", "--nproc-per-node", "1", "--", *MODEL, "--data-path", c, "--compile",
                                      "--recompute-activations"], "compile-recompute"),
    ("launch-bad-config", lambda t, m, c: ["launch", "--nproc-per-node", "2", "--", *MODEL, "--data-path", c,
                                           "--tensor-model-parallel-size", "3"], "3"),
    # ---- the matrix commands -----------------------------------------------------------------
    ("check-args-unknown", lambda t, m, c: ["check-args", "--no-such-flag"], "unrecognized"),
    ("check-args-combination", lambda t, m, c: ["check-args", "--num-experts", "4", "--compile",
                                                "--pipeline-model-parallel-size", "2"], "moe-compile-routing"),
    ("check-args-config", lambda t, m, c: ["check-args", *MODEL, "--data-path", c, "--num-query-groups", "3"],
     "query groups"),
    ("features-device", lambda t, m, c: ["features", "--device", "tpu"], "tpu"),
    ("features-format", lambda t, m, c: ["features", "--format", "pdf"], "invalid choice"),
    ("info-device", lambda t, m, c: ["info", "--device", "tpu"], "tpu"),
    ("unknown-verb-flag", lambda t, m, c: ["info", "--no-such-flag"], "unrecognized"),
]


@pytest.mark.parametrize("case, build, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_on_every_verb(capsys, monkeypatch, corpus, made, tmp_path, case, build, fragment):  # noqa: F811
    (tmp_path / "f").write_text("a file where a folder would go")
    monkeypatch.chdir(tmp_path)  # a verb's default output (e.g. <task>_results.json) would land here
    monkeypatch.setattr("sys.stdin", io.StringIO("def f(\n/exit\n"))
    assert_refused_in_one_line(capsys, tmp_path, build(tmp_path, made, corpus), fragment)


def test_the_table_covers_every_verb():
    from test_bad_input import CASES as PRETRAINING

    assert len(CASES) + len(PRETRAINING) >= 150
    kinds = {case.split("-")[0] for case, _, _ in CASES}
    assert {"alpaca", "sharegpt", "pairs", "prm", "pre", "train", "gen", "chat", "eval", "conv", "plot", "plan",
            "launch", "check", "features", "info"} <= kinds, kinds
