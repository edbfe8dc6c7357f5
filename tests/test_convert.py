"""Weight conversion (mindspeed convert, compat/mcore.py, compat/torch_pickle.py): Hugging Face
<-> Megatron-core checkpoints with TP / PP / VPP / EP re-sharding, read without running code
from the files.

The Hugging Face models are transformers' own (hf_reference.py, random weights); the expected
Megatron names and shapes come from megatron-core itself (megatron_names.py). Loading a
converted checkpoint into a multi-process training run is in test_parallel.py.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from mindspeed_core import cli
from mindspeed_core.compat import hf, mcore, torch_pickle
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.tensor_files import HostTensor

HERE = os.path.dirname(os.path.abspath(__file__))
# --model-type-hf -> the hf_reference model it is checked on
ARCHITECTURES = {"llama2": "llama", "llama3": "llama3-rope", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral",
                 "phi3.5": "phi3-longrope", "gemma2": "gemma2", "gemma3": "gemma3",
                 "gpt2": "gpt2", "mixtral": "mixtral", "phi3.5-moe": "phimoe", "seed-oss": "seed-oss", "qwen2-moe": "qwen2-moe", "qwen3-moe": "qwen3-moe",
                 "deepseek2-lite": "deepseek-v2", "deepseek3": "deepseek-v3", "glm45": "glm4-moe",
                 "minicpm3": "minicpm3", "gpt-oss": "gpt-oss", "qwen3-next": "qwen3-next", "qwen3.5": "qwen3.5",
                 "minimax_m2": "minimax-m2", "HYV3": "hy-v3", "deepseek32": "deepseek-v32", "glm5": "glm5",
                 "longcat": "longcat-flash"}
MOE = ("mixtral", "phi3.5-moe", "qwen2-moe", "qwen3-moe", "deepseek2-lite", "deepseek3", "glm45", "gpt-oss", "qwen3-next",
       "minimax_m2", "HYV3", "deepseek32", "glm5", "longcat")


def convert(capsys, *flags, fails=False) -> str:
    code = cli.main(["convert", *flags])
    out = capsys.readouterr()
    if fails:
        assert code == 2 and len(out.err.strip().splitlines()) == 1, out.err
        return out.err
    assert code == 0, out.err
    return out.out


def hf_tensors(folder) -> dict:
    """A folder's tensors, less those transformers allocates and never reads: LongCat-Flash's gate and
    up rows of its zero-computation experts (read past, written back as zeros)."""
    cfg = hf.load_config(str(folder))
    unread = set()
    if cfg.moe is not None and cfg.moe.zero_experts:
        unread = {f"model.layers.{i}.mlp.experts.{e}.{kind}.weight" for i in range(cfg.num_layers)
                  for e in range(cfg.moe.num_experts, cfg.moe.slots) for kind in ("gate_proj", "up_proj")}
    return {k: v for k, v in hf._read_tensors(str(folder)).items() if k not in unread}


# ---- .pt files -----------------------------------------------------------------------------

def test_pt_files_round_trip_without_torch(tmp_path):
    """Written and read back in a process where torch cannot be imported."""
    script = f"""
import sys, argparse, numpy as np
sys.modules["torch"] = None  # any import of torch fails
from mindspeed_core.compat import torch_pickle
from mindspeed_core.tensor_files import HostTensor
obj = {{"model": {{"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": HostTensor(np.array([16320], np.uint16), "bfloat16")}},
       "iteration": 2**40, "args": argparse.Namespace(params_dtype=torch_pickle.TorchDType("bfloat16"), layers=[1, 2.5, None]),
       "flags": (True, False, "x")}}
