"""LoRA (models/lora.py, --lora-* flags) on instruction data, on the bound framework: only
the adapters train, the LoRA forward equals a float64 numpy reference, merging changes no
logit, --lora-load resumes exactly, and bad combinations are one-line errors. Tensor
parallelism's LoRA parity rides in test_parallel's two- and four-rank launches."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil

import numpy as np
import pytest

from mindspeed_core import cli, nn, ops
from mindspeed_core.compat import hf, mcore, torch_pickle
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


@pytest.mark.feature("lora-checkpoint-filter")
@pytest.mark.feature("lora")
def test_a_filtered_checkpoint_holds_the_adapters_only_and_resumes_with_the_base(capsys, runs):
    """--lora-ckpt-filter (MindSpeed-LLM's): the same run as ``stopped``, its checkpoint holding
    the adapters and their optimizer state only; --load base --lora-load it continues as the
    straight run does; --load it alone is one line; mindspeed convert merges it as the whole one."""
    filtered = runs["tmp"] / "lora-filtered"
    train("--data-path", runs["data"], *LORA, "--load", runs["base"], "--train-iters", "4", "--exit-interval", "3",
          "--save", str(filtered), "--lora-ckpt-filter")
    arrays, optimizer, _ = checkpoint.load(str(filtered), 3)
    whole, _, _ = checkpoint.load(runs["stopped"], 3)
    assert sorted(arrays) == sorted(n for n in whole if lora.is_adapter(n))
    assert all(np.array_equal(arrays[n], whole[n]) for n in arrays)  # the same run, bit for bit
    assert optimizer and all(lora.is_adapter(k.split(".", 1)[1]) for k in optimizer)
    metrics = runs["tmp"] / "filtered-resumed.jsonl"
    train("--data-path", runs["data"], *LORA, "--load", runs["base"], "--lora-load", str(filtered),
          "--train-iters", "4", "--metrics-file", str(metrics))
    assert losses(metrics) == {4: losses(runs["tmp"] / "straight.jsonl")[4]}
    capsys.readouterr()
    assert cli.main(["train", *MODEL, *BATCH, "--stage", "sft", "--data-path", runs["data"], *LORA, "--load",
                     str(filtered), "--train-iters", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a LoRA run's adapters only" in err and len(err.splitlines()) == 1, err
    merged = {}
    for name, source in (("filtered", filtered), ("whole", runs["stopped"])):
        out = runs["tmp"] / f"merged-{name}"
        assert cli.main(["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", runs["base"],
                         "--lora-load", str(source), "--save-dir", str(out)]) == 0
        merged[name] = hf._read_tensors(str(out))
    assert sorted(merged["filtered"]) == sorted(merged["whole"])
    assert all(np.array_equal(merged["filtered"][n], merged["whole"][n]) for n in merged["whole"])


@pytest.mark.parametrize("flags, message", [
    ([*LORA, "--lora-load", "{stopped}"], "give the base model with --load or --load-hf"),
    (["--load", "{base}", "--lora-load", "{stopped}"], "give the same --lora-r / --lora-target-modules"),
    (["--load", "{base}", "--lora-load", "{stopped}", "--lora-r", "8"], "pass the same --lora-* flags"),
    (["--load", "{stopped}"], "holds LoRA adapters (rank 4, alpha 8.0"),
    (["--load", "{base}", "--lora-load", "{base}", *LORA], "holds no LoRA adapters"),
    (["--lora-target-modules", "linear_q"], "invalid choice"),
])
def test_bad_lora_options_are_one_line_errors(capsys, runs, flags, message):
    flags = [f.format(**runs) for f in flags]
    code = cli.main(["train", *MODEL, *BATCH, "--stage", "sft", "--data-path", runs["data"], "--train-iters", "1",
                     *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err


def _lora_logits(cfg, arrays, ids) -> np.ndarray:
    """The LoRA model's logits on the bound framework (adapters applied, not merged)."""
    model = registry.for_config(cfg).build(cfg)
    load_whole_state(model, arrays)
    return ops.to_numpy(model(ops.tensor(ids))).astype(np.float64)


def _convert(capsys, *flags) -> str:
    code = cli.main(["convert", *flags])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def _filtered(src, dst) -> None:
    """A Megatron LoRA checkpoint saved with the adapters only (MindSpeed-LLM's
    --lora-ckpt-filter): each rank file's model state without its base weights."""
    shutil.copytree(src, dst)
    for path in dst.rglob(mcore.FILE):
        state = torch_pickle.load(str(path))
        state["model"] = {k: v for k, v in state["model"].items() if lora.is_adapter(k)}
        torch_pickle.save(str(path), state)


@pytest.mark.feature("convert-lora")
@pytest.mark.feature("weight-conversion")
def test_convert_exports_a_lora_run_as_a_peft_folder_and_merges_it_with_our_logits(capsys, runs, tmp_path):
    """MindSpeed-LLM's two LoRA conversions on a run of ours and on the same run as a Megatron
    checkpoint at TP 2 in peft's names, whole and adapters only: --save-lora-to-hf writes a
    PEFT folder that peft loads onto the transformers model, --lora-load merges; transformers
    gives the LoRA model's logits either way."""
    from conftest import hf_reference_process

    arrays = checkpoint.load_model_arrays(runs["stopped"], 3)
    cfg = ModelConfig.from_dict(checkpoint.read_meta(runs["stopped"], 3)["model"])
    ids = np.arange(40, 90, dtype=np.int64)[None]
    want = _lora_logits(cfg, arrays, ids)
    lora_flags = ["--lora-r", "4", "--lora-alpha", "8", "--lora-target-modules", "linear_qkv", "linear_proj",
                  "linear_fc1", "linear_fc2"]
    # the base model as a Hugging Face folder, the adapters written into it (as the upstream script does)
    peft_dir, merged_dir = tmp_path / "hf", tmp_path / "merged"
    _convert(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", runs["base"],
             "--save-dir", str(peft_dir))
    said = _convert(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", runs["stopped"],
                    "--save-lora-to-hf", *lora_flags, "--save-dir", str(peft_dir), "--hf-cfg-dir", str(peft_dir))
    assert "as a PEFT folder" in said
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    said = _convert(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", runs["base"],
                    "--lora-load", runs["stopped"], *lora_flags, "--save-dir", str(merged_dir))
    assert "merged the LoRA adapters of" in said
    # the same run in Megatron's layout at TP 2, as MindSpeed-LLM saves a LoRA run (peft's names)
    megatron, only = tmp_path / "mg-lora", tmp_path / "mg-lora-filtered"
    mcore.save(str(megatron), 3, cfg, arrays, mcore.Layout(tp=2))
    names = set(torch_pickle.load(str(megatron / "iter_0000003" / "mp_rank_01" / mcore.FILE))["model"])
    assert {"decoder.layers.1.self_attention.linear_qkv.base_layer.weight",
            "decoder.layers.1.self_attention.linear_qkv.lora_A.default.weight",
            "decoder.layers.1.mlp.linear_fc2.lora_B.default.weight"} <= names
    _filtered(megatron, only)
    peft_mg, merged_mg = tmp_path / "hf-from-mg", tmp_path / "merged-from-mg"
    shutil.copytree(peft_dir, peft_mg, ignore=lambda d, files: [f for f in files if f.startswith("adapter_")])
    _convert(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(only),
             "--save-lora-to-hf", "--save-dir", str(peft_mg), "--model-type-hf", "llama2")
    _convert(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", runs["base"],
             "--lora-load", str(megatron), "--save-dir", str(merged_mg))
    # the adapters read back from both Megatron checkpoints are the run's, bit for bit
    from mindspeed_core import tensor_files

    (first, _), (again, _) = (tensor_files.load(str(d / "adapter_model.safetensors")) for d in (peft_dir, peft_mg))
    assert sorted(first) == sorted(again) and len(first) == 2 * 2 * 7  # 2 layers, 7 projections, A and B
    assert all(np.array_equal(first[k].array, again[k].array) for k in first)
    folders = [peft_dir, merged_dir, peft_mg, merged_mg]
    for n, folder in enumerate(folders):
        np.save(tmp_path / f"ids{n}.npy", ids)
    hf_reference_process("--check", *[str(x) for n, f in enumerate(folders)
                                      for x in (f, tmp_path / f"ids{n}.npy", tmp_path / f"out{n}.npy")])
    scale = np.abs(want).max()
    for n, folder in enumerate(folders):
        got = np.load(tmp_path / f"out{n}.npy")
        assert np.abs(got - want).max() <= 1e-4 * scale, (folder.name, np.abs(got - want).max(), scale)


@pytest.mark.parametrize("flags, message", [
    (["--load-dir", "{base}", "--save-lora-to-hf"], "holds no LoRA adapters"),
    (["--load-dir", "{stopped}", "--save-lora-to-hf", "--lora-r", "8"], "--lora-r 8, but the LoRA run in"),
    (["--load-dir", "{stopped}", "--save-lora-to-hf", "--lora-target-modules", "linear_qkv"],
     "--lora-target-modules linear_qkv, but the LoRA run in"),
    (["--load-dir", "{base}", "--lora-load", "{base}"], "holds no LoRA adapters"),
    (["--load-dir", "{base}", "--lora-r", "4"], "give one of those"),
    (["--load-dir", "{stopped}", "--lora-load", "{stopped}", "--save-lora-to-hf"], "give one of them"),
    (["--load-dir", "{filtered}"], "holds LoRA adapters only, no base model"),
    (["--load-dir", "{other}", "--lora-load", "{stopped}"], "trained on other weights than --load-dir"),
])
def test_bad_lora_conversions_are_one_line_errors(capsys, megatron_runs, tmp_path, flags, message):
    code = cli.main(["convert", "--load-model-type", "mg", "--save-model-type", "hf",
                     "--save-dir", str(tmp_path / "out"), *[f.format(**megatron_runs) for f in flags]])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def megatron_runs(runs):
    """The stopped LoRA run as a Megatron checkpoint (peft's names), whole and adapters only,
    and a base of other weights (the run merged)."""
    arrays = checkpoint.load_model_arrays(runs["stopped"], 3)
    cfg = ModelConfig.from_dict(checkpoint.read_meta(runs["stopped"], 3)["model"])
    whole, filtered, other = (runs["tmp"] / n for n in ("mg-whole", "filtered", "other"))
    mcore.save(str(whole), 3, cfg, arrays, mcore.Layout())
    _filtered(whole, filtered)
    mcore.save(str(other), 3, *lora.merge(cfg, arrays), mcore.Layout())
    return dict(runs, whole=str(whole), filtered=str(filtered), other=str(other))


@pytest.mark.feature("lora")
def test_training_from_a_megatron_lora_run_takes_it_merged_or_with_its_adapters(capsys, megatron_runs):
    """MindSpeed-LLM's LoRA checkpoint as --load: without LoRA flags its adapters merged (the
    loss at lr 0 is the LoRA model's), with other LoRA flags or adapters only one line."""
    arrays = checkpoint.load_model_arrays(megatron_runs["stopped"], 3)
    cfg = ModelConfig.from_dict(checkpoint.read_meta(megatron_runs["stopped"], 3)["model"])
    want = reference_loss({k: np.asarray(v, np.float64) for k, v in lora.merge(cfg, arrays)[1].items()}, cfg)
    metrics = megatron_runs["tmp"] / "from-megatron.jsonl"
    train("--data-path", megatron_runs["data"], "--load", megatron_runs["whole"], "--lr", "0", "--train-iters", "1",
          "--metrics-file", str(metrics))
    got = losses(metrics)[1]
    assert abs(got - want) <= 1e-5 * want, (got, want)
    for flags, message in (([*LORA[:1], "8", *LORA[2:], "--load", megatron_runs["whole"]], "pass the same --lora-*"),
                           (["--load", megatron_runs["filtered"]], "holds LoRA adapters only")):
        code = cli.main(["train", *MODEL, *BATCH, "--stage", "sft", "--data-path", megatron_runs["data"],
                         "--train-iters", "1", *flags])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, err


# LoRA on a mixture of experts: the second layer top-2 of 4 SwiGLU experts (grouped GEMM) beside a
# shared expert, steered by an expert bias that each step's loads move (fast here), from a base
# trained in full for one step
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
       "--moe-shared-expert-intermediate-size", "32", "--first-k-dense-replace", "1", "--moe-grouped-gemm", "--swiglu",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
       "0.05"]
