"""Gated DeltaNet (models/gated_deltanet.py): the chunked form equals the recurrent one and a
float64 reference of the delta rule, values and gradients, at every chunk size; the layer
decoding token by token from its cache equals its forward over the whole sequence. Against
transformers (a Qwen3-Next folder's logits and greedy generation): test_hf.py."""

from __future__ import annotations

import numpy as np
import pytest

from mindspeed_core import autograd, cli, nn, ops
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.gated_deltanet import GatedDeltaNet, causal_conv, chunk_rule, recurrent_rule
from mindspeed_core.models.gpt import Tokens
from mindspeed_core.models.kv_cache import KVCache

B, S, H, DK, DV = 2, 37, 3, 8, 6


def _inputs(seed: int = 0):
    """q, k unit vectors, v, log-decays of 0.9..1 a token (the state outlives a chunk), beta in
    (0, 1), and a starting state: float64 numpy."""
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(B, S, H, DK)) for _ in range(2))
    q, k = q / np.linalg.norm(q, axis=-1, keepdims=True), k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, S, H, DV))
    g = np.log(rng.uniform(0.9, 1.0, size=(B, S, H)))
    beta = rng.uniform(0.05, 0.95, size=(B, S, H))
    state = rng.normal(size=(B, H, DK, DV))
    return q, k, v, g, beta, state


def _reference(q, k, v, g, beta, state):
    """The delta rule token by token in float64 (the module docstring's formula)."""
    out = np.zeros(v.shape)
    state = state.copy()
    for t in range(q.shape[1]):
        state = state * np.exp(g[:, t])[..., None, None]
        predicted = np.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + np.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t][..., None] * (v[:, t] - predicted))
        out[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t]) / np.sqrt(q.shape[-1])
    return out, state


def _tensors(*arrays):
    return [ops.tensor(np.ascontiguousarray(a, dtype=np.float32)) for a in arrays]


@pytest.mark.feature("gated-deltanet")
@pytest.mark.parametrize("chunk", [1, 8, 16, 64])
def test_the_chunked_rule_equals_the_recurrent_one_and_float64(chunk):
    """37 tokens: several chunks and a partial last one (64: one chunk, mostly padding)."""
    arrays = _inputs()
    want, want_state = _reference(*arrays)
    scale = np.abs(want).max()
    for rule in (lambda *a: chunk_rule(*a[:5], chunk_size=chunk, state=a[5]), recurrent_rule):
        out, state = rule(*_tensors(*arrays))
        assert np.abs(ops.to_numpy(out) - want).max() / scale < 2e-5
        assert np.abs(ops.to_numpy(state) - want_state).max() / np.abs(want_state).max() < 2e-5
    # the decay and the delta's correction both matter at this size (a rule without them is far off)
    no_decay, _ = _reference(*arrays[:3], np.zeros_like(arrays[3]), *arrays[4:])
    plain = _reference(*arrays[:4], np.ones_like(arrays[4]) * 1e-9, arrays[5])[0]
    assert np.abs(no_decay - want).max() / scale > 0.1 and np.abs(plain - want).max() / scale > 0.1


@pytest.mark.feature("gated-deltanet")
def test_the_chunked_rule_differentiates_as_the_recurrent_one():
    """Gradients of a weighted sum of the outputs with respect to every input: the chunks'
    triangular solve and carried state differentiate as the token-by-token rule does."""
    arrays = _inputs(1)
    params = [nn.Parameter(np.ascontiguousarray(a, dtype=np.float32)) for a in arrays]
    weights = ops.tensor(np.random.default_rng(2).normal(size=(B, S, H, DV)).astype(np.float32))

    def loss_of(rule):
        return lambda: ops.sum(rule(*params)[0] * weights)

    _, chunked = autograd.value_and_grad(loss_of(lambda *a: chunk_rule(*a[:5], chunk_size=8, state=a[5])), params)()
    _, stepped = autograd.value_and_grad(loss_of(recurrent_rule), params)()
    for name, a, b in zip("q k v g beta state".split(), chunked, stepped):
        a, b = ops.to_numpy(a), ops.to_numpy(b)
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), name