torch_pickle.save({str(tmp_path / 'a.pt')!r}, obj)
back = torch_pickle.load({str(tmp_path / 'a.pt')!r})
assert np.array_equal(back["model"]["w"].array, obj["model"]["w"]) and back["model"]["b"].dtype == "bfloat16"
assert back["model"]["b"].array.tolist() == [16320] and back["iteration"] == 2**40 and back["flags"] == (True, False, "x")
assert back["args"].params_dtype == torch_pickle.TorchDType("bfloat16") and back["args"].layers == [1, 2.5, None]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_conversion_needs_no_framework(hf_references, tmp_path):
    """hf -> mg -> hf and mg -> mg in a process where neither torch nor MindSpore imports (a
    MindSpore-only install converts without torch, and nothing binds a framework)."""
    script = f"""
import sys
sys.modules["torch"] = sys.modules["mindspore"] = None
from mindspeed_core import cli
flags = ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]
assert cli.main(["convert", "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                 {str(hf_references / "qwen2-moe")!r}, "--save-dir", {str(tmp_path / "mg")!r}, *flags]) == 0
assert cli.main(["convert", "--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", {str(tmp_path / "mg")!r},
                 "--save-dir", {str(tmp_path / "mg2")!r}, "--target-expert-parallel-size", "2"]) == 0
assert cli.main(["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", {str(tmp_path / "mg2")!r},
                 "--save-dir", {str(tmp_path / "hf")!r}]) == 0
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    want, got = hf_tensors(hf_references / "qwen2-moe"), hf_tensors(tmp_path / "hf")
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.framework_free
def test_pt_files_are_what_torch_reads_and_writes(tmp_path):
    """torch.load reads what we write; we read what torch.save writes (views, bf16, Namespace)."""
    import argparse
    import collections

    import torch

    ours = {"model": collections.OrderedDict(w=np.arange(6, dtype=np.float32).reshape(2, 3),
                                             b=HostTensor(np.array([0x3FC0, 0x4000], np.uint16), "bfloat16")),
            "args": argparse.Namespace(params_dtype=torch_pickle.TorchDType("bfloat16")), "iteration": 7}
    torch_pickle.save(str(tmp_path / "ours.pt"), ours)
    back = torch.load(tmp_path / "ours.pt", weights_only=False)
    assert back["model"]["w"].tolist() == [[0, 1, 2], [3, 4, 5]] and back["args"].params_dtype is torch.bfloat16
    assert back["model"]["b"].dtype == torch.bfloat16 and back["model"]["b"].tolist() == [1.5, 2.0]
    theirs = {"t": torch.arange(12.0).reshape(3, 4).t(), "h": torch.ones(3, dtype=torch.float16), "n": 5,
              "a": argparse.Namespace(x=torch.float32)}
    torch.save(theirs, tmp_path / "theirs.pt")
    got = torch_pickle.load(str(tmp_path / "theirs.pt"))
    assert np.array_equal(got["t"].array, theirs["t"].numpy()) and got["h"].dtype == "float16"
    assert got["n"] == 5 and got["a"].x == torch_pickle.TorchDType("float32")


class _RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_would_run_a_command_is_refused(capsys, tmp_path):
    marker = tmp_path / "it-ran"
    folder = tmp_path / "mg" / "iter_0000001" / "mp_rank_00"
    folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / "model_optim_rng.pt", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"args": _RunsACommand(marker), "model": {}}, protocol=2))
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("1")
    err = convert(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(tmp_path / "mg"),
                  "--save-dir", str(tmp_path / "out"), "--model-type-hf", "llama2", fails=True)
    assert "refusing to load it: its pickle calls posix.system" in err or "calls os.system" in err, err
    assert not marker.exists()


# ---- Hugging Face <-> Megatron ----------------------------------------------------------------

@pytest.mark.feature("weight-conversion")
@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_hf_to_megatron_and_back_is_bit_exact(capsys, hf_references, tmp_path, model_type):
    """Each architecture at TP2 x PP2 (Mistral's one key/value head: TP1, as Megatron wants
    the heads divisible by TP); with two no-op layers added, over virtual pipeline stages of
    one layer; mixtures of experts over EP2 too (TP2 x EP2 x PP2). Each Megatron checkpoint
    back to Hugging Face gives the very tensors and config transformers saved (the vpp-noop one
    with its layout flags given again, as MindSpeed-LLM's export scripts give them)."""
    source = hf_references / ARCHITECTURES[model_type]
    cfg = hf.load_config(str(source))
    tp = 2 if cfg.num_query_groups % 2 == 0 else 1
    cut = ["--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", "2"]
    layouts = {"tp2-pp2": cut, "vpp-noop": [*cut, "--noop-layers", "1,3", "--num-layers-per-virtual-pipeline-stage", "1"]}
    if model_type in MOE:
        layouts["tp2-ep2-pp2"] = [*layouts["tp2-pp2"], "--target-expert-parallel-size", "2"]
        if tp == 2:  # megatron-core's ETP 1: whole experts, a file for each paired TP and EP rank
            layouts["tp2-ep2-pp2-etp1"] = [*layouts["tp2-ep2-pp2"], "--expert-tensor-parallel-size", "1"]
    want = hf_tensors(source)
    for name, flags in layouts.items():
        mg, back = tmp_path / f"{name}-mg", tmp_path / f"{name}-hf"
        out = convert(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", model_type,
                      "--load-dir", str(source), "--save-dir", str(mg), *flags)
        assert f"TP={tp}" in out and "PP=2" in out
        ranks = sorted(os.listdir(mg / "iter_0000000"))
        ep = 2 if "ep2" in name else 1
        assert ranks == [f"mp_rank_{t:02d}_{p:03d}" + (f"_{e:03d}" if ep > 1 else "")
                         for t in range(tp) for p in range(2) for e in range(ep) if "etp1" not in name or e == t], ranks
        if name == "vpp-noop":
            chunks = (cfg.num_layers + 2) // 2  # one layer per virtual stage over two stages
            assert sorted(torch_pickle.load(str(mg / "iter_0000000" / ranks[0] / "model_optim_rng.pt"))) == \
                ["args", "checkpoint_version", "iteration", *(f"model{c}" for c in range(chunks))]
        # the vpp-noop export names the layout again, as MindSpeed-LLM's export scripts do: a note, not a refusal
        again = flags if name == "vpp-noop" else []
        out = convert(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--model-type-hf", model_type,
                      "--load-dir", str(mg), "--save-dir", str(back), *again)
        assert ("a Hugging Face folder has none, so they are ignored" in out) == bool(again), out
        got = hf_tensors(back)
        assert sorted(got) == sorted(want), (name, set(got) ^ set(want))
        bad = [k for k in want if not np.array_equal(got[k], want[k])]
        assert not bad, (name, bad[:5])
        assert hf.load_config(str(back)) == hf.load_config(str(source)), name


@pytest.mark.feature("convert-expert-tensor-parallel")
def test_whole_experts_are_megatron_cores_etp1_layout_and_read_back(capsys, hf_references, tmp_path):
    """--expert-tensor-parallel-size 1 (MindSpeed-LLM's Qwen3-MoE 480B conversion line): files only
    for megatron-core's paired ranks (EP rank e with TP rank e mod TP; with EP 1 every TP rank),
    each holding its EP rank's experts whole beside its TP slice of the rest, args saying ETP 1.
    Read back (to TP1, to experts cut over TP2, and to Hugging Face) it is the source exactly; an
    mg -> mg conversion without the flag keeps the experts whole."""
    source = hf_references / "qwen3-moe"
    cfg = hf.load_config(str(source))
    f, h, heads = cfg.moe.ffn_hidden_size, cfg.hidden_size, cfg.num_query_groups * 2 + cfg.num_attention_heads
    want = hf_tensors(source)

    def to_mg(dest, *flags, load=source, kind="hf"):
        out = convert(capsys, "--load-model-type", kind, "--save-model-type", "mg", "--load-dir", str(load),
                      "--save-dir", str(tmp_path / dest), *flags)
        files = {n: torch_pickle.load(str(tmp_path / dest / "iter_0000000" / n / "model_optim_rng.pt"))
                 for n in sorted(os.listdir(tmp_path / dest / "iter_0000000"))}
        return out, files

    for ep, ranks in ((4, ["mp_rank_00_000", "mp_rank_00_002", "mp_rank_01_001", "mp_rank_01_003"]),
                      (1, ["mp_rank_00", "mp_rank_01"])):
        out, files = to_mg(f"etp1-ep{ep}", "--target-tensor-parallel-size", "2", "--target-expert-parallel-size",
                           str(ep), "--expert-tensor-parallel-size", "1", "--moe-grouped-gemm")
        assert "experts whole" in out and sorted(files) == ranks, (out, sorted(files))
        for name, state in files.items():
            model = state["model"]
            assert state["args"].expert_tensor_parallel_size == 1
            experts = sorted(k for k in model if ".mlp.experts.local_experts." in k and k.endswith("fc1.weight"))
            assert len(experts) == cfg.num_layers * cfg.moe.num_experts // ep, name
            assert all(model[k].array.shape == (2 * f, h) for k in experts), name  # whole: gate and up, not halves
            assert model["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"].array.shape == (h, f)
            qkv = model["decoder.layers.0.self_attention.linear_qkv.weight"].array
            assert qkv.shape[0] == heads * cfg.kv_channels // 2, name  # the dense layers still cut over TP2
        # EP rank 1's experts (experts 1 of 4, or 0..3 with EP 1) are the source's
        expert = 1 if ep == 4 else 3
        local = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"
        got = files[ranks[2] if ep == 4 else "mp_rank_01"]["model"][
            local if ep == 4 else local.replace("local_experts.0", f"local_experts.{expert}")].float32()
        assert np.array_equal(got, want[f"model.layers.1.mlp.experts.{expert}.down_proj.weight"])
    _, kept = to_mg("kept", load=tmp_path / "etp1-ep4", kind="mg")
    assert sorted(kept) == ["mp_rank_00_000", "mp_rank_00_002", "mp_rank_01_001", "mp_rank_01_003"]
    _, cut = to_mg("cut", "--expert-tensor-parallel-size", "2", load=tmp_path / "etp1-ep4", kind="mg")
    assert len(cut) == 8 and cut["mp_rank_01_003"]["model"][
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"].array.shape == (h, f // 2)
    _, one = to_mg("tp1", "--target-tensor-parallel-size", "1", "--target-expert-parallel-size", "1",
                   load=tmp_path / "etp1-ep4", kind="mg")
    assert sorted(one) == ["mp_rank_00"]
    for folder in ("etp1-ep4", "etp1-ep1", "kept", "cut", "tp1"):
        back = tmp_path / f"{folder}-hf"
        convert(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(tmp_path / folder),
                "--save-dir", str(back), "--model-type-hf", "qwen3-moe")
        got = hf_tensors(back)
        assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want), folder
    err = convert(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(source),
                  "--save-dir", str(tmp_path / "bad"), "--target-tensor-parallel-size", "2",
                  "--expert-tensor-parallel-size", "4", fails=True)
    assert "expert-tensor-parallel-other" in err


def folder_with_mtp(source, dest):
    """The Hugging Face folder ``source`` saved again with a fresh multi-token prediction module
    (as DeepSeek-V3's and GLM-4.5's carry theirs: layer num_hidden_layers); returns the whole
    model's state (our names)."""
    import dataclasses

    from mindspeed_core import nn, random
    from mindspeed_core.models import registry
    from mindspeed_core.models.gpt import whole_state

    cfg, state = hf.load_folder(str(source))
    cfg = dataclasses.replace(cfg, mtp_num_layers=1)
    random.seed(3)
    model = registry.for_config(cfg).build(cfg)
    nn.load_state_dict(model, {**whole_state(model), **state})
    hf.save_model(model, str(dest))
    return whole_state(model)


@pytest.mark.feature("weight-conversion")
@pytest.mark.feature("multi-token-prediction")
@pytest.mark.parametrize("model_type", ["deepseek3", "glm45", pytest.param("deepseek32", marks=pytest.mark.feature(
    "family-deepseek-v32"))])
def test_multi_token_prediction_modules_convert_to_megatron_and_back(capsys, hf_references, tmp_path, model_type):
    """MindSpeed-LLM's flags of its DeepSeek-V3, GLM-4.5 and DeepSeek-V3.2 conversion scripts at TP2
    x EP2 x PP2: the module sits on the last stage under MindSpeed-LLM's names (mtp.layers.0.*, its
    layer cut like a decoder layer, eh_proj cut by rows, mtp.final_layernorms.0, the model's own
    norm as final_layernorm, a copy of the embeddings; DeepSeek-V3.2's indexers whole on every TP
    rank, as self_attention.dsa_indexer.*), and comes back to the very tensors."""
    folder = tmp_path / "hf"
    folder_with_mtp(hf_references / ARCHITECTURES[model_type], folder)
    want = hf_tensors(folder)
    mg, back = tmp_path / "mg", tmp_path / "back"
    convert(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", model_type,
            "--load-dir", str(folder), "--save-dir", str(mg), "--target-tensor-parallel-size", "2",
            "--target-pipeline-parallel-size", "2", "--target-expert-parallel-size", "2",
            "--first-k-dense-replace", "1", "--mtp-num-layers", "1", "--moe-grouped-gemm")
    cfg = hf.load_config(str(folder))
    last = torch_pickle.load(str(mg / "iter_0000000" / "mp_rank_01_001_001" / "model_optim_rng.pt"))["model"]
    first = torch_pickle.load(str(mg / "iter_0000000" / "mp_rank_01_000_001" / "model_optim_rng.pt"))["model"]
    assert "final_layernorm.weight" in last and "decoder.final_layernorm.weight" not in last
    assert last["embedding.word_embeddings.weight"].array.shape == first["embedding.word_embeddings.weight"].array.shape
    assert last["mtp.layers.0.eh_proj.weight"].array.shape == (cfg.hidden_size // 2, 2 * cfg.hidden_size)
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.final_layernorms.0.weight",
            "mtp.layers.0.transformer_layer.mlp.router.weight",
            "mtp.layers.0.transformer_layer.mlp.experts.local_experts.0.linear_fc1.weight"} <= set(last)
    assert not any(k.startswith("mtp.") for k in first)
    if cfg.dsa is not None:
        for where, prefix in ((first, "decoder.layers.0."), (last, "mtp.layers.0.transformer_layer.")):
            assert where[prefix + "self_attention.dsa_indexer.wq_b.weight"].array.shape == (
                cfg.dsa.n_heads * cfg.dsa.head_dim, cfg.mla.q_lora_rank)
            assert where[prefix + "self_attention.dsa_indexer.k_norm.bias"].array.shape == (cfg.dsa.head_dim,)
    convert(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--model-type-hf", model_type,
            "--load-dir", str(mg), "--save-dir", str(back), "--first-k-dense-replace", "1", "--mtp-num-layers", "1")
    got = hf_tensors(back)
    assert sorted(got) == sorted(want), set(got) ^ set(want)
    assert not [k for k in want if not np.array_equal(got[k], want[k])]
    err = convert(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(mg),
                  "--save-dir", str(tmp_path / "x"), "--mtp-num-layers", "2", fails=True)
    assert "--mtp-num-layers 2, but" in err and "holds 1 multi-token prediction modules" in err
    err = convert(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(mg),
                  "--save-dir", str(tmp_path / "y"), "--first-k-dense-replace", "3", fails=True)
    assert "with 1 dense layers before its MoE layers" in err


@pytest.mark.feature("weight-conversion")
def test_megatron_resharding_round_trips_bit_exactly(capsys, hf_references, tmp_path):
    """mg -> mg without Hugging Face: TP2 x PP2 -> TP1 x PP4 -> TP2 x PP2 gives back every rank
    file's tensors; bf16 on the way keeps bf16 values exactly."""
    source = hf_references / "llama"
    flags = ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]
    convert(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(source), "--save-dir",
            str(tmp_path / "a"), "--noop-layers", "1,3", "--params-dtype", "bf16", *flags)
    convert(capsys, "--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", str(tmp_path / "a"),
            "--save-dir", str(tmp_path / "b"), "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size",
            "4")
    assert sorted(os.listdir(tmp_path / "b" / "iter_0000000")) == [f"mp_rank_00_{p:03d}" for p in range(4)]
    convert(capsys, "--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", str(tmp_path / "b"),
            "--save-dir", str(tmp_path / "c"), *flags)
    for rank in os.listdir(tmp_path / "a" / "iter_0000000"):
        first, again = (torch_pickle.load(str(tmp_path / x / "iter_0000000" / rank / "model_optim_rng.pt"))["model"]
                        for x in ("a", "c"))
        assert sorted(first) == sorted(again)
        for key, value in first.items():
            if value is None:
                assert again[key] is None
            else:
                assert value.dtype == "bfloat16" and np.array_equal(value.array, again[key].array), (rank, key)