BIAS = "decoder.layers.1.mlp.router.expert_bias"
EXPERT_FACTORS = [f"decoder.layers.1.mlp.experts.lora_{f}.weight{k}" for f in "AB" for k in (1, 2)]


@pytest.fixture(scope="module")
def moe_runs(runs):
    tmp = runs["tmp"]
    base, run, filtered = tmp / "moe-base", tmp / "moe-lora", tmp / "moe-lora-filtered"
    train("--data-path", runs["data"], *MOE, "--train-iters", "1", "--save", str(base))
    for folder, extra in ((run, []), (filtered, ["--lora-ckpt-filter"])):
        train("--data-path", runs["data"], *MOE, *LORA, "--load", str(base), "--train-iters", "3", "--save",
              str(folder), *extra)
    cfg = ModelConfig.from_dict(checkpoint.read_meta(str(run), 3)["model"])
    return dict(runs, moe_base=str(base), moe_run=str(run), moe_filtered=str(filtered), moe_cfg=cfg,
                moe_arrays=checkpoint.load_model_arrays(str(run), 3))


def _folded(cfg, arrays) -> dict:
    """The test's own fold, in float64: a linear layer's W [out, in] + s B A, an expert's
    W[e] [in, out] + s A[e] B[e]; latent attention's fused linear_qkv adapter's rows onto the
    query's down-projection (the first q_lora_rank) and the key/value's (the rest)."""
    out = {k: np.asarray(v, np.float64) for k, v in arrays.items() if not lora.is_adapter(k)}
    for name in arrays:
        if ".lora_A." in name:
            a, b = (np.asarray(arrays[n], np.float64) for n in (name, name.replace(".lora_A.", ".lora_B.")))
            delta = cfg.lora.scale * (a @ b if a.ndim == 3 else b @ a)
            base = name.replace(".lora_A.", ".")
            if base in out:
                out[base] += delta
            else:
                q = cfg.mla.q_lora_rank
                out[base.replace("linear_qkv", "linear_q_down_proj")] += delta[:q]
                out[base.replace("linear_qkv", "linear_kv_down_proj")] += delta[q:]
    return out


