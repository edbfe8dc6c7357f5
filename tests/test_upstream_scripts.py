"""MindSpeed-LLM's own example scripts for the families built here (llama2, qwen25, qwen3,
qwen3_moe, phi35, gemma2) and DeepSeek's (deepseek3, deepseek2_lite: their multi-latent attention
is a planned row): tests/data/upstream_scripts.json, their python lines' flags, made by
tests/data/extract_upstream_flags.py, through the matching entry point. No flag may be
unknown, and each call ends in "ok" or in one line naming the matrix row that refuses it here:

- pretrain_gpt.py / posttrain_gpt.py: the gate (on the script's Ascend device and on this
  host) and the run's whole configuration (training/configuration.py), with stand-in paths: a
  tokenizer folder, and for --enable-hf2mg-convert a Hugging Face folder whose config.json
  describes the script's model;
- preprocess_data.py: a real run on a few records of the handler's shape;
- inference.py, evaluation.py, convert_ckpt*.py: their parsers and the gate.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import re

import pytest

from mindspeed_core import cli, features, runtime
from mindspeed_core.compat import hf, megatron_args
from mindspeed_core.errors import FeatureNotAvailable, MindSpeedError
from mindspeed_core.training import configuration

ROOT = pathlib.Path(__file__).resolve().parents[1]
CALLS = json.loads((pathlib.Path(__file__).parent / "data" / "upstream_scripts.json").read_text())
PATH_FLAGS = ("--data-path", "--load", "--save", "--tokenizer-name-or-path", "--tokenizer-model", "--input",
              "--output-prefix", "--load-dir", "--save-dir", "--lora-load", "--hf-cfg-dir", "--task-data-path")
ROWS = re.compile(r"\b(" + "|".join(re.escape(f.id) for f in features.FEATURES) + r") \(")


def _parser(entry: str):
    return {"pretrain_gpt.py": megatron_args.training_parser, "posttrain_gpt.py": megatron_args.training_parser,
            "preprocess_data.py": cli._preprocess_parser, "convert_ckpt.py": cli.convert.parser,
            "convert_ckpt_v2.py": cli.convert.parser, "inference.py": cli.inference.parser,
            "evaluation.py": cli.evaluation.parser}[entry]()


def _stand_ins(flags: list, paths: dict) -> list:
    """The script's flags with each path (a value that may have been split at its spaces) replaced
    by a stand-in, and shell arithmetic the extractor could not expand replaced by a number."""
    out, i = [], 0
    while i < len(flags):
        flag = flags[i]
        out.append(flag)
        i += 1
        if flag in PATH_FLAGS:
            while i < len(flags) and not flags[i].startswith("--"):
                i += 1
            out.append(paths.get(flag, paths["default"]))
        elif i < len(flags) and flags[i].startswith("$(("):
            out.append("8")
            i += 1
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("upstream")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"] + [chr(c) for c in range(32, 127)]
    words += [f"<extra_{k}>" for k in range(128 - len(words))]  # 128: a vocabulary any script's TP divides
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    data = root / "data.jsonl"
    # a record of every handler's shape (the scripts' --map-keys name some of these columns)
    data.write_text("".join(json.dumps({"text": "a b c", "instruction": "add 1 2", "question": "add 1 2", "input": "",
                                        "output": "3", "chosen": "3", "rejected": "4"}) + "\n" for _ in range(4)))
    return {"default": str(root / "nowhere"), "--tokenizer-name-or-path": str(root / "tok"),
            "--tokenizer-model": str(root / "tok"), "--input": str(data), "root": root}


def _model_of(args):
    """The model configuration the script's flags describe (as if it started from scratch)."""
    plain = megatron_args.training_parser().parse_args([])
    for key, value in vars(args).items():
        setattr(plain, key, value)
    plain.enable_hf2mg_convert, plain.load, plain.model_type_hf, plain.finetune = False, None, None, False
    # the architecture only (this host may lack the script's precision, which these settings need)
    plain.bf16 = plain.fp16 = plain.reuse_fp32_param = plain.o2_optimizer = False
    return configuration.configure(plain, _world(args)).model


def _hf_folder(root: pathlib.Path, args) -> str:
    """A Hugging Face folder (config.json only) describing the model the script's flags describe
    (its real layers: the script adds its --noop-layers to the folder's)."""
    cfg, _ = hf.without_noop_layers(_model_of(args), {})
    if args.model_type_hf:  # the flags say how the layers are built; the folder's type says which family
        cfg = dataclasses.replace(cfg, family=hf.MODEL_TYPES[args.model_type_hf])
    folder = root / f"hf-{abs(hash(json.dumps(cfg.to_dict(), default=str)))}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf.hf_config(cfg)))
    return str(folder)


def _world(args) -> int:
    return (args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
            * args.expert_model_parallel_size)