def _megatron_config(cfg: ModelConfig) -> dict:
    """megatron-core's TransformerConfig arguments for our config."""
    out = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
               num_query_groups=cfg.num_query_groups, ffn_hidden_size=cfg.ffn_hidden_size, kv_channels=cfg.kv_channels,
               gated_linear_unit=cfg.gated, add_bias_linear=cfg.add_bias_linear,
               add_qkv_bias=cfg.add_qkv_bias, qk_layernorm=cfg.qk_layernorm,
               normalization="RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm")
    if cfg.attention_sinks:
        out["softmax_type"] = "learnable"
    if cfg.moe is not None:
        out.update(num_moe_experts=cfg.moe.num_experts, moe_router_topk=cfg.moe.topk,
                   moe_ffn_hidden_size=cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size)
        if cfg.moe.shared_expert_size:
            out.update(moe_shared_expert_intermediate_size=cfg.moe.shared_expert_size,
                       moe_shared_expert_gate=cfg.moe.shared_expert_gate)
    return out


@pytest.mark.framework_free
@pytest.mark.feature("weight-conversion")
def test_names_and_shapes_are_megatron_cores(capsys, hf_references, tmp_path):
    """Every rank file of a TP2 x PP2 conversion holds exactly the keys and shapes megatron-core's
    GPTModel has for that stage and tensor-parallel rank (its local layer spec, built on CPU):
    a dense GQA model with untied output, GPT-2 (LayerNorm, biases, learned positions, tied: the
    last stage's copy of the embeddings), Qwen3 (q/k norms), Qwen2-MoE (router, experts,
    gated shared expert) and GPT-OSS (attention sinks, the router's and experts' biases)."""
    from launch import free_port

    spec, ours = {"tp": 2, "port": str(free_port()), "models": {}}, {}
    for name in ("llama", "gpt2", "qwen3", "qwen2-moe", "gpt-oss"):
        cfg, _ = hf.load_folder(str(hf_references / name))
        mg = tmp_path / name
        convert(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf_references / name),
                "--save-dir", str(mg), "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
        half = cfg.num_layers // 2

        def extra(layers):  # which of the stage's layers are MoE layers (Qwen2-MoE's first is dense)
            return {"moe_layer_freq": [int(cfg.is_moe_layer(i)) for i in layers]} if cfg.moe is not None else {}

        spec["models"][name] = {"config": _megatron_config(cfg), "vocab": cfg.vocab_size, "tied": cfg.tied_output,
                                "position": "rope" if cfg.position_embedding_type == "rope" else "learned_absolute",
                                "stages": [[1, 0, half, extra(range(half))],
                                           [0, 1, cfg.num_layers - half, extra(range(half, cfg.num_layers))]]}
        ours[name] = {(t, p): torch_pickle.load(str(mg / "iter_0000000" / f"mp_rank_{t:02d}_{p:03d}" /
                                                    "model_optim_rng.pt"))["model"]
                      for t in range(2) for p in range(2)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_AI_FRAMEWORK"}
    out = subprocess.run([sys.executable, os.path.join(HERE, "megatron_names.py"), str(tmp_path / "spec.json"),
                          str(tmp_path / "names")], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    for t in range(2):
        theirs = json.load(open(tmp_path / f"names.{t}.json"))
        for name, stages in spec["models"].items():
            for p, (pre, post, layers, _) in enumerate(stages["stages"]):
                want = theirs[name][f"{pre}{post}{layers}"]
                got = {k: (list(v.array.shape) if v is not None else None) for k, v in ours[name][t, p].items()}
                assert got == want, (name, t, p, sorted(set(got) ^ set(want)),
                                     {k: (got[k], want[k]) for k in got if k in want and got[k] != want[k]})


@pytest.mark.framework_free
@pytest.mark.feature("weight-conversion")
def test_megatron_cores_gpt_model_reads_our_conversions_with_transformers_logits(capsys, hf_references, tmp_path):
    """megatron-core's own GPTModel (local spec, CPU, gloo; megatron_logits.py says what it
    stubs) loads the rank files our converter wrote from transformers' models, at TP1 and TP2,
    and runs their batch: its logits are transformers'. A layout both our writer and reader got
    wrong (q/k/v order in a group, gate/up order in fc1, a TP cut) would pass the round trip but
    not this. Dense Llama with GQA, Qwen2 (qkv bias, tied embeddings), Qwen3 (q/k norms), GPT-2
    (LayerNorm, biases, learned positions, tanh GELU) and Mixtral (experts; at TP2 also with its
    experts whole on each rank, megatron-core's ETP 1)."""
    from launch import free_port

    names = ("llama", "qwen2", "qwen3", "gpt2", "mixtral")
    worst = {}
    # and Mixtral's experts whole on each of the TP2 ranks (megatron-core's ETP 1, our --expert-tensor-parallel-size 1)
    for tp, etp in ((1, None), (2, None), (2, 1)):
        spec = {"tp": tp, "port": str(free_port()), "models": {}, **({"etp": etp} if etp else {})}
        run = f"tp{tp}" + (f"-etp{etp}" if etp else "")
        for name in (names if etp is None else ("mixtral",)):
            cfg, _ = hf.load_folder(str(hf_references / name))
            folder = tmp_path / f"{name}-{run}"
            convert(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                    str(hf_references / name), "--save-dir", str(folder), "--target-tensor-parallel-size", str(tp),
                    *(["--expert-tensor-parallel-size", str(etp)] if etp else []))
            np.save(tmp_path / f"{name}-ids.npy", np.load(hf_references / f"{name}.npz")["ids"])
            spec["models"][name] = {
                "config": {**_megatron_config(cfg), "layernorm_epsilon": cfg.norm_epsilon},
                "activation": cfg.activation, "vocab": -(-cfg.vocab_size // tp) * tp, "tied": cfg.tied_output,
                "position": "rope" if cfg.position_embedding_type == "rope" else "learned_absolute",
                "rotary_base": cfg.rotary_base, "folder": str(folder), "ids": str(tmp_path / f"{name}-ids.npy"),
                "out": str(tmp_path / f"{name}-{run}.npy")}
        (tmp_path / f"spec-{run}.json").write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_AI_FRAMEWORK"}
        out = subprocess.run([sys.executable, os.path.join(HERE, "megatron_logits.py"), str(tmp_path / f"spec-{run}.json")],
                             capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-4000:]
        for name in spec["models"]:
            want = np.load(hf_references / f"{name}.npz")["logits"]
            got = np.load(tmp_path / f"{name}-{run}.npy")[..., :want.shape[-1]]
            worst[name, run] = float(np.abs(got - want).max() / np.abs(want).max())
    assert max(worst.values()) < 1e-5, worst  # measured at most 3.5e-7


def test_foreign_args_give_the_same_model(capsys, hf_references, tmp_path):
    """A checkpoint written by Megatron has no mindspeed_model_config: the model is read from
    Megatron's own argument names (and --model-type-hf names the architecture)."""
    mg = tmp_path / "mg"
    convert(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf_references / "qwen2"),
            "--save-dir", str(mg), "--target-pipeline-parallel-size", "2")
    for rank in os.listdir(mg / "iter_0000000"):
        path = str(mg / "iter_0000000" / rank / "model_optim_rng.pt")
        state = torch_pickle.load(path)
        del state["args"].mindspeed_model_config
        torch_pickle.save(path, state)
    ckpt = mcore.load(str(mg))
    want = hf.load_config(str(hf_references / "qwen2"))
    assert not ckpt.exact and ckpt.cfg.family == "llama"
    same = {f: getattr(want, f) for f in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                                          "num_query_groups", "ffn_hidden_size", "kv_channels", "add_qkv_bias",
                                          "normalization", "activation", "untie_embeddings_and_output_weights")}
    assert {f: getattr(ckpt.cfg, f) for f in same} == same
    err = convert(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(mg), "--save-dir",
                  str(tmp_path / "x"), fails=True)
    assert "give --model-type-hf" in err


@pytest.mark.parametrize("flags, message", [
    (["--load-model-type", "hf", "--save-model-type", "mg", "--target-tensor-parallel-size", "4"],
     "does not divide the model's 2 key/value heads"),
    (["--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "qwen2"],
     "--model-type-hf qwen2, but"),
    (["--load-model-type", "hf", "--save-model-type", "mg", "--target-pipeline-parallel-size", "3"], "pipeline"),
    (["--load-model-type", "hf", "--save-model-type", "mg", "--target-expert-parallel-size", "2"],
     "applies to mixture-of-experts models"),
    (["--load-model-type", "hf", "--save-model-type", "hf"], "converts nothing"),
    (["--load-model-type", "mg", "--save-model-type", "hf", "--params-dtype", "bf16"],
     "sets a Megatron checkpoint's dtype"),
])
def test_mismatched_flags_are_one_line_errors(capsys, hf_references, tmp_path, flags, message):
    err = convert(capsys, *flags, "--load-dir", str(hf_references / "llama"), "--save-dir", str(tmp_path / "out"),
                  fails=True)
    assert message in err, err


def test_truncated_files_and_busy_folders_are_one_line_errors(capsys, hf_references, tmp_path):
    mg = tmp_path / "mg"
    convert(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf_references / "llama"),
            "--save-dir", str(mg), "--target-tensor-parallel-size", "2")
    err = convert(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                  str(hf_references / "llama"), "--save-dir", str(mg), fails=True)
    assert "is not empty" in err
    path = mg / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[:1000])
    err = convert(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(mg), "--save-dir",
                  str(tmp_path / "back"), fails=True)
    assert "is not a complete .pt file" in err and "mp_rank_01" in err, err
    path.unlink()
    err = convert(capsys, "--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", str(mg), "--save-dir",
                  str(tmp_path / "again"), fails=True)
    assert "mp_rank_01" in err, err


@pytest.mark.feature("weight-conversion")
def test_generation_from_a_megatron_folder_is_the_hugging_face_models(capsys, hf_references, tmp_path):
    """mindspeed generate --load takes a Megatron folder (here TP2 x PP2): the same greedy
    continuation as from the Hugging Face folder it was converted from."""
    mg = tmp_path / "mg"
    convert(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf_references / "qwen3"),
            "--save-dir", str(mg), "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
    common = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "95", "--prompt", "5 17 3 60", "--max-new-tokens",
              "6", "--json"]
    outputs = []
    for source in (["--load-hf", str(hf_references / "qwen3")], ["--load", str(mg)]):
        assert cli.main(["generate", *source, *common]) == 0
        outputs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6, outputs