@pytest.mark.feature("lora-moe")
@pytest.mark.feature("lora")
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "expert-by-expert"])
def test_lora_on_experts_trains_their_adapters_only_and_equals_the_folded_model(moe_runs, grouped):
    """Each expert's fc1 and fc2 adapters and the shared expert's train, the base (the router's
    weights too) stays bit for bit while the expert bias moves with the loads; a filtered
    checkpoint holds the adapters and that bias; the LoRA model's logits, through the grouped and
    the expert-by-expert path, equal the model with the adapters folded in by this test."""
    cfg, arrays = moe_runs["moe_cfg"], moe_runs["moe_arrays"]
    base = checkpoint.load_model_arrays(moe_runs["moe_base"], 1)
    adapters = {n for n in arrays if lora.is_adapter(n)}
    assert set(EXPERT_FACTORS) <= adapters
    assert {f"decoder.layers.1.mlp.shared_experts.linear_fc{k}.lora_{f}.weight" for k in (1, 2) for f in "AB"} <= adapters
    assert arrays["decoder.layers.1.mlp.experts.lora_A.weight1"].shape == (4, 32, 4)
    assert arrays["decoder.layers.1.mlp.experts.lora_B.weight2"].shape == (4, 4, 32)
    assert sorted(set(arrays) - adapters) == sorted(base)
    for name, value in base.items():
        assert np.array_equal(arrays[name], value) != (name == BIAS), name
    kept = checkpoint.load_model_arrays(moe_runs["moe_filtered"], 3)
    assert sorted(kept) == sorted(adapters | {BIAS})
    assert all(np.array_equal(kept[n], arrays[n]) for n in kept)
    for name in EXPERT_FACTORS:  # B moved from zero (an expert that routed prompt tokens only has no gradient)
        assert ".lora_A." in name or np.abs(arrays[name]).max() > 0, name
    ids = np.arange(40, 100, dtype=np.int64)[None]
    folded_cfg = dataclasses.replace(cfg, lora=None)
    logits = []
    for c, state in ((cfg, arrays), (folded_cfg, _folded(cfg, arrays)), (folded_cfg, base)):
        model = registry.for_config(c).build(c)
        load_whole_state(model, {k: np.asarray(v, np.float32) for k, v in state.items()})
        for layer in model.moe_layers():
            layer.grouped = grouped
        logits.append(ops.to_numpy(model(ops.tensor(ids))).astype(np.float64))
    scale = np.abs(logits[0]).max()
    assert np.abs(logits[0] - logits[1]).max() <= 1e-5 * scale
    assert np.abs(logits[0] - logits[2]).max() > 1e-2 * scale  # the adapters move the logits: the check can see them


