"""Hugging Face interop: our models reproduce transformers' logits, and folders round-trip."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mindspeed_core import autograd, nn, ops
from mindspeed_core.compat import hf
from mindspeed_core.errors import CheckpointError
from mindspeed_core.models import router
from mindspeed_core.models.families.gpt_oss import dequantize_mxfp4

from conftest import hf_reference_process

HERE = pathlib.Path(__file__).resolve().parent
pytest.importorskip("transformers")
# Gemma 2 runs both of its matrix rows (its first layer's window, its soft-capping)
GEMMA2 = pytest.param("gemma2", marks=[pytest.mark.feature("sliding-window-attention"),
                                       pytest.mark.feature("logit-softcapping")])
# DeepSeek's multi-latent attention, with V2's MoE layers, V3's query latent and V3's MoE layers
MLA = [pytest.param("deepseek-v2", marks=pytest.mark.feature("multi-latent-attention")),
       pytest.param("deepseek-v3", marks=[pytest.mark.feature("multi-latent-attention"),
                                         pytest.mark.feature("hf-deepseek-v3-moe")]),
       pytest.param("minicpm3", marks=pytest.mark.feature("multi-latent-attention"))]
# GPT-OSS: attention sinks, its folder format (biased experts, interleaved gate/up), and the
# released MXFP4 experts dequantised
GPT_OSS = pytest.param("gpt-oss", marks=[pytest.mark.feature("attention-sinks"), pytest.mark.feature("hf-gpt-oss"),
                                         pytest.mark.feature("sliding-window-attention"), pytest.mark.feature("yarn")])
PHIMOE = pytest.param("phimoe", marks=[pytest.mark.feature("family-phimoe"), pytest.mark.feature("output-layer-bias"),
                                        pytest.mark.feature("longrope")])
GPT_OSS_MXFP4 = pytest.param("gpt-oss-mxfp4", marks=pytest.mark.feature("hf-gpt-oss"))
# MiniMax-M2: q/k norms over all heads, half of each head rotated, sigmoid routing with the expert bias
MINIMAX_M2 = pytest.param("minimax-m2", marks=pytest.mark.feature("family-minimax-m2"))
# Hunyuan-V3: sigmoid routing with the expert bias, scaled, beside a shared expert; a dense first layer
HY_V3 = pytest.param("hy-v3", marks=pytest.mark.feature("family-hy-v3"))
# sparse attention: DeepSeek-V3.2 (its indexer rotated in halves) and GLM-5 (in pairs, a layer sharing
# the top-k before it), each query keeping 6 of up to 24 keys
DSA = [pytest.param("deepseek-v32", marks=[pytest.mark.feature("family-deepseek-v32"),
                                           pytest.mark.feature("dsa-indexer")]),
       pytest.param("glm5", marks=[pytest.mark.feature("family-glm5"), pytest.mark.feature("dsa-indexer"),
                                   pytest.mark.feature("dsa-shared-topk")])]
# LongCat-Flash: two scaled latent attentions and a shortcut MoE a layer, zero-computation experts
LONGCAT = pytest.param("longcat-flash", marks=[pytest.mark.feature("family-longcat-flash"),
                                               pytest.mark.feature("moe-zero-experts"),
                                               pytest.mark.feature("mla-lora-scaling")])
# Qwen3-Next: gated DeltaNet over 80 tokens (two chunks) beside gated attention
QWEN3_NEXT = pytest.param("qwen3-next", marks=[pytest.mark.feature("gated-deltanet"),
                                                pytest.mark.feature("attention-output-gate")])
# Qwen3.5 (text), dense and MoE: its ungrouped projections
QWEN3_5 = [pytest.param(name, marks=[pytest.mark.feature("gated-deltanet"), pytest.mark.feature("attention-output-gate")])
           for name in ("qwen3.5", "qwen3.5-moe", "qwen3.5-vl")]
NAMES = ["llama", "llama3-rope", "llama-linear-rope-tied", "llama-yarn", "qwen2-yarn-mscale", "llama-dynamic-rope",
         "llama-attention-bias", "mistral", "mistral-sliding", "qwen2", "qwen2-sliding", "qwen3", "phi3-longrope",
         "phi3-partial-rotary", GEMMA2, "gemma3", "gpt2", "seed-oss", "mixtral", PHIMOE, "qwen2-moe", "qwen3-moe", *MLA,
         "glm4-moe", MINIMAX_M2, HY_V3, *DSA, LONGCAT,
         GPT_OSS, GPT_OSS_MXFP4, QWEN3_NEXT, *QWEN3_5]


_reference_process = hf_reference_process


@pytest.fixture(scope="module")
def references(hf_references):
    return hf_references


# our logits against transformers', relative to the largest logit (hf_reference.py's weights of
# spread 0.2 give logits of ~6); the errors measured are float32 rounding, at most 3.8e-6 on
# PyTorch and 7.5e-6 on MindSpore (both Gemma 2's soft-capped logits)
TOLERANCE = 2e-5


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(references, name):
    """Over 24 tokens (past every original context: dynamic NTK's base grows, LongRoPE's long
    factors act; Phi-3's first 12 tokens on its short ones). The same weights without each of
    the model's mechanisms (hf_reference.WITHOUT: a scaling, a window, soft-capping, sinks, the
    mscale, ...) give logits far outside the tolerance, so the comparison can see each one."""
    model = hf.load_model(str(references / name))
    ref = np.load(references / f"{name}.npz")
    scale = float(np.abs(ref["logits"]).max())
    assert scale > 1, scale  # logits of O(1) at least: a scale error is not lost in rounding
    for ids, want in (("ids", "logits"), ("short_ids", "short_logits")):
        if ids in ref.files:
            error = float(np.abs(ops.to_numpy(model(ops.tensor(ref[ids]))) - ref[want]).max()) / scale
            assert error < TOLERANCE, (want, error)
    for without in (k for k in ref.files if k.startswith("without ")):
        distance = float(np.abs(ref[without] - ref["logits"]).max()) / scale
        assert distance > 100 * TOLERANCE, (without, distance)


@pytest.mark.feature("greedy-generation")
@pytest.mark.feature("kv-cache")
@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2", "llama-dynamic-rope", "phi3-longrope", PHIMOE, GEMMA2,
                                  "gemma3", "mistral-sliding", "seed-oss", *MLA, "glm4-moe", GPT_OSS, QWEN3_NEXT,
                                  QWEN3_5[0], MINIMAX_M2, HY_V3, *DSA, LONGCAT])
def test_greedy_generation_matches_transformers(references, name):
    """transformers' generate() (greedy, with its cache) on a batch whose second prompt is
    padded on the left; dynamic NTK past max_position_embeddings as the sequence grows;
    LongRoPE's long factors once the sequence passes its original length (the cache computed
    again with them, as transformers' Phi-3 does); Gemma 2's and Gemma 3's
    windows sliding over the cache (Gemma 3's sliding layers on their own RoPE); DeepSeek's
    cache of latents (DeepSeek-V3.2's and GLM-5's with their indexers' keys, the sequence past the
    6 keys each query keeps); GPT-OSS's sinks beside a padded row's hidden keys; Qwen3-Next's linear
    layers decoding from the state their prefill left (padding zeroed first). Where the matrix has
    compiled-decode, the decode steps run as one graph (even for these 8 tokens)."""
    from mindspeed_core.models import compiled_decode
    from mindspeed_core.models import generate as gen

    ref = np.load(references / f"{name}.npz")
    prompts = [ref["ids"][0][:12].tolist(), ref["ids"][1][3:12].tolist()]  # hf_reference.PROMPT, PAD
    model = hf.load_model(str(references / name))
    assert gen.generate(model, prompts, 8, compiled=True) == ref["generated"].tolist()
    if compiled_decode.eligible(model):  # the first of the 7 decode steps checked against eager, then 6 graph runs;
        # LongRoPE's switch (the 17th position: the 5th new token) runs as a prefill of the whole rows
        assert [g.steps for g in model.__dict__["_decode_graphs"].values()] == [5 if name == "phi3-longrope" else 6]


@pytest.mark.feature("beam-search")
@pytest.mark.parametrize("name", ["llama", "qwen3", "deepseek-v2"])
def test_beam_search_matches_transformers(references, name):
    """transformers' generate(num_beams=3) on the same folder: 8 tokens, beams ending at a token
    the greedy run draws third, with length penalty 1 and 0 (its output keeps the end token and
    pads after it; ours stops before it)."""
    from mindspeed_core.models import generate as gen

    ref = np.load(references / f"{name}.npz")
    model = hf.load_model(str(references / name))
    eos = int(ref["beam_eos"])
    for penalty in (1.0, 0.0):
        want = ref[f"beam_{penalty:g}"].tolist()
        want = want[:want.index(eos)] if eos in want else want
        got = gen.beam_search(model, ref["ids"][0][:12].tolist(), 8, num_beams=3, stop_ids=(eos,),
                              length_penalty=penalty)
        assert got == want, (penalty, got, want)


@pytest.mark.feature("multi-latent-attention")
def test_the_latent_cache_holds_the_latent_and_the_rotated_key(references):
    """DeepSeek's cache: kv_lora_rank + qk_rope_head_dim numbers a token and layer (16 + 4
    here), against 2 x heads x head dim (2 x 4 x 12) a GQA layer of these heads would keep."""
    from mindspeed_core.models import generate as gen

    model = hf.load_model(str(references / "deepseek-v2"))
    steps = gen._Steps(model, [[5, 6, 7]], 2, True)
    steps.logits()
    mla, layers = model.cfg.mla, model.cfg.num_layers
    assert steps.cache.values_per_token() == layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) == 2 * 20
    print("cache numbers a token:", steps.cache.values_per_token(), "| multi-head keys and values:",
          layers * 2 * model.cfg.num_attention_heads * mla.qk_head_dim)


EXPORTED = ["llama", "llama-attention-bias", "qwen3", "gpt2", "seed-oss", "mixtral", "phimoe", "qwen2-moe", "qwen2-yarn-mscale",
            "phi3-longrope", "phi3-partial-rotary", "gemma2", "gemma3", "mistral-sliding", "qwen2-sliding",
            "deepseek-v2", "deepseek-v3", "glm4-moe", "minicpm3", "gpt-oss", "qwen3-next", "qwen3.5", "qwen3.5-moe",
            "qwen3.5-vl", "minimax-m2", "hy-v3", "deepseek-v32", "glm5", "longcat-flash"]


@pytest.fixture(scope="module")
def exported(references, tmp_path_factory):
    """Each of EXPORTED loaded and saved again by us (llama in several shards), then loaded by
    transformers in one process, which writes its logits beside each folder. On MindSpore
    llama only goes through transformers: the files are the ones PyTorch writes (the same
    arrays, asserted on both frameworks)."""
    from conftest import FRAMEWORK

    root = tmp_path_factory.mktemp("exported")
    check = []
    for name in EXPORTED:
        hf.save_model(hf.load_model(str(references / name)), str(root / name),
                      max_shard_bytes=60_000 if name == "llama" else None)
        if FRAMEWORK == "pytorch" or name == "llama":
            np.save(root / f"{name}-ids.npy", np.load(references / f"{name}.npz")["ids"])
            check += [str(root / name), str(root / f"{name}-ids.npy"), str(root / f"{name}-logits.npy")]
    _reference_process("--check", *check)
    return root


@pytest.mark.parametrize("name", EXPORTED)
def test_export_round_trip_is_exact_and_loads_in_transformers(framework, references, exported, name):
    cfg, state = hf.load_folder(str(references / name))
    out = exported / name
    if name == "llama":
        assert (out / "model.safetensors.index.json").exists()
    cfg2, state2 = hf.load_folder(str(out))
    assert cfg2 == cfg
    assert sorted(state2) == sorted(state)
    for key in state:
        np.testing.assert_array_equal(state2[key], state[key])
    if framework == "mindspore" and name != "llama":
        return
    ref = np.load(references / f"{name}.npz")
    np.testing.assert_allclose(np.load(exported / f"{name}-logits.npy"), ref["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.feature("hf-gpt-oss")
def test_mxfp4_experts_are_read_as_transformers_dequantises_them(references):
    """The released GPT-OSS layout: each expert weight as MXFP4 blocks and scales (made here by
    rounding a random model's experts); the reference model holds what transformers'
    dequantiser makes of them. Ours reads the same numbers, and writes floats back."""
    cfg, state = hf.load_folder(str(references / "gpt-oss-mxfp4"))
    with open(references / "gpt-oss-mxfp4" / "config.json") as fh:
        assert json.load(fh)["quantization_config"]["quant_method"] == "mxfp4"
    out = hf.to_hf_state(cfg, state)
    assert "model.layers.0.mlp.experts.gate_up_proj" in out and not any(k.endswith("_blocks") for k in out)
    weights = state["decoder.layers.0.mlp.experts.weight1"]
    # every value a small float times a power of two: at most 4 significant bits
    mantissa, _ = np.frexp(weights)
    assert np.array_equal(mantissa * 16, np.round(mantissa * 16))
    with pytest.raises(CheckpointError, match="MXFP4 blocks"):
        dequantize_mxfp4(np.zeros((2, 3, 4), np.uint8), np.zeros((2, 3), np.uint8))


@pytest.mark.feature("sparsemixer-training")
def test_phimoe_trains_with_sampled_routing_and_heuns_estimator_as_transformers(references, tmp_path, monkeypatch):
    """Phi-3.5-MoE in training mode, with transformers' draws (hf_reference.sparsemixer_training:
    thresholds wide enough that each choice has several candidates): the logits and the
    gradients of sum(logits x probe) at the routers and the embedding equal transformers'. The
    same model routing as in evaluation gives other logits, and plain autograd of the scaled
    weights (no estimator) other router gradients, both far outside the tolerances."""
    ref = np.load(references / "phimoe.npz")
    folder = tmp_path / "phimoe"
    shutil.copytree(references / "phimoe", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(router_jitter_noise=float(ref["train_eps"]), input_jitter_noise=0.0)
    (folder / "config.json").write_text(json.dumps(config))
    model = hf.load_model(str(folder))
    nn.set_training(model, True)
    layers = iter(range(len(ref["train_router_grads"])))
    monkeypatch.setattr(router, "sparsemixer_draws", lambda t, e: (lambda i: router.SparseMixerDraws(
        ref["train_exponential"][i], ref["train_uniform"][i]))(next(layers)))
    params = dict(nn.named_parameters(model))
    routers = [params[f"decoder.layers.{i}.mlp.router.weight"] for i in range(len(ref["train_router_grads"]))]
    out = {}

    def loss():
        out["logits"] = model(ops.tensor(ref["ids"]))
        return ops.sum(out["logits"] * ops.tensor(ref["train_probe"].astype(np.float32)))

    _, grads = autograd.value_and_grad(loss, [*routers, params["embedding.word_embeddings.weight"]])()
    scale = float(np.abs(ref["train_logits"]).max())
    assert float(np.abs(ops.to_numpy(out["logits"]) - ref["train_logits"]).max()) / scale < TOLERANCE
    router_grads = np.stack([ops.to_numpy(g) for g in grads[:-1]])
    grad_scale = float(np.abs(ref["train_router_grads"]).max())
    # measured: 1.5e-6 (PyTorch) and 3.4e-6 (MindSpore) of the largest gradient
    assert float(np.abs(router_grads - ref["train_router_grads"]).max()) / grad_scale < TOLERANCE
    assert float(np.abs(ops.to_numpy(grads[-1]) - ref["train_embedding_grad"]).max()) \
        / float(np.abs(ref["train_embedding_grad"]).max()) < TOLERANCE
    without = float(np.abs(ref["train_router_grads_without_estimator"] - ref["train_router_grads"]).max()) / grad_scale
    assert without > 100 * TOLERANCE, without
    nn.set_training(model, False)
    evaluated = ops.to_numpy(model(ops.tensor(ref["ids"])))
    assert float(np.abs(evaluated - ref["train_logits"]).max()) / scale > 100 * TOLERANCE


def test_a_mixtral_folder_starts_a_training_run_with_its_experts(references, capsys):
    from mindspeed_core import cli

    assert cli.main(["train", "--load-hf", str(references / "mixtral"), "--tokenizer-type", "NullTokenizer",
                     "--vocab-size", "95", "--seq-length", "16", "--data-path", "/nonexistent/corpus", "--dry-run"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["model"]["family"] == "mixtral" and described["model"]["moe"]["num_experts"] == 4


def test_bad_folders_are_clear_errors(references, tmp_path):
    with pytest.raises(CheckpointError, match="cannot read"):
        hf.load_folder(str(tmp_path))
    bad = tmp_path / "bert"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(CheckpointError, match="not supported"):
        hf.load_folder(str(bad))
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((references / "gpt2" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        hf.load_folder(str(partial))


@pytest.mark.parametrize("change, key", [
    ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, "rope_scaling.rope_type 'proportional'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling.short_factor must be a list"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}}, "rope_scaling.beta_fast must be a positive"),
    ({"rope_scaling": {"rope_type": "dynamic"}}, "rope_scaling.factor must be a positive number"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor must be a positive number"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config: quant_method 'fp8'"),
])
def test_unsupported_configs_are_refused_naming_the_key(references, tmp_path, change, key):
    """Refused naming the config key and its value; from the command line (once): exit 2 and
    that one line."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = {**json.loads((references / "llama" / "config.json").read_text()), **change}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=key.replace("(", "\\(")):
        hf.load_config(str(folder))
    if "proportional" not in key:
        return  # the command line's way of saying it, once: a process start is most of this test
    out = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", "train", "--load-hf", str(folder), "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and key in out.stderr and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.parametrize("name, change, key", [
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise 0.1 is not supported"),
    ("qwen2-moe", {"shared_expert_intermediate_size": 0}, "needs a positive shared_expert_intermediate_size"),
    ("qwen3-moe", {"num_local_experts": None}, "has no 'num_experts'"),
    ("gpt-oss", {"swiglu_alpha": 1.5}, "swiglu_alpha 1.5 is not supported"),
])
def test_unsupported_moe_configs_are_refused(references, tmp_path, name, change, key):
    folder = tmp_path / "model"
    folder.mkdir()
    config = {**json.loads((references / name / "config.json").read_text()), **change}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=key):
        hf.load_config(str(folder))


def test_routers_transformers_cannot_express_are_not_exported():
    from mindspeed_core.models.config import ModelConfig, MoEConfig

    cfg = ModelConfig(family="qwen3_moe", moe=MoEConfig(num_experts=4, score_function="sigmoid"))
    with pytest.raises(CheckpointError, match="routes by softmax top-k only"):
        hf.hf_config(cfg)
    cfg = ModelConfig(family="mixtral", moe=MoEConfig(num_experts=4), moe_layers=[1])
    with pytest.raises(CheckpointError, match="MoE MLP in every layer"):
        hf.hf_config(cfg)
    cfg = ModelConfig(family="llama", moe=MoEConfig(num_experts=4))  # e.g. --num-experts on a llama preset
    with pytest.raises(CheckpointError, match="a llama model with MoE layers has no Hugging Face architecture"):
        hf.hf_config(cfg)


@pytest.mark.feature("noop-layers")
def test_noop_layers_are_dropped_on_export_and_the_function_is_kept(tmp_path):
    from mindspeed_core import random
    from mindspeed_core.models.config import ModelConfig
    from mindspeed_core.models.gpt import GPTModel

    random.seed(3)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4, ffn_hidden_size=64,
                      max_position_embeddings=16, noop_layers=(1, 3))
    model = GPTModel(cfg)
    assert model.parameter_names()[2].startswith("decoder.layers.0.") and any(
        n.startswith("decoder.layers.2.") for n in model.parameter_names())  # real layers keep their positions
    hf.save_model(model, str(tmp_path))
    loaded_cfg, _ = hf.load_folder(str(tmp_path))
    assert loaded_cfg.num_layers == 2 and loaded_cfg.noop_layers == ()
    ids = ops.tensor(np.arange(12).reshape(1, 12) % 64)
    np.testing.assert_array_equal(ops.to_numpy(hf.load_model(str(tmp_path))(ids)), ops.to_numpy(model(ids)))


