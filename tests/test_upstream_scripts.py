"""MindSpeed-LLM's own example scripts for the families built here (llama2, qwen25, qwen3,
qwen3_moe, phi35, gemma2, deepseek3, deepseek2_lite, glm45, glm45-air, qwen3_next,
qwen3_coder_next, gated_deltanet, kimi2, seed_oss, magistral, minimax27, plm, deepseek32, glm5, glm52,
longcat, hunyuan3, ling_v2):
tests/data/upstream_scripts.json, their python lines' flags, made by
tests/data/extract_upstream_flags.py, through the matching entry point. No flag may be
unknown, and each call does what its entry point can do here or stops in one line naming the
matrix row that refuses it:

- pretrain_gpt.py / posttrain_gpt.py: the gate (on the script's Ascend device and on this
  host) and the run's whole configuration (training/configuration.py), with stand-in paths: a
  tokenizer folder, and for --enable-hf2mg-convert a Hugging Face folder whose config.json
  describes the script's model;
- preprocess_data.py: a real run on a few records of the handler's shape;
- convert_ckpt*.py: a real conversion of the family's stand-in folder (hf_reference.py), the
  script's layout scaled to it (LoRA's lines: their parsers; test_lora runs LoRA conversions);
- inference.py, evaluation.py: their parsers and the gate.

Beyond those: each family's first fine-tuning line (--stage sft) that configures here trains a
step after its own data-preprocessing line ran, and its first generation line that the gate
passes (a generate_* script's) runs MindSpeed-LLM's task set (chat included) on the fine-tuned checkpoint, or on a
checkpoint of its own model where the two lines describe different sizes: scaled to a tiny model
in one process (RUN_SCALE; every other flag as the script has it). The test reports per entry
point what its calls did.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import sys

import pytest

from mindspeed_core import cli, features, inference, runtime
from mindspeed_core.compat import hf, megatron_args
from mindspeed_core.errors import FeatureNotAvailable, MindSpeedError
from mindspeed_core.models import families
from mindspeed_core.training import configuration

ROOT = pathlib.Path(__file__).resolve().parents[1]
CALLS = json.loads((pathlib.Path(__file__).parent / "data" / "upstream_scripts.json").read_text())
PATH_FLAGS = ("--data-path", "--load", "--save", "--tokenizer-name-or-path", "--tokenizer-model", "--input",
              "--output-prefix", "--load-dir", "--save-dir", "--lora-load", "--hf-cfg-dir", "--hf-dir", "--task-data-path")
ROWS = re.compile(r"\b(" + "|".join(re.escape(f.id) for f in features.FEATURES) + r") \(")


def _parser(entry: str):
    return {"pretrain_gpt.py": megatron_args.training_parser, "posttrain_gpt.py": megatron_args.training_parser,
            "preprocess_data.py": cli._preprocess_parser, "convert_ckpt.py": cli.convert.parser,
            "convert_ckpt_v2.py": cli.convert.parser, "inference.py": cli.inference.parser,
            "evaluation.py": cli.evaluation.parser}[entry]()


def _groups(flags: list):
    """(flag, [its values]) of a script line in order: a value is every token up to the next
    --flag (the extractor splits a value, a path say, at its spaces)."""
    i = 0
    while i < len(flags):
        flag, i = flags[i], i + 1
        given = []
        while i < len(flags) and not flags[i].startswith("--"):
            given.append(flags[i])
            i += 1
        yield flag, given


def _stand_ins(flags: list, paths: dict) -> list:
    """The script's flags with each path replaced by a stand-in, and shell arithmetic the
    extractor could not expand replaced by a number."""
    out = []
    for flag, given in _groups(flags):
        if flag in PATH_FLAGS:
            given = [paths.get(flag, paths["default"])]
        elif given and given[0].startswith("$(("):
            given = ["8", *given[1:]]
        out += [flag, *given]
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
    # and Magistral's tekken.json beside it (--tokenizer-type MagistralTokenizer): byte tokens after 10 special ones
    (root / "tok" / "tekken.json").write_text(json.dumps({
        "config": {"pattern": r"\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]+", "default_vocab_size": 266,
                   "default_num_special_tokens": 10, "version": "v11"},
        "vocab": [{"rank": b, "token_bytes": base64.b64encode(bytes([b])).decode()} for b in range(256)],
        "special_tokens": [{"rank": i, "token_str": s} for i, s in enumerate(["<unk>", "<s>", "</s>"])]}))
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
    plain.enable_hf2mg_convert, plain.load, plain.save, plain.model_type_hf, plain.finetune = False, None, None, None, False
    plain.enable_mg2hf_convert, plain.hf_cfg_dir, plain.hf_save_dir = False, None, None
    plain.data_path = plain.data_path or ["corpus"]  # not the embedded run's defaults (its byte tokenizer)
    # the architecture only (this host may lack the script's precision, which these settings need)
    plain.bf16 = plain.fp16 = plain.reuse_fp32_param = plain.o2_optimizer = plain.o2_gradient = False
    plain.input_layernorm_in_fp32 = plain.init_norm_weight_in_fp32 = False
    return configuration.configure(plain, _world(args)).model


def _hf_folder(root: pathlib.Path, args) -> str:
    """A Hugging Face folder (config.json only) describing the model the script's flags describe
    (its real layers: the script adds its --noop-layers to the folder's)."""
    cfg = _family_model(args, args.model_type_hf)
    folder = root / f"hf-{abs(hash(json.dumps(cfg.to_dict(), default=str)))}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf.hf_config(cfg)))
    return str(folder)


# the routing of a family's released folders, where a script's MoE flags say another: MiniMax-M2's
# route by sigmoid scores with the expert bias, and the minimax27 script leaves megatron-core's
# softmax default (a folder's routing is the model's: the run notes the flag it sets aside); HY-V3's
# route over every expert, and the hunyuan3 script's groups restrict its training (the run notes it)
RELEASED_ROUTING = {"minimax_m2": dict(score_function="sigmoid", enable_expert_bias=True, norm_topk_prob=True),
                    "hy_v3": dict(num_groups=None, group_topk=None)}


def _family_model(args, kind: str | None):
    """The model the flags describe without its no-op layers, of the family --model-type-hf
    names if it names one (the flags say how the layers are built; a folder's type says which
    family)."""
    cfg, _ = hf.without_noop_layers(_model_of(args), {})
    if not kind:
        return cfg
    family = families.named(kind, cfg.moe is not None)
    if family in RELEASED_ROUTING:
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **RELEASED_ROUTING[family]))
    return dataclasses.replace(cfg, family=family)