def _grouped_megatron(folder, cfg, arrays) -> None:
    """The run as MindSpeed-LLM's LoRA run with GroupedMLP experts saves it (one rank): weight1
    [hidden, E x width] and weight2 [E x ffn, hidden], flat views of [E, hidden, width] and
    [E, ffn, hidden] (its converter's cat(experts).view(hidden, -1)), and LoraParallelGroupedMLP's
    factors, flat views of ours ([E, in, r] and [E, r, out])."""
    mcore.save(str(folder), 3, cfg, arrays, mcore.Layout())
    path = next(folder.rglob(mcore.FILE))
    state = torch_pickle.load(str(path))
    model, prefix = state["model"], "decoder.layers.1.mlp.experts."
    for key in [k for k in model if k.startswith(prefix + "local_experts.")]:
        del model[key]
    ours = "decoder.layers.1.mlp.experts."
    w1, w2 = arrays[ours + "weight1"], arrays[ours + "weight2"]
    model[prefix + "weight1"] = w1.reshape(w1.shape[1], -1)
    model[prefix + "weight2"] = w2.reshape(-1, w2.shape[2])
    for which in ("weight1", "weight2"):
        a, b = arrays[f"{ours}lora_A.{which}"], arrays[f"{ours}lora_B.{which}"]
        model[f"{prefix}{which}_lora_a"] = a.reshape(a.shape[1], -1) if which == "weight1" else a.reshape(-1, a.shape[2])
        model[f"{prefix}{which}_lora_b"] = b.reshape(b.shape[1], -1) if which == "weight1" else b.reshape(-1, b.shape[2])
    torch_pickle.save(str(path), state)