def _outcome(call: dict, paths: dict, tmp_path) -> str:
    """"ok", "refused by <row>", or what went wrong (unknown flags, another error)."""
    flags = _stand_ins(call["flags"], {**paths, "--output-prefix": str(tmp_path / "out" / "data"),
                                       "--save-dir": str(tmp_path / "converted"), "--save": str(tmp_path / "save")})
    parser = _parser(call["entry"])
    try:
        args, unknown = parser.parse_known_args(flags)
        if unknown:
            return f"unknown flags {unknown}"
        backend = runtime.bound()
        if call["entry"] == "preprocess_data.py":
            cli._preprocess(args)
            return "ok"
        if call["entry"].startswith("convert_ckpt"):  # LoRA's conversions run in test_lora
            return "ok"
        for device in ("npu", backend.device.type()):  # the script's Ascend device, then this host
            features.validate(args, backend.NAME, device, backend.FRAMEWORK_VERSION)
        if call["entry"] in ("pretrain_gpt.py", "posttrain_gpt.py"):
            if args.enable_hf2mg_convert:
                args.load = _hf_folder(paths["root"], args)
            configuration.configure(args, _world(args))
        return "ok"
    except FeatureNotAvailable as exc:
        found = ROWS.search(str(exc))
        return f"refused by {found.group(1)}" if found else f"refused without a row: {exc}"
    except MindSpeedError as exc:
        found = ROWS.search(str(exc))
        return f"refused by {found.group(1)}" if found else f"error: {exc}"


# measured here: the calls that run as they are (the others wait for the rows they name: overlap,
# Ascend-only kernels, ...; on MindSpore's CPU also bfloat16, which most scripts
# ask for, and the fp32-reuse and swap rows)
RUN_AS_THEY_ARE = {"pytorch": 114, "mindspore": 56}


def test_every_upstream_script_call_is_accepted_or_refused_by_a_matrix_row(framework, paths, tmp_path, capsys):
    outcomes = {}
    for n, call in enumerate(CALLS):
        outcomes[f"{call['script']} ({call['entry']})"] = _outcome(call, paths, tmp_path / str(n))
    capsys.readouterr()
    assert len(CALLS) == 159
    wrong = {k: v for k, v in outcomes.items() if v != "ok" and not v.startswith("refused by ")}
    assert wrong == {}, "\n".join(f"{k}: {v}" for k, v in wrong.items())
    tally = collections.Counter(v if v == "ok" else "gated" for v in outcomes.values())
    by_row = collections.Counter(v[len("refused by "):] for v in outcomes.values() if v.startswith("refused by "))
    print(f"upstream calls: {dict(tally)}; refusals by row: {dict(by_row)}")
    assert tally["ok"] >= RUN_AS_THEY_ARE[framework], (tally, by_row)


@pytest.mark.multiprocess
def test_a_scripts_own_launch_line_trains(framework, paths, tmp_path):
    """The Qwen3-0.6B pre-training script's python line, with sizes, paths and the device count
    scaled down and no flag edited, under the framework's launcher (torchrun / msrun) on two ranks:
    it trains from a Hugging Face folder (--enable-hf2mg-convert), or, where this host cannot run a
    setting the script asks for (MindSpore's CPU has no bfloat16 matmul), stops in one line naming
    the matrix row."""
    from launch import launch

    root = paths["root"]
    call = next(c for c in CALLS if c["script"] == "qwen3/pretrain_qwen3_0point6b_4K_ptd.sh")
    scaled = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--kv-channels": "16",
              "--num-query-groups": "2", "--ffn-hidden-size": "128", "--padded-vocab-size": "128",
              "--max-position-embeddings": "256", "--seq-length": "32", "--micro-batch-size": "1",
              "--global-batch-size": "4", "--train-iters": "2", "--save-interval": "2"}
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": "def f(x): return x + 1 " * 4}) + "\n" for _ in range(40)))
    assert cli.main(["preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "enwiki"),
                     "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", paths["--tokenizer-name-or-path"],
                     "--append-eod"]) == 0
    flags, i = [], 0
    values = {**scaled, "--tokenizer-name-or-path": paths["--tokenizer-name-or-path"],
              "--data-path": str(tmp_path / "enwiki_text_document"), "--load": str(tmp_path / "qwen3_hf"),
              "--save": str(tmp_path / "run")}
    while i < len(call["flags"]):
        flag = call["flags"][i]
        flags.append(flag)
        i += 1
        if flag in values:
            while i < len(call["flags"]) and not call["flags"][i].startswith("--"):
                i += 1
            flags.append(values[flag])
    # the Hugging Face folder the script starts from: a model of the scaled sizes, exported
    from mindspeed_core import nn
    from mindspeed_core.models import registry

    cfg = _model_of(megatron_args.training_parser().parse_args(flags))
    hf.save_folder(str(tmp_path / "qwen3_hf"), cfg, nn.state_dict(registry.for_config(cfg).build(cfg)))
    code, out = launch(framework, 2, str(ROOT / "tools" / "pretrain_gpt.py"), flags, str(tmp_path / "logs"),
                       launcher=True)
    status = features.get("bf16").status(framework, runtime.bound().device.type())
    if status.kind in ("unsupported", "planned"):
        assert code != 0 and "bf16 (--bf16) is" in out, out[-3000:]
        return
    assert code == 0 and "iteration      2/2" in out and "saved checkpoint" in out, out[-3000:]