@pytest.mark.feature("greedy-generation")
def test_generate_command_reads_a_hugging_face_folder(references, capsys):
    from mindspeed_core import cli
    from mindspeed_core.models import generate as gen

    ids = np.load(references / "llama.npz")["ids"][0].tolist()
    argv = ["generate", "--load-hf", str(references / "llama"), "--prompt", " ".join(map(str, ids)),
            "--max-new-tokens", "8", "--json"]
    capsys.readouterr()
    assert cli.main(argv) == 2 and "has no tokenizer.json" in capsys.readouterr().err
    # pre-tokenized prompts: NullTokenizer with the folder's 96 ids (95 the end of document)
    assert cli.main([*argv, "--tokenizer-type", "NullTokenizer", "--vocab-size", "95"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["ids"] == gen.generate(hf.load_model(str(references / "llama")), [ids], 8, stop_ids=(95,))[0]


def test_every_family_a_config_allows_is_built_and_exchanged():
    from mindspeed_core.models import registry
    from mindspeed_core.models.config import ModelConfig
    from mindspeed_core.models.families import FAMILIES

    assert sorted(f for spec in registry.SPECS for f in spec.families) == sorted(FAMILIES)
    with pytest.raises(ValueError, match="family must be one of"):
        ModelConfig(family="bogus")


@pytest.mark.framework_free
def test_each_family_is_one_room_the_registry_finds():
    """models/families/ holds every family's knowledge: compat/hf.py names no family or model
    type (it asks the family config.json's model_type picks), and each family's MindSpeed-LLM
    names, model types and presets resolve to it alone."""
    import pathlib

    from mindspeed_core.models import families

    source = (pathlib.Path(hf.__file__)).read_text()
    named = sorted(n for n in {*families.FAMILIES, *families.BY_MODEL_TYPE} if f'"{n}"' in source or f"'{n}'" in source)
    assert named == [], named
    assert len(families.FAMILIES) >= 16 and all(f.architecture and f.aliases for f in families.FAMILIES.values())
    types = [t for f in families.FAMILIES.values() for t in (f.model_types or (f.name,))]
    assert len(types) == len(set(types)) and set(types) == set(hf.SUPPORTED)
    for alias, name in {**families.ALIASES, **families.SPECS}.items():
        assert alias in families.get(name).aliases + families.get(name).specs
    assert all(families.PRESETS[p]["family"] in families.FAMILIES for p in families.PRESETS)
    assert families.moe_of("qwen3") == "qwen3_moe" and families.moe_of("llama") is None
    # MindSpeed-LLM's Phi-3.5-MoE pretraining line names phi3.5 (Phi-3.5-mini's converter name)
    assert families.named("phi3.5", moe=True) == "phimoe" and families.named("phi3.5", moe=False) == "phi3"
    assert families.named("qwen3", moe=True) == "qwen3" and families.named("nothing", moe=False) is None


def test_multi_token_prediction_layers_after_the_last_are_skipped_where_folders_carry_them(references):
    """GLM-4.5's and DeepSeek-V3's folders hold their multi-token prediction modules as layer
    num_hidden_layers (transformers does not read them): they are left out, not taken for a
    configuration that does not belong; another family's extra layer is still refused."""
    extra = {"model.layers.2.eh_proj.weight": np.zeros((64, 128), np.float32),
             "model.layers.2.enorm.weight": np.ones(64, np.float32)}
    for name in ("glm4-moe", "deepseek-v3"):
        cfg = hf.load_config(str(references / name))
        state = hf._read_tensors(str(references / name))
        assert sorted(hf.from_hf_state(cfg, {**state, **extra})) == sorted(hf.from_hf_state(cfg, state))
    cfg = hf.load_config(str(references / "llama"))
    with pytest.raises(CheckpointError, match="does not describe"):
        hf.from_hf_state(cfg, {**hf._read_tensors(str(references / "llama")), **extra})


@pytest.mark.feature("multi-token-prediction")
@pytest.mark.parametrize("name", ["deepseek-v3", "glm4-moe"])
def test_multi_token_prediction_modules_load_and_export(references, tmp_path, name, capsys):
    """With --mtp-num-layers, a folder's module k is read from layer num_hidden_layers + k (its
    norms, eh_proj, shared_head.norm and a whole layer, here an MoE one; the copies of the
    embedding and output layer it carries must be the model's own) and written there again;
    without it, the main model alone; a module missing or with a head of its own is refused."""
    import dataclasses

    from mindspeed_core import cli
    from test_convert import folder_with_mtp

    cfg, state = hf.load_folder(str(references / name))
    with_mtp = dataclasses.replace(cfg, mtp_num_layers=1)
    out = tmp_path / "out"
    want = folder_with_mtp(references / name, out)
    assert "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in want
    n = cfg.num_layers
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    tensors = hf._read_tensors(str(out))
    np.testing.assert_array_equal(tensors[f"model.layers.{n}.embed_tokens.weight"],
                                  want["embedding.word_embeddings.weight"])
    assert f"model.layers.{n}.mlp.gate.e_score_correction_bias" in tensors
    got_cfg, got = hf.load_folder(str(out), mtp_num_layers=1)
    assert got_cfg == with_mtp and sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    main_cfg, main = hf.load_folder(str(out))
    assert main_cfg == cfg and sorted(main) == sorted(state)
    own_head = {**tensors, f"model.layers.{n}.shared_head.head.weight": tensors["lm_head.weight"] + 1}
    with pytest.raises(CheckpointError, match="differs from the model's own output_layer"):
        hf.from_hf_state(with_mtp, own_head)
    with pytest.raises(CheckpointError, match="no multi-token prediction layer 0"):
        hf.load_folder(str(references / name), mtp_num_layers=1)
    assert cli.main(["train", "--load-hf", str(out), "--mtp-num-layers", "1", "--tokenizer-type", "NullTokenizer",
                     "--vocab-size", "95", "--seq-length", "16", "--data-path", "/nonexistent/corpus",
                     "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["mtp_num_layers"] == 1


def test_a_family_without_multi_token_prediction_layers_refuses_them(references):
    with pytest.raises(CheckpointError, match="llama folders hold no multi-token prediction layers"):
        hf.load_folder(str(references / "llama"), mtp_num_layers=1)


@pytest.mark.feature("mla-absorb")
@pytest.mark.parametrize("name", ["deepseek-v2", "deepseek-v3", "deepseek-v32", "longcat-flash"])
def test_absorbed_latent_attention_gives_transformers_logits_and_tokens(references, name):
    """--enable-mla-absorb: attention over the cached latent (each head's query and output through its
    slices of the up-projection) gives transformers' logits and greedy tokens: V2 without a query
    latent under YaRN's mscale, V3 with it, V3.2 with its indexer's choice, LongCat with scaled latents."""
    import dataclasses

    from mindspeed_core.models import generate as gen, registry
    from mindspeed_core.models.gpt import load_whole_state

    cfg, state = hf.load_folder(str(references / name))
    cfg = dataclasses.replace(cfg, fused=frozenset({"mla_absorb"}))
    model = registry.for_config(cfg).build(cfg)
    load_whole_state(model, state)
    nn.set_training(model, False)
    ref = np.load(references / f"{name}.npz")
    scale = float(np.abs(ref["logits"]).max())
    error = float(np.abs(ops.to_numpy(model(ops.tensor(ref["ids"]))) - ref["logits"]).max()) / scale
    assert error < TOLERANCE, error
    prompts = [ref["ids"][0][:12].tolist(), ref["ids"][1][3:12].tolist()]
    assert gen.generate(model, prompts, 8) == ref["generated"].tolist()


def ling_v2_folder(glm: pathlib.Path, out: pathlib.Path) -> dict:
    """GLM-4.5's reference folder rewritten as Ling-V2's (its modeling_bailing_moe_v2.py's names and
    config keys): q, k and v fused as all query heads, then all key heads, then all value heads;
    the attention under ``attention.``; the router's bias ``expert_bias``; ``model.word_embeddings``."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((glm / "config.json").read_text())
    rope = config["rope_parameters"]
    ling = {"model_type": "bailing_moe", "architectures": ["BailingMoeV2ForCausalLM"],
            **{k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                      "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                                      "max_position_embeddings", "tie_word_embeddings", "hidden_act",
                                      "use_qk_norm", "first_k_dense_replace", "num_experts_per_tok", "n_group",
                                      "topk_group", "moe_intermediate_size", "routed_scaling_factor")},
            "rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"],
            "use_qkv_bias": config["attention_bias"], "use_bias": False, "num_experts": config["n_routed_experts"],
            "num_shared_experts": config["n_shared_experts"], "num_nextn_predict_layers": 0}
    tensors, glm_tensors = {}, load_file(str(glm / "model.safetensors"))
    for name, value in glm_tensors.items():
        name = name.replace("model.embed_tokens.", "model.word_embeddings.")
        for glm_name, ling_name in (("self_attn.o_proj.", "attention.dense."),
                                    ("self_attn.q_norm.", "attention.query_layernorm."),
                                    ("self_attn.k_norm.", "attention.key_layernorm."),
                                    ("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias")):
            name = name.replace(glm_name, ling_name)
        if ".self_attn.q_proj." in name:
            layer, kind = name.split(".self_attn.q_proj.")
            tensors[f"{layer}.attention.query_key_value.{kind}"] = np.concatenate(
                [glm_tensors[f"{layer}.self_attn.{x}_proj.{kind}"] for x in "qkv"])
        elif ".self_attn.k_proj." not in name and ".self_attn.v_proj." not in name:
            tensors[name] = value
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(ling))
    save_file(tensors, str(out / "model.safetensors"))
    return tensors


@pytest.mark.feature("family-ling-v2")
def test_a_ling_v2_folder_reads_as_glm45_under_its_own_names(references, tmp_path):
    """Ling-V2's folders (their modelling code outside transformers) are GLM-4.5's model under other
    names: GLM-4.5's reference rewritten with Ling-V2's names and keys gives transformers' GLM-4.5
    logits (its q/k/v biases, per-head q/k norms, RoPE on half of each head, grouped sigmoid routing
    with the expert bias beside a shared expert), and is written back tensor for tensor."""
    folder = tmp_path / "ling"
    tensors = ling_v2_folder(references / "glm4-moe", folder)
    cfg, state = hf.load_folder(str(folder))
    assert cfg.family == "bailing_moe_v2" and cfg.rotary_percent == 0.5 and cfg.moe.num_groups == 4
    model = hf.load_model(str(folder))
    ref = np.load(references / "glm4-moe.npz")
    scale = float(np.abs(ref["logits"]).max())
    error = float(np.abs(ops.to_numpy(model(ops.tensor(ref["ids"]))) - ref["logits"]).max()) / scale
    assert error < TOLERANCE, error
    back = hf.to_hf_state(cfg, state)
    assert sorted(back) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    written = hf.hf_config(cfg)
    assert (written["model_type"], written["architectures"], written["num_experts"], written["use_qkv_bias"],
            written["partial_rotary_factor"], written["n_group"]) == ("bailing_moe", ["BailingMoeV2ForCausalLM"], 8,
                                                                       True, 0.5, 4)
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    "architectures": ["BailingMoeForCausalLM"]}))
    with pytest.raises(CheckpointError, match="Ling-V1's are not"):
        hf.load_folder(str(folder))
    _preset_round_trip("tiny-ling-v2", tmp_path)


def _preset_round_trip(preset: str, tmp_path) -> None:
    """The family's preset written as its folder and read back gives the same logits."""
    from mindspeed_core import random
    from mindspeed_core.models import families, registry

    cfg = families.preset(preset, vocab_size=96)
    random.seed(0)
    model = registry.for_config(cfg).build(cfg)
    hf.save_folder(str(tmp_path / preset), cfg, nn.state_dict(model))
    ids = ops.tensor(np.random.default_rng(2).integers(0, 96, (2, 16)))
    np.testing.assert_allclose(ops.to_numpy(hf.load_model(str(tmp_path / preset))(ids)), ops.to_numpy(model(ids)),
                               rtol=0, atol=1e-6)


def plm_folder(reference: pathlib.Path, out: pathlib.Path) -> dict:
    """hf_reference's DeepSeek-V2 with PLM's MLP rewritten as a PLM folder (its modelling code's
    config keys; the gate's unused weights left out)."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((reference / "config.json").read_text())
    plm = {"model_type": "plm", "architectures": ["PLMForCausalLM"], "hidden_act": "relu2", "q_lora_rank": None,
           "rope_theta": config["rope_parameters"]["rope_theta"], "rope_scaling": None, "rope_interleave": True,
           **{k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "qk_nope_head_dim",
                                     "qk_rope_head_dim", "v_head_dim", "max_position_embeddings", "rms_norm_eps",
                                     "tie_word_embeddings", "attention_bias")}}
    tensors = {k: v for k, v in load_file(str(reference / "model.safetensors")).items() if ".mlp.gate_proj." not in k}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(plm))
    save_file(tensors, str(out / "model.safetensors"))
    return tensors


@pytest.mark.feature("family-plm")
@pytest.mark.feature("squared-relu")
def test_a_plm_folder_gives_the_logits_of_its_modelling_code(references, tmp_path):
    """PLM's folders (their modelling code outside transformers: DeepSeek-V2-Lite's latent attention
    without a query latent, RoPE on consecutive pairs, a squared-ReLU MLP without a gate, tied
    embeddings) give the logits of transformers' DeepSeek-V2 running that MLP, and are written back
    tensor for tensor; read with RoPE in halves or GELU between the projections the logits are far off."""
    folder = tmp_path / "plm"
    tensors = plm_folder(references / "plm-as-deepseek-v2", folder)
    cfg, state = hf.load_folder(str(folder))
    assert (cfg.family, cfg.activation, cfg.mla.q_lora_rank, cfg.mla.rope_interleave, cfg.tied_output) == \
        ("plm", "squared_relu", None, True, True)
    ref = np.load(references / "plm-as-deepseek-v2.npz")
    scale = float(np.abs(ref["logits"]).max())
    assert scale > 1
    model = hf.load_model(str(folder))
    error = float(np.abs(ops.to_numpy(model(ops.tensor(ref["ids"]))) - ref["logits"]).max()) / scale
    assert error < TOLERANCE, error
    back = hf.to_hf_state(cfg, state)
    assert sorted(back) == sorted(k for k in tensors if k != "lm_head.weight")
    for name in back:
        np.testing.assert_array_equal(back[name], tensors[name], err_msg=name)
    assert hf.hf_config(cfg)["hidden_act"] == "relu2" and hf.hf_config(cfg)["model_type"] == "plm"
    import dataclasses

    from mindspeed_core.models import registry
    from mindspeed_core.models.gpt import load_whole_state

    for wrong in (dict(mla=dataclasses.replace(cfg.mla, rope_interleave=False)), dict(activation="gelu")):
        other = dataclasses.replace(cfg, **wrong)
        misread = registry.for_config(other).build(other)
        load_whole_state(misread, state)
        distance = float(np.abs(ops.to_numpy(misread(ops.tensor(ref["ids"]))) - ref["logits"]).max()) / scale
        assert distance > 100 * TOLERANCE, (wrong, distance)
    _preset_round_trip("tiny-plm", tmp_path)