@pytest.mark.feature("lora-moe")
@pytest.mark.feature("convert-lora")
def test_expert_adapters_cross_megatrons_layout_and_merge(capsys, moe_runs, tmp_path):
    """The run in Megatron's layout at TP2 x EP2 (SequentialMLP experts in peft's names) and as
    MindSpeed-LLM's GroupedMLP LoRA experts reads back bit for bit; mindspeed convert
    --lora-load folds the experts' adapters into the base as this test does; PEFT export
    refuses them in one line."""
    cfg, arrays = moe_runs["moe_cfg"], moe_runs["moe_arrays"]
    sequential, grouped = tmp_path / "mg-tp2-ep2", tmp_path / "mg-grouped"
    mcore.save(str(sequential), 3, cfg, arrays, mcore.Layout(tp=2, ep=2))
    names = set(torch_pickle.load(str(sequential / "iter_0000003" / "mp_rank_01_001" / mcore.FILE))["model"])
    expert = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1."
    assert {expert + "base_layer.weight", expert + "lora_A.default.weight", expert + "lora_B.default.weight"} <= names
    _grouped_megatron(grouped, cfg, arrays)
    for folder in (sequential, grouped):
        back = mcore.load(str(folder))
        assert sorted(back.state) == sorted(arrays), sorted(set(back.state) ^ set(arrays))
        for name, value in arrays.items():
            assert np.array_equal(back.state[name], value), (folder.name, name)
    merged = tmp_path / "merged"
    said = _convert(capsys, "--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", moe_runs["moe_base"],
                    "--lora-load", str(sequential), "--save-dir", str(merged))
    assert "merged the LoRA adapters of" in said
    got, want = mcore.load(str(merged)).state, _folded(cfg, arrays)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert np.abs(got[name] - value).max() <= 1e-6 * max(np.abs(value).max(), 1.0), name
    # the filtered run (adapters and the expert bias it moved) merges into the base the same way
    _convert(capsys, "--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", moe_runs["moe_base"],
             "--lora-load", moe_runs["moe_filtered"], "--save-dir", str(tmp_path / "merged-filtered"))
    again = mcore.load(str(tmp_path / "merged-filtered")).state
    assert all(np.array_equal(again[n], got[n]) for n in got)
    code = cli.main(["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", moe_runs["moe_run"],
                     "--save-lora-to-hf", "--save-dir", str(tmp_path / "peft")])
    err = capsys.readouterr().err
    assert code == 2 and "adapters on a mixture of experts' MLPs is not built" in err and err.count("\n") == 1, err