def _world(args) -> int:
    """The fewest ranks the script's layout takes, as megatron-core counts them: EP carved out of
    DP, or with --expert-tensor-parallel-size 1 out of TP x DP."""
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if args.expert_tensor_parallel_size == 1 and tp > 1:
        ep = max(ep // tp, 1) if ep % tp == 0 else ep
    return tp * args.pipeline_model_parallel_size * args.context_parallel_size * ep


def _outcome(call: dict, paths: dict, tmp_path, references, stand_ins: dict, ran: dict) -> str:
    """What the call did here ("preprocessed", "converted", "trained", "configured", "generated",
    "gated", "parsed"), "refused by <row>", or what went wrong (unknown flags, another error).
    ``stand_ins``: the stand-in folders made so far beside hf_reference.py's; ``ran``: per family,
    the fine-tuning run made so far (its model and checkpoint) and whether a generation line ran."""
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
            return "preprocessed"
        if call["entry"].startswith("convert_ckpt"):
            return _convert(call, references, stand_ins, tmp_path)
        if call["entry"] in ("inference.py", "evaluation.py"):  # as the verbs do before their gate
            inference.set_aside_training_flags(args, call["entry"])
        for device in ("npu", backend.device.type()):  # the script's Ascend device, then this host
            features.validate(args, backend.NAME, device, backend.FRAMEWORK_VERSION)
        if call["entry"] in ("pretrain_gpt.py", "posttrain_gpt.py"):
            if args.enable_hf2mg_convert:
                args.load = _hf_folder(paths["root"], args)
            if args.enable_mg2hf_convert:  # the folder whose config the export takes
                args.hf_cfg_dir = _hf_folder(paths["root"], args)
            configuration.configure(args, _world(args))
            family = call["script"].split("/")[0]
            if call["entry"] == "posttrain_gpt.py" and args.stage == "sft" and family not in ran:
                ran[family] = _tune(call, paths, tmp_path)
                return "trained"
            return "configured"
        family = call["script"].split("/")[0]
        if call["script"].split("/")[1].startswith("generate_") and f"{family} generated" not in ran:
            ran[f"{family} generated"] = _generate(call, paths, tmp_path, ran.get(family))
            return "generated"
        return "gated"
    except FeatureNotAvailable as exc:
        found = ROWS.search(str(exc))
        return f"refused by {found.group(1)}" if found else f"refused without a row: {exc}"
    except MindSpeedError as exc:
        found = ROWS.search(str(exc))
        return f"refused by {found.group(1)}" if found else f"error: {exc}"


# the stand-in folder (hf_reference.py) of each --model-type-hf the conversion scripts name
STAND_INS = {"llama2": "llama", "qwen25": "qwen2", "qwen3": "qwen3", "qwen3-moe": "qwen3-moe", "phi3.5": "phi3-longrope",
             "gemma2": "gemma2", "deepseek2-lite": "deepseek-v2", "deepseek3": "deepseek-v3", "glm45": "glm4-moe",
             "glm45-air": "glm4-moe", "qwen3-next": "qwen3-next", "seed-oss": "seed-oss", "magistral": "mistral",
             "deepseek32": "deepseek-v32", "glm5": "glm5", "longcat": "longcat-flash", "bailing_mini": "glm4-moe",
             "plm": "plm-as-deepseek-v2"}
# these folders carry their multi-token prediction layer (the scripts' conversions name it)
WITH_MTP = ("glm45-air", "deepseek32", "glm5")
# a conversion's layout scaled to the stand-ins (2 layers, 2 key/value heads, 4 experts at least),
# as the launch line below scales the model's sizes: each target at most this
SCALED_TARGETS = {"--target-tensor-parallel-size": 2, "--target-pipeline-parallel-size": 2,
                  "--target-expert-parallel-size": 2, "--num-layers-per-virtual-pipeline-stage": 1}


def _value(flags: list, flag: str):
    return flags[flags.index(flag) + 1] if flag in flags else None


def _scaled_conversion(flags: list, stand_in: str, source: str | None, tmp_path) -> list:
    """A conversion line's flags with its folders replaced (--load-dir: the stand-in, or for an
    export the Megatron checkpoint ``source``), its layout scaled, and the flags that describe
    the full-size model's layers (its no-op and dense layers) set to the stand-in's."""
    cfg, _ = hf.load_folder(stand_in)
    dense = 0 if cfg.moe is None else min(cfg.moe_layer_numbers(), default=cfg.num_layers)
    own = {"--load-dir": source or stand_in, "--save-dir": str(tmp_path / "converted"), "--hf-cfg-dir": stand_in,
           "--hf-dir": stand_in,
           "--first-k-dense-replace": str(dense)}
    pp = min(int(_value(flags, "--target-pipeline-parallel-size") or 1), SCALED_TARGETS["--target-pipeline-parallel-size"])
    out = []
    for flag, given in _groups(flags):
        if flag in own:
            given = [own[flag]]
        elif flag == "--noop-layers":  # after the stand-in's layers: as many as the script adds, or as the
            # scaled stages need to hold equal counts
            count = len(given[0].split(","))
            count = count if (cfg.num_layers + count) % pp == 0 else (-cfg.num_layers) % pp or pp
            given = [",".join(str(cfg.num_layers + k) for k in range(count))]
        elif flag == "--num-layer-list":  # unequal stages as the script's: the first one layer, the others the
            # rest (each then starts with a layer that runs its indexer in the GLM-5 stand-in)
            rest = [(cfg.num_layers - 1) // (pp - 1) + (k < (cfg.num_layers - 1) % (pp - 1)) for k in range(pp - 1)]
            given = [",".join(map(str, [1, *rest]))]
        elif flag in SCALED_TARGETS:  # TP within the stand-in's key/value heads too
            most = min(SCALED_TARGETS[flag], cfg.num_query_groups if flag == "--target-tensor-parallel-size" else 99)
            given = [str(min(int(given[0]), most))]
        out += [flag, *given]
    return out


def _convert(call: dict, references, stand_ins: dict, tmp_path) -> str:
    """Runs a conversion line on a stand-in: "converted", or "parsed" where it has none here.
    An export (mg -> hf) reads the stand-in converted to Megatron's layout with the export's own
    model flags (its no-op layers, its MTP modules), as the run it exports was trained with them."""
    flags = call["flags"]
    kind = _value(flags, "--model-type-hf")
    if kind in cli.convert.NOT_BUILT:  # a family whose folders a matrix row refuses: the converter says so
        features.refuse(cli.convert.NOT_BUILT[kind], runtime.bound().NAME)
    if "--lora-load" in flags or "--save-lora-to-hf" in flags or kind not in STAND_INS:
        return "parsed"  # LoRA's conversions run in test_lora, from a LoRA run of their own
    stand_in = references / STAND_INS[kind]
    if kind in ("bailing_mini", "plm"):  # no class in transformers: a reference rewritten as their folders
        if kind not in stand_ins:
            import test_hf

            (test_hf.ling_v2_folder if kind == "bailing_mini" else test_hf.plm_folder)(stand_in, tmp_path / "stand-in")
            stand_ins[kind] = tmp_path / "stand-in"
        stand_in = stand_ins[kind]
    if kind in WITH_MTP:
        if kind not in stand_ins:
            from test_convert import folder_with_mtp

            folder_with_mtp(stand_in, tmp_path / "stand-in")
            stand_ins[kind] = tmp_path / "stand-in"
        stand_in = stand_ins[kind]
    source = None
    if _value(flags, "--load-model-type") == "mg":
        model = [f for flag in ("--noop-layers", "--mtp-num-layers", "--model-type-hf") if flag in flags
                 for f in (flag, _value(flags, flag))]
        made = _scaled_conversion(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", "-",
                                   "--save-dir", "-", *model], str(stand_in), None, tmp_path / "source")
        cli.convert.run(cli.convert.parser().parse_args(made))
        source = str(tmp_path / "source" / "converted")
    args = cli.convert.parser().parse_args(_scaled_conversion(flags, str(stand_in), source, tmp_path))
    cli.convert.run(args)
    if args.save_model_type == "hf":  # the stand-in's model again (its no-op layers dropped)
        wrote = hf.load_config(args.save_dir) == hf.load_config(str(stand_in))
    else:
        wrote = os.path.isfile(os.path.join(args.save_dir, "latest_checkpointed_iteration.txt"))
    return "converted" if wrote else f"error: {args.save_dir} does not hold the stand-in's model"


# a run line scaled to a tiny model in one process (the tokenizer stand-in's 128 tokens, rows of
# 128 tokens that hold a chat template's turn, a step, four new tokens); the layout flags the
# scaled line no longer needs are dropped, and LongRoPE's factor lists keep one factor per rotated
# pair of the 16 features a head has
RUN_SCALE = {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
             "--num-query-groups": "2", "--kv-channels": "16", "--padded-vocab-size": "128", "--vocab-size": "128",
             "--seq-length": "128", "--micro-batch-size": "1", "--global-batch-size": "1", "--train-iters": "1",
             "--save-interval": "1", "--max-new-tokens": "4", "--num-experts": "4", "--moe-router-topk": "2",
             "--moe-ffn-hidden-size": "32", "--moe-shared-expert-intermediate-size": "32",
             "--moe-router-num-groups": "2", "--moe-router-group-topk": "1", "--q-lora-rank": "32", "--kv-lora-rank": "16", "--qk-head-dim": "16",
             "--qk-pos-emb-head-dim": "8", "--v-head-dim": "16", "--tensor-model-parallel-size": "1",
             "--pipeline-model-parallel-size": "1", "--expert-model-parallel-size": "1", "--context-parallel-size": "1",
             "--expert-tensor-parallel-size": "1", "--recompute-num-layers": "1", "--workers": "1"}
RUN_DROPPED = ("--num-layer-list", "--num-layers-per-virtual-pipeline-stage", "--noop-layers")
ROTATED_PAIRS = 8


def _scaled_run(flags: list, values: dict) -> list:
    """A run line's flags with RUN_SCALE's and ``values``' flags set, RUN_DROPPED's dropped, a positive --first-k-dense-replace made 1
    (one dense layer, then MoE) and LongRoPE's factor lists cut to ROTATED_PAIRS."""
    values = {**RUN_SCALE, **values}
    if "--multi-latent-attention" in flags:  # a latent attention's heads: the scaled --qk-head-dim + rotated part,
        # each its own key and value (PLM's scripts name the groups)
        values["--kv-channels"] = str(int(values["--qk-head-dim"]) + int(values["--qk-pos-emb-head-dim"]))
        values["--num-query-groups"] = values["--num-attention-heads"]
    out = []
    for flag, given in _groups(flags):
        if flag in RUN_DROPPED:
            continue
        if flag in values:
            given = [values[flag]]
        elif flag == "--first-k-dense-replace" and int(given[0]) > 0:
            given = ["1"]
        elif flag in ("--long-factor", "--short-factor"):
            given = [",".join(given[0].split(",")[:ROTATED_PAIRS])]
        out += [flag, *given]
    return out


def _run_verb(argv: list, stdin: str = "") -> tuple[int, str]:
    """``mindspeed <argv>`` in this process: its exit code and what it printed."""
    out = io.StringIO()
    saved, sys.stdin = sys.stdin, io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli.main(argv)
    finally:
        sys.stdin = saved
    return code, out.getvalue()


def _tune(call: dict, paths: dict, tmp_path) -> dict:
    """Trains the fine-tuning line's step, scaled, on its family's own preprocessing of a few
    Alpaca records (the line for its handler, packed where the line trains on packed rows), from a
    Hugging Face folder of its model where the line converts at load (--enable-hf2mg-convert),
    else from the model as a Megatron checkpoint (a LoRA line's base, converted beforehand)."""
    from mindspeed_core import nn
    from mindspeed_core.models import registry

    root = tmp_path / "tune"
    flags = _scaled_run(call["flags"], {"--tokenizer-name-or-path": paths["--tokenizer-name-or-path"],
                                        "--save": str(root / "tuned"), "--load": str(root / "hf"),
                                        "--data-path": str(root / "data" / "alpaca")})
    args = megatron_args.training_parser().parse_args(flags)
    cfg = _family_model(args, args.model_type_hf)
    if args.enable_hf2mg_convert:
        hf.save_folder(str(root / "hf"), cfg, nn.state_dict(registry.for_config(cfg).build(cfg)))
    else:
        from mindspeed_core.compat import mcore

        cfg = _model_of(args)  # with its no-op layers, as the line's checkpoint holds them
        mcore.save(str(root / "hf"), 1, cfg, nn.state_dict(registry.for_config(cfg).build(cfg)), mcore.Layout())
    family = call["script"].split("/")[0]
    packed = "--neat-pack" in flags
    prep = next(c for c in CALLS if c["entry"] == "preprocess_data.py" and c["script"].startswith(family + "/")
                and _value(c["flags"], "--handler-name") == args.handler_name and ("--pack" in c["flags"]) == packed
                and _value(c["flags"], "--prompt-type") == args.prompt_type)
    code, out = _run_verb(["preprocess", *_scaled_run(prep["flags"], {
        "--input": paths["--input"], "--output-prefix": str(root / "data" / "alpaca"),
        "--tokenizer-name-or-path": paths["--tokenizer-name-or-path"]})])
    assert code == 0, f"{prep['script']}: {out[-2000:]}"
    code, out = _run_verb(["train", *flags])
    saved = os.path.isfile(root / "tuned" / "latest_checkpointed_iteration.txt")
    assert code == 0 and re.search(r"iteration +1/1", out) and saved, f"{call['script']}: {out[-3000:]}"
    return {"model": _model_of(args), "checkpoint": str(root / "tuned")}


def _generate(call: dict, paths: dict, tmp_path, tuned: dict | None) -> str:
    """Runs the generation line, scaled: its --task, or MindSpeed-LLM's task set where it names
    none; the chat answers one message and ends at "exit". It reads the family's fine-tuned checkpoint
    where the two lines describe the same model, else a checkpoint of its own model's weights."""
    from mindspeed_core import nn
    from mindspeed_core.models import registry

    root = tmp_path / "generate"
    # the path flags' stand-ins first (a script's placeholder path may be words); a Tekken tokenizer's
    # 266 tokens need a larger table than the other stand-in's 128
    tekken = "MagistralTokenizer" in call["flags"]
    flags = _scaled_run(_stand_ins(call["flags"], paths), {"--tokenizer-name-or-path": paths["--tokenizer-name-or-path"],
                                                           "--load": str(root / "ckpt"),
                                                           **({"--padded-vocab-size": "384"} if tekken else {})})
    args = cli.inference.parser().parse_args(flags)
    cfg = _model_of(args)
    if tuned is not None and tuned["model"] == cfg:
        flags[flags.index("--load") + 1] = tuned["checkpoint"]
    else:
        from mindspeed_core.compat import mcore

        mcore.save(str(root / "ckpt"), 1, cfg, nn.state_dict(registry.for_config(cfg).build(cfg)), mcore.Layout())
    code, out = _run_verb(["generate", *flags], stdin="add 1 2\nexit\n")
    tasks = args.task or megatron_args.GENERATION_TASKS
    shown = len(tasks) == 1 or all(f"=== {t} ===" in out for t in tasks)
    assert code == 0 and shown and ("chat" not in tasks or "Assistant> " in out), f"{call['script']}: {out[-3000:]}"
    return "the fine-tuned checkpoint" if flags[flags.index("--load") + 1] == (tuned or {}).get("checkpoint") \
        else "a checkpoint of its own"


# what a call did here: preprocessing ran on a few records; a conversion ran on a stand-in
# folder; a training line was gated and its whole run configured (a family's first fine-tuning
# line also trains a step, scaled; a pre-training line trains in the launch test below); an
# inference line was gated (a family's first also generates, scaled) and an evaluation line
# parsed and gated (generation and evaluation at TP and PP layouts run in test_generate and
# test_evaluate, scaled down); a LoRA conversion was parsed (they run in test_lora)
DID = ("preprocessed", "converted", "trained", "configured", "generated", "gated", "parsed")
# measured here, per entry point (the refused stop at the rows they name: Ascend-only kernels and
# DualPipeV; on MindSpore also the training lines' bfloat16, which most of them ask for)
DONE = {
    "pytorch": {"convert_ckpt_v2.py": {"converted": 41, "parsed": 6, "refused": 2},
                "evaluation.py": {"gated": 19},
                "inference.py": {"gated": 13, "generated": 19},
                "posttrain_gpt.py": {"configured": 29, "refused": 9, "trained": 12},
                "preprocess_data.py": {"preprocessed": 43, "refused": 1},
                "pretrain_gpt.py": {"configured": 36, "refused": 10}},
    "mindspore": {"convert_ckpt_v2.py": {"converted": 41, "parsed": 6, "refused": 2},
                  "evaluation.py": {"gated": 19},
                  "inference.py": {"gated": 13, "generated": 19},
                  "posttrain_gpt.py": {"refused": 50}, "preprocess_data.py": {"preprocessed": 43, "refused": 1},
                  "pretrain_gpt.py": {"refused": 46}},
}


@pytest.mark.feature("squared-relu")  # PLM's generation line, from its flags
@pytest.mark.feature("magistral-tokenizer")  # Magistral's preprocessing and generation lines
@pytest.mark.feature("family-ling-v2")  # Ling-V2's and PLM's conversion lines on stand-in folders
@pytest.mark.feature("family-plm")
def test_every_upstream_script_call_is_accepted_or_refused_by_a_matrix_row(framework, paths, hf_references, tmp_path,
                                                                            capsys):
    outcomes, stand_ins, ran = [], {}, {}
    # a family's fine-tuning lines first: its generation line may read what one of them trained
    for n, call in sorted(enumerate(CALLS), key=lambda nc: nc[1]["entry"] != "posttrain_gpt.py"):
        outcomes.append((call, _outcome(call, paths, tmp_path / str(n), hf_references, stand_ins, ran)))
    capsys.readouterr()
    assert len(CALLS) == 240
    wrong = {f"{c['script']} ({c['entry']})": v for c, v in outcomes if v not in DID and not v.startswith("refused by ")}
    assert wrong == {}, "\n".join(f"{k}: {v}" for k, v in wrong.items())
    table = collections.defaultdict(collections.Counter)
    for call, v in outcomes:
        table[call["entry"]][v if v in DID else "refused"] += 1
    by_row = collections.Counter(v[len("refused by "):] for _, v in outcomes if v.startswith("refused by "))
    table = {entry: dict(sorted(counts.items())) for entry, counts in sorted(table.items())}
    read = {k.split()[0]: v for k, v in ran.items() if k.endswith(" generated")}
    print(f"upstream calls: {table}; refusals by row: {dict(by_row)}; generation read: {read}")
    assert table == DONE[framework], table


# script -> the sizes its launch line is scaled to (beyond RUN_SCALE's), every other flag as it is
LAUNCHED = {
    "qwen3/pretrain_qwen3_0point6b_4K_ptd.sh": {},
    # four layers, every fourth full attention (gated, a quarter of each head rotated): three gated
    # DeltaNet layers of 2 key and 4 value heads; the MoE of every layer with its gated shared expert;
    # --use-triton-gdn, --gemm-gradient-accumulation-fusion and --swap-optimizer as the script has them
    "qwen3_next/pretrain_qwen3_next_80b_16K_A3_ptd.sh": {
        "--num-layers": "4", "--linear-num-key-heads": "2", "--linear-num-value-heads": "4",
        "--linear-key-head-dim": "16", "--linear-value-head-dim": "16", "--mamba-chunk-size": "16"},
    # MiniMax-M2.7 from a MiniMax-M2 folder: its spec's q/k norms over all heads (their widths, the
    # script's --q-lora-rank and --kv-lora-rank, scaled with the heads), sigmoid routing with the expert
    # bias (the folder's: the script's softmax default is set aside with a note)
    "minimax27/pretrain_minimax27_229b_4K_A3_ptd.sh": {"--q-lora-rank": "64", "--kv-lora-rank": "32",
                                                      "--ffn-hidden-size": "32"},  # as the experts, as the script has it
    # Kimi-K2: DeepSeek-V3's layer (latent attention with the query latent, YaRN, a dense first layer,
    # then sigmoid routing in one group with the expert bias beside a shared expert), from a Megatron
    # checkpoint (--load), --reuse-fp32-param and --gemm-gradient-accumulation-fusion as the script has them
    "kimi2/pretrain_kimi2_18b_4k_8p_ptd.sh": {"--moe-router-num-groups": "1"},
    # LongCat-Flash: its spec's layer (two scaled latent attentions, two dense MLPs, the shortcut MoE), top-2 of
    # 4 experts and 2 zero-computation ones by softmax with the expert bias, from a Megatron checkpoint
    "longcat/pretrain_longcat_flash_560b_4k_A3_ptd.sh": {"--num-zero-experts": "2"},
    # DeepSeek-V3.2 from a deepseek_v32 folder: sparse attention (top-8 of 32 positions by an indexer of
    # 4 heads, its loss on) in every layer and the MTP module's, the norms float32 under bf16
    # (--init-norm-weight-in-fp32), MindSpeed's fused-kernel flags as the script has them
    "deepseek32/pretrain_deepseek32_671b_4k_A3_ptd.sh": {"--index-topk": "8", "--index-n-heads": "4",
                                                        "--index-head-dim": "32"},
    # GLM-5.2 from a Megatron checkpoint: its script's --index-topk-freq 4 and --index-skip-topk-offset 3
    # over four layers (the fourth reuses the third's top-k), the norms float32 under bf16
    "glm52/pretrain_glm52_744b_4k_A3_ptd.sh": {"--num-layers": "4", "--index-topk": "8", "--index-n-heads": "4",
                                            "--index-head-dim": "32"},
    # Hunyuan-3 from a HY-V3 folder (Qwen3's layer from bailing_spec): its script's groups over the folder's
    # experts, top-2 of 4 within the best of 2 groups, beside the shared expert
    "hunyuan3/pretrain_hunyuan3_299b_4k_A3_ptd.sh": {},
    # Seed-OSS from its folder: q/k/v and output biases
    "seed_oss/pretrain_seed_oss_36b_ptd_2k_A3.sh": {},
    # Magistral from a Mistral folder, its data preprocessed and read by the Tekken tokenizer of the
    # folder's tekken.json (266 tokens: a larger table than the other stand-ins' 128)
    "magistral/pretrain_magistral_small_24b_A3_ptd.sh": {"--padded-vocab-size": "384"},
    # Ling-V2 mini from a Ling-V2 folder (bailing_spec: Qwen3's layer, half of each head rotated, grouped
    # sigmoid routing with the expert bias beside a shared expert); PLM from its folder (latent attention
    # without a query latent, the squared-ReLU MLP, tied embeddings)
    "ling_v2/pretrain_ling_mini_16b_4k_ptd.sh": {},
    "plm/pretrain_plm_1point8b_ptd.sh": {},
    # DeepSeek-V3 (A3) from a deepseek3 folder with its schedule on four ranks: DualPipeV over two pipeline
    # ranks (four layers, two a rank in a V, the MTP module on the first) x EP2 (the alltoall dispatcher),
    # --moe-fb-overlap pairing forwards with backwards, --swap-optimizer and the distributed optimizer as
    # the script has them; 3 micro-batches a data-parallel rank (DualPipeV's least at PP2)
    "deepseek3/pretrain_deepseek3_671b_4k_A3_ptd.sh": {"--pipeline-model-parallel-size": "2", "--num-layers": "4",
                                                       "--expert-model-parallel-size": "2",
                                                       "--global-batch-size": "6"},
}
LAUNCH_RANKS = {"deepseek3/pretrain_deepseek3_671b_4k_A3_ptd.sh": 4}  # the others: 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("script", list(LAUNCHED), ids=["qwen3", "qwen3-next", "minimax27", "kimi2", "longcat",
                                                         "deepseek32", "glm52", "hunyuan3", "seed-oss", "magistral",
                                                         "ling-v2", "plm", "deepseek3-dualpipev"])