def test_the_convolution_streams_with_its_history():
    """Two calls, the second from the first's history, equal one call over both pieces; each
    output sees its own and the three earlier inputs."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 9, 5)).astype(np.float32)
    w = rng.normal(size=(5, 1, 4)).astype(np.float32)
    whole, _ = causal_conv(ops.tensor(x), ops.tensor(w))
    first, history = causal_conv(ops.tensor(x[:, :6]), ops.tensor(w))
    second, _ = causal_conv(ops.tensor(x[:, 6:]), ops.tensor(w), history)
    np.testing.assert_allclose(np.concatenate([ops.to_numpy(first), ops.to_numpy(second)], axis=1),
                               ops.to_numpy(whole), rtol=1e-6, atol=1e-6)
    padded = np.concatenate([np.zeros((2, 3, 5), np.float32), x], axis=1)
    want = sum(padded[:, j:j + 9] * w[:, 0, j] for j in range(4))
    np.testing.assert_allclose(ops.to_numpy(whole), want, rtol=1e-5, atol=1e-6)


@pytest.mark.feature("gated-deltanet")
def test_the_layer_decodes_from_its_cache_as_it_runs_the_whole_sequence():
    """A prefill of 21 tokens (chunks of 8) then 6 tokens one at a time, from the cache's
    convolution history and state: the outputs of one forward over all 27 (grouped value heads,
    2 per key head)."""
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_attention_heads=2, init_method_std=0.2,
                      linear_attention=dict(key_heads=2, value_heads=4, key_dim=8, value_dim=8, chunk_size=8))
    layer = GatedDeltaNet(cfg)
    x = ops.tensor(np.random.default_rng(4).normal(size=(2, 27, 32)).astype(np.float32))
    whole = ops.to_numpy(layer(x))
    assert np.abs(whole).max() > 0.1
    cache = KVCache(2, 27)
    pieces = []
    for start, stop in [(0, 21), *((t, t + 1) for t in range(21, 27))]:
        documents = np.ones((2, stop - start), np.int64)
        cache.begin(documents)
        pieces.append(ops.to_numpy(layer(x[:, start:stop], tokens=Tokens(documents=documents, cache=cache))))
        cache.end()
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), whole, rtol=1e-4, atol=1e-5 * np.abs(whole).max())


# MindSpeed-LLM's gated-DeltaNet flags (its pretrain_gated_deltanet_340M script, scaled down)
HYBRID = ["--spec", "mindspeed_llm.tasks.models.spec.qwen3_next_spec", "layer_spec", "--qk-layernorm",
          "--full-attention-interval", "3", "--mamba-d-conv", "4", "--mamba-expand", "1", "--linear-key-head-dim", "16",
          "--linear-num-key-heads", "2", "--linear-num-value-heads", "2", "--linear-value-head-dim", "16",
          "--partial-rotary-factor", "0.25", "--num-layers", "3", "--hidden-size", "64", "--ffn-hidden-size", "128",
          "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
          "--swiglu", "--add-rmsnorm-offset", "--disable-bias-linear", "--normalization", "RMSNorm",
          "--untie-embeddings-and-output-weights", "--mamba-chunk-size", "16", "--no-enable-linear-qkv",
          "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "4", "--lr", "3e-3",
          "--eval-iters", "0", "--sample-tokens", "0", "--no-progress", "--log-interval", "1"]


@pytest.mark.feature("gated-deltanet")
@pytest.mark.feature("mg2hf-convert")
@pytest.mark.feature("triton-gdn")
def test_the_flags_build_the_hybrid_and_it_trains(capsys, tmp_path):
    """Every third layer attends (gated, a quarter of each head rotated), the others are gated
    DeltaNet of the --linear-* widths; 12 steps on the embedded corpus lower the loss. As
    MindSpeed-LLM's script asks (--enable-mg2hf-convert --model-type-hf qwen3-next), each save
    also leaves a Hugging Face folder holding the checkpoint's very weights; its --use-triton-gdn
    runs the same composite chunked rule (the matrix: emulated)."""
    import json

    from mindspeed_core.compat import hf, megatron_args
    from mindspeed_core.training import checkpoint, configuration

    cfg = configuration.model_only(megatron_args.training_parser().parse_args(HYBRID))
    assert (cfg.family, cfg.linear_layers, cfg.attention_output_gate, cfg.rotary_dim) == ("qwen3_next", (0, 1), True, 4)
    assert (cfg.linear_attention.key_heads, cfg.linear_attention.value_dim, cfg.linear_attention.chunk_size) == (2, 16, 16)
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    assert cli.main(["train", *HYBRID, "--train-iters", "12", "--metrics-file", str(metrics), "--save", str(ckpt),
                     "--save-interval", "6", "--enable-mg2hf-convert", "--model-type-hf", "qwen3-next",
                     "--use-triton-gdn"]) == 0
    loss = [r["loss"] for r in map(json.loads, open(metrics)) if "loss" in r]
    assert len(loss) == 12 and loss[-1] < loss[0] - 0.5, loss
    assert sorted(p.name for p in ckpt.glob("mg2hf_*")) == ["mg2hf_iteration12", "mg2hf_iteration6"]
    folder_cfg, state = hf.load_folder(str(ckpt / "mg2hf_iteration12"))
    saved = checkpoint.load_model_arrays(str(ckpt), 12)
    assert folder_cfg.linear_layers == (0, 1) and sorted(state) == sorted(saved)
    assert all(np.array_equal(state[k], saved[k]) for k in saved)


@pytest.mark.parametrize("extra, says", [
    (["--tensor-model-parallel-size", "4"], "does not divide the linear attention's key heads (2)"),
    (["--context-parallel-size", "2"], "linear-attention-context-parallel"),
    (["--mamba-expand", "2"], "--mamba-expand 2"),
    (["--reset-attention-mask"], "packed sequences"),
    (["--mamba-chunk-size", "48"], "not a power of two"),
    (["--linear-num-value-heads", "3"], "do not divide among"),
])
def test_what_the_hybrid_cannot_do_yet_is_one_line(capsys, extra, says):
    code = cli.main(["check-args", *HYBRID, *extra])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_linear_flags_without_the_interval_are_refused(capsys):
    code = cli.main(["check-args", "--num-layers", "2", "--linear-key-head-dim", "16"])
    err = capsys.readouterr().err
    assert code == 2 and "--full-attention-interval" in err, err


@pytest.mark.feature("gated-deltanet")
@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-gated-deltanet", "tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_the_hybrid_presets_build_count_and_export(name, tmp_path):
    """Each preset builds, runs, holds the parameters its config counts (the planner's and the
    log's figure) and round-trips through its Hugging Face family exactly."""
    from mindspeed_core.compat import hf
    from mindspeed_core.models import registry
    from mindspeed_core.models.families import preset
    from mindspeed_core.models.gpt import whole_state

    cfg = preset(name)
    model = registry.for_config(cfg).build(cfg)
    assert sum(ops.numel(p) for p in nn.parameters(model)) == cfg.num_parameters()
    logits = ops.to_numpy(model(ops.tensor(np.arange(40).reshape(2, 20) % cfg.vocab_size)))
    assert np.isfinite(logits).all() and logits.shape == (2, 20, cfg.vocab_size)
    hf.save_model(model, str(tmp_path / name))
    cfg2, state = hf.load_folder(str(tmp_path / name))
    assert cfg2 == cfg
    assert all(np.array_equal(state[k], v) for k, v in whole_state(model).items())
    # a folder whose layer_types do not name every layer: one line
    import json

    from mindspeed_core.errors import CheckpointError

    config = json.loads((tmp_path / name / "config.json").read_text())
    config["layer_types"] = config["layer_types"][:-1]
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"layer_types must name {cfg.num_layers} layers"):
        hf.load_folder(str(tmp_path / name))