@pytest.mark.feature("lora")
@pytest.mark.feature("lora-moe")
@pytest.mark.feature("multi-latent-attention")
def test_lora_on_latent_attention_adapts_its_output_projection_and_the_experts(tmp_path):
    """DeepSeek's LoRA lines target linear_qkv linear_proj linear_fc1 linear_fc2: latent
    attention's linear_qkv is MindSpeed-LLM's fused down-projections (one adapter across the
    query's and the key/value's), its linear_proj takes the heads' values, and the MoE layer's
    experts and shared expert are adapted; with random factors the logits equal the model folded
    by this test. Without a query latent the linear_qkv target is refused."""
    from mindspeed_core.models.config import LoRAConfig, MLAConfig, MoEConfig
    from mindspeed_core.models.state import adapter_shapes

    mla = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=24)
    cfg = ModelConfig(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48, mla=mla,
                      moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=24, shared_expert_size=24), moe_layers=(1,),
                      lora=LoRAConfig(r=4, alpha=8.0), init_method_std=0.05)
    shapes = adapter_shapes(cfg)
    assert shapes["decoder.layers.0.self_attention.linear_proj.lora_A.weight"] == (4, 4 * 12)
    assert shapes["decoder.layers.1.self_attention.linear_qkv.lora_B.weight"] == (24 + 16 + 8, 4)
    assert set(EXPERT_FACTORS) <= set(shapes)
    model = registry.for_config(cfg).build(cfg)
    rng = np.random.default_rng(5)
    arrays = {n: (rng.normal(0, 0.2, shapes[n]).astype(np.float32) if n in shapes else ops.to_numpy(p))
              for (_, p), n in zip(nn.named_parameters(model), model.parameter_names())}
    assert sorted(n for n in arrays if lora.is_adapter(n)) == sorted(shapes)
    ids = np.arange(10, 70, dtype=np.int64)[None]
    logits = []
    for c, state in ((cfg, arrays), (dataclasses.replace(cfg, lora=None), _folded(cfg, arrays))):
        m = registry.for_config(c).build(c)
        load_whole_state(m, {k: np.asarray(v, np.float32) for k, v in state.items()})
        logits.append(ops.to_numpy(m(ops.tensor(ids))).astype(np.float64))
    scale = np.abs(logits[0]).max()
    assert np.abs(logits[0] - logits[1]).max() <= 1e-5 * scale
    # in Megatron's layout at TP2 x EP2 (peft's names; the fused adapter whole on each TP rank) and back
    mcore.save(str(tmp_path / "mg"), 1, cfg, arrays, mcore.Layout(tp=2, ep=2))
    back = mcore.load(str(tmp_path / "mg")).state
    assert sorted(back) == sorted(arrays) and all(np.array_equal(back[n], arrays[n]) for n in arrays)
    merged_cfg, merged = lora.merge(cfg, arrays)  # what generation and conversion load
    for name, value in _folded(cfg, arrays).items():
        assert np.abs(merged[name] - value).max() <= 1e-6 * max(np.abs(value).max(), 1.0), name
    with pytest.raises(ValueError, match="linear_qkv target on multi-latent attention without a query latent"):
        dataclasses.replace(cfg, mla=dataclasses.replace(mla, q_lora_rank=None))