def test_a_scripts_own_launch_line_trains(framework, paths, tmp_path, script):
    """A pre-training script's python line, with sizes, paths and the device count scaled down
    and no flag edited, under the framework's launcher (torchrun / msrun) on two ranks: it trains
    from a Hugging Face folder (--enable-hf2mg-convert) or a Megatron checkpoint (--load), or, where
    this host cannot run a setting
    the script asks for (MindSpore's CPU has no bfloat16 matmul), stops in one line naming the
    matrix row."""
    from launch import launch

    root = paths["root"]
    call = next(c for c in CALLS if c["script"] == script)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": "def f(x): return x + 1 " * 4}) + "\n" for _ in range(40)))
    tokenizer = ["--tokenizer-type", "MagistralTokenizer", "--tokenizer-model", paths["--tokenizer-model"]] \
        if "MagistralTokenizer" in call["flags"] else \
        ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", paths["--tokenizer-name-or-path"]]
    assert cli.main(["preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "enwiki"), *tokenizer,
                     "--append-eod"]) == 0
    flags = _scaled_run(_stand_ins(call["flags"], paths), {
        "--max-position-embeddings": "256", "--seq-length": "32", "--global-batch-size": "4", "--train-iters": "2",
        "--save-interval": "2", "--tokenizer-name-or-path": paths["--tokenizer-name-or-path"],
        "--data-path": str(tmp_path / "enwiki_text_document"), "--load": str(tmp_path / "hf"),
        "--save": str(tmp_path / "run"), **LAUNCHED[script]})
    # the Hugging Face folder the script starts from: a model of the scaled sizes, exported
    from mindspeed_core import nn
    from mindspeed_core.models import registry

    args = megatron_args.training_parser().parse_args(flags)
    cfg = _family_model(args, args.model_type_hf)
    state = nn.state_dict(registry.for_config(cfg).build(cfg))
    if args.enable_hf2mg_convert:
        hf.save_folder(str(tmp_path / "hf"), cfg, state)
    else:  # a Megatron checkpoint of that model, as its conversion line would have written
        from mindspeed_core.compat import mcore

        mcore.save(str(tmp_path / "hf"), 1, cfg, state, mcore.Layout())
    code, out = launch(framework, LAUNCH_RANKS.get(script, 2), str(ROOT / "tools" / "pretrain_gpt.py"), flags,
                       str(tmp_path / "logs"),
                       launcher=True)
    status = features.get("bf16").status(framework, runtime.bound().device.type())
    if status.kind in ("unsupported", "planned"):
        assert code != 0 and "bf16 (--bf16) is" in out, out[-3000:]
        return
    assert code == 0 and "iteration      2/2" in out and "saved checkpoint" in out, out[-3000:]
    if "--enable-dsa-indexer" in flags:  # the indexers trained (their loss is logged)
        assert "| indexer loss " in out, out[-3000:]
    if "dualpipev" in flags:  # its schedule, not 1F1B, with its forwards and backwards paired by --moe-fb-overlap and
        # the all-to-all exchanges of the first rank's MoE layer travelling beside the other micro-batch's compute
        assert "PP=2 x 2 chunks in a V (DualPipeV) EP=2 (alltoall dispatcher)" in out, out[-3000:]
        assert re.search(r"--moe-fb-overlap: [1-9]\d* of pipeline rank 0's \d+ forwards a step run beside a backward; "
                         r"the all-to-all exchanges of its 1 MoE layer travel", out), out[-3000:]
        assert re.search(r"--moe-fb-overlap: [1-9]\d* all-to-all exchanges of pipeline rank 0 travelled", out), \
            out[-3000:]
    if "--moe-fb-overlap" in flags and "--enable-dsa-indexer" in flags:  # not paired (no pipeline here, or the
        # indexers): said, and trained as without
        assert "--moe-fb-overlap pairs nothing here: " in out, out[-3000:]
    if "HYV3" in flags:  # the script's groups over the folder's experts, said once
        assert out.count("routes each token within its best 1 of 2 expert groups") == 1, out[-3000:]