@pytest.mark.feature("lora-moe")
def test_the_experts_dense_path_takes_their_adapters():
    """A compiled step runs every token through every expert (Experts.dense): with adapters it
    equals the experts with their adapters folded in by this test."""
    from mindspeed_core.models.config import LoRAConfig, MoEConfig
    from mindspeed_core.models.moe import Experts

    cfg = ModelConfig(vocab_size=64, hidden_size=16, num_layers=2, num_attention_heads=2, ffn_hidden_size=24,
                      lora=LoRAConfig(r=4, alpha=8.0))
    moe = MoEConfig(num_experts=4, topk=2)
    experts, plain = Experts(cfg, moe), Experts(dataclasses.replace(cfg, lora=None), moe)
    rng = np.random.default_rng(3)
    state = {k: rng.normal(0, 0.3, tuple(v.shape)).astype(np.float32) for k, v in nn.state_dict(experts).items()}
    nn.load_state_dict(experts, state)
    folded = {k: v.astype(np.float64) for k, v in state.items() if not k.startswith("lora_")}
    for k in ("weight1", "weight2"):
        folded[k] += 2.0 * state[f"lora_A.{k}"].astype(np.float64) @ state[f"lora_B.{k}"].astype(np.float64)
    nn.load_state_dict(plain, {k: v.astype(np.float32) for k, v in folded.items()})
    tokens = ops.tensor(rng.standard_normal((6, 16)).astype(np.float32))
    combine = ops.tensor(rng.uniform(0, 1, (6, 4)).astype(np.float32))
    got, want = (ops.to_numpy(e.dense(tokens, combine)).astype(np.float64) for e in (experts, plain))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    bare = dict(state, **{k: np.zeros_like(v) for k, v in state.items() if k.startswith("lora_")})
    nn.load_state_dict(experts, bare)  # the adapters matter: without them the outputs are others
    assert np.abs(ops.to_numpy(experts.dense(tokens, combine)) - want).max() > 1e-2 * np.abs(want).max()


@pytest.mark.feature("lora")
@pytest.mark.feature("muon")
def test_muon_trains_the_adapters_as_matrices(runs, tmp_path):
    """LoRA with --optimizer muon: the adapters' factors are matrices and Muon updates them all
    (megatron-core's rule: every trained 2-D weight), the first step's zero gradient of each A
    factor (B starts at zero) included without a NaN; the loss falls and the base stays frozen."""
    said = train("--data-path", runs["data"], *LORA, "--load", runs["base"], "--train-iters", "4", "--optimizer",
                 "muon", "--save", str(tmp_path / "muon"), "--metrics-file", str(tmp_path / "muon.jsonl"))
    assert "optimizer: Muon for 16 matrices (" in said and "AdamW for 0 others" in said, said
    curve = losses(tmp_path / "muon.jsonl")
    assert all(np.isfinite(v) for v in curve.values()) and curve[4] < curve[1], curve
    base = checkpoint.load_model_arrays(runs["base"], 2)
    arrays, _, _ = checkpoint.load(str(tmp_path / "muon"), 4)
    assert all(np.array_equal(arrays[name], value) for name, value in base.items())
    assert all(np.abs(arrays[n]).max() > 0 for n in arrays if lora.is_adapter(n) and n.endswith("lora_B.weight"))
