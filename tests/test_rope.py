"""RoPE scaling set by flags (MindSpeed-LLM's spellings): a model from the flags is the model
from the equivalent Hugging Face config, and the positions each scaling allows; the tables
themselves are checked against transformers' logits in test_hf.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mindspeed_core import ops
from mindspeed_core.compat.megatron_args import training_parser
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.gpt import GPTModel
from mindspeed_core.training import configuration
from test_training import SMALL, corpus, losses, train  # noqa: F401  (corpus is a fixture)

TINY = dict(vocab_size=32, hidden_size=32, num_layers=1, num_attention_heads=2, ffn_hidden_size=64,
            max_position_embeddings=8)


def scaling_of(*flags):
    return configuration.model_config(training_parser().parse_args([*SMALL, *flags]), 300).rope_scaling


def test_flags_set_the_models_rope_scaling():
    assert scaling_of("--rope-scaling-type", "linear", "--rope-scaling-factor", "2") == {"rope_type": "linear",
                                                                                      "factor": 2.0}
    assert scaling_of("--rope-scaling-type", "llama3", "--rope-scaling-factor", "8", "--low-freq-factor", "1",
                      "--high-freq-factor", "4", "--original-max-position-embeddings", "16") == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}
    # DeepSeek's YaRN flags, both beta spellings
    assert scaling_of("--rope-scaling-type", "yarn", "--rope-scaling-factor", "40", "--beta-fast", "32",
                      "--rope-scaling-beta-slow", "1", "--rope-scaling-mscale", "1.0", "--rope-scaling-mscale-all-dim",
                      "1.0", "--rope-scaling-original-max-position-embeddings", "4096") == {
        "rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096}
    assert scaling_of("--rope-scaling-type", "dynamic", "--rope-scaling-factor", "2") == {"rope_type": "dynamic",
                                                                                       "factor": 2.0}
    # Phi-3.5's (pretrain_phi35_moe_ptd.sh): the factor lists comma-separated, both attention scales
    assert scaling_of("--rope-scaling-type", "longrope", "--longrope-freqs-type", "outer",
                      "--rope-scaling-original-max-position-embeddings", "4096", "--long-mscale", "1.24",
                      "--short-mscale", "1.24", "--long-factor", ",".join(["1.5"] * 8),
                      "--short-factor", ",".join(["1.02"] * 8)) == {
        "rope_type": "longrope", "original_max_position_embeddings": 4096, "long_mscale": 1.24, "short_mscale": 1.24,
        "long_factor": [1.5] * 8, "short_factor": [1.02] * 8}


@pytest.mark.parametrize("flags, message", [
    (["--rope-scaling-type", "linear"], "--rope-scaling-type linear: --rope-scaling-factor must be a positive number"),
    (["--rope-scaling-type", "llama3", "--rope-scaling-factor", "8"], "--low-freq-factor must be a positive number"),
    (["--rope-scaling-type", "yarn", "--rope-scaling-factor", "4"],
     "--rope-scaling-original-max-position-embeddings must be a positive number"),
    (["--rope-scaling-factor", "2"], "--rope-scaling-factor needs --rope-scaling-type"),
])
def test_incomplete_rope_flags_are_clear_errors(capsys, corpus, flags, message):  # noqa: F811
    with pytest.raises(MindSpeedError, match=message):
        configuration.model_config(training_parser().parse_args([*SMALL, *flags]), 300)
    code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "1", *flags)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_only_dynamic_ntk_goes_past_max_position_embeddings():
    ids = ops.tensor(np.arange(12)[None] % 32)
    with pytest.raises(ValueError, match="sequence length 12 exceeds max_position_embeddings 8"):
        GPTModel(ModelConfig(**TINY))(ids)
    for kind in ("linear", "yarn"):
        scaling = {"rope_type": kind, "factor": 2.0, "original_max_position_embeddings": 4}
        with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
            GPTModel(ModelConfig(**TINY, rope_scaling=scaling))(ids)
    dynamic = GPTModel(ModelConfig(**TINY, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    plain = GPTModel(ModelConfig(**TINY))
    from mindspeed_core import nn

    nn.load_state_dict(plain, nn.state_dict(dynamic))
    assert tuple(dynamic(ids).shape) == (1, 12, 32)
    # up to max_position_embeddings dynamic NTK is plain RoPE
    short = ops.tensor(np.arange(8)[None])
    np.testing.assert_array_equal(ops.to_numpy(dynamic(short)), ops.to_numpy(plain(short)))


FLAG_SCALINGS = {  # MindSpeed-LLM's flags and the Hugging Face rope_parameters they stand for
    "linear": (["--rope-scaling-factor", "2"], {"factor": 2.0}),
    "llama3": (["--rope-scaling-factor", "8", "--low-freq-factor", "1", "--high-freq-factor", "4",
                "--original-max-position-embeddings", "4"],
               {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 4}),
    "dynamic": (["--rope-scaling-factor", "2"], {"factor": 2.0}),
    "yarn": (["--rope-scaling-factor", "4", "--beta-fast", "8", "--rope-scaling-beta-slow", "2",
              "--rope-scaling-original-max-position-embeddings", "4"],
             {"factor": 4.0, "beta_fast": 8.0, "beta_slow": 2.0, "original_max_position_embeddings": 4}),
    # 8 positions past the original 4: the long factors
    "longrope": (["--long-factor", "1,1.5,2,2.5,3,3.5,4,4.5", "--short-factor", "1,1,1.1,1.1,1.2,1.2,1.3,1.3",
                  "--rope-scaling-original-max-position-embeddings", "4"],
                 {"long_factor": [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5],
                  "short_factor": [1.0, 1.0, 1.1, 1.1, 1.2, 1.2, 1.3, 1.3], "original_max_position_embeddings": 4}),
}
SIZES = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "64",
         "--max-position-embeddings", "8", "--seq-length", "8", "--make-vocab-size-divisible-by", "8",
         "--init-method-std", "0.3"]  # weights large enough for the positions to show in the logits


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.feature(k if k in ("yarn", "longrope") else
                                                                             "rope-scaling-flags"))
                                  for k in sorted(FLAG_SCALINGS)])
def test_a_model_from_the_flags_is_the_model_from_the_hugging_face_config(kind):
    """The same weights under the scaling the flags give and under the Hugging Face config's
    rope_parameters: the same logits (12 positions, past max_position_embeddings for dynamic
    NTK), and other logits than without scaling."""
    from mindspeed_core import nn
    from mindspeed_core.compat import hf

    flags, params = FLAG_SCALINGS[kind]
    from_flags = configuration.model_config(training_parser().parse_args(
        [*SIZES, "--rope-scaling-type", kind, *flags]), 32)
    rope_theta = from_flags.rotary_base
    from_hf = hf.config_from_hf({**hf.hf_config(dataclasses.replace(from_flags, rope_scaling=None)),
                                 "rope_parameters": {"rope_type": kind, "rope_theta": rope_theta, **params}})
    assert from_hf.rope_scaling is not None
    models = [GPTModel(c) for c in (from_flags, from_hf, dataclasses.replace(from_flags, rope_scaling=None))]
    for m in models[1:]:
        nn.load_state_dict(m, nn.state_dict(models[0]))
    length = 12 if kind == "dynamic" else 8
    ids = ops.tensor(np.arange(length)[None] % 32)
    logits = [ops.to_numpy(m(ops.tensor(np.arange(8)[None])) if length > 8 and m is models[2] else m(ids))
              for m in models]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-6)
    if kind != "dynamic":  # dynamic NTK is plain RoPE up to max_position_embeddings (the last test)
        assert np.abs(logits[0] - logits[2]).max() > 1e-2 * np.abs(logits[0]).max()


def test_rotary_percent_rotates_what_partial_rotary_factor_rotates():
    """--rotary-percent 0.5 (Megatron's) and a Hugging Face Phi-3 config's partial_rotary_factor
    0.5: the same logits, the first 8 of each head's 16 features rotated; other logits than
    with every feature rotated."""
    from mindspeed_core import nn
    from mindspeed_core.compat import hf

    from_flags = configuration.model_config(training_parser().parse_args([*SIZES, "--rotary-percent", "0.5"]), 32)
    assert (from_flags.kv_channels, from_flags.rotary_dim) == (16, 8)
    from_hf = hf.config_from_hf(hf.hf_config(dataclasses.replace(from_flags, family="phi3")))
    assert from_hf.rotary_percent == 0.5
    models = [GPTModel(c) for c in (from_flags, from_hf, dataclasses.replace(from_flags, rotary_percent=1.0))]
    for m in models[1:]:
        nn.load_state_dict(m, nn.state_dict(models[0]))
    logits = [ops.to_numpy(m(ops.tensor(np.arange(8)[None]))) for m in models]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-6, atol=1e-6)
    assert np.abs(logits[0] - logits[2]).max() > 1e-2 * np.abs(logits[0]).max()


@pytest.mark.feature("yarn")
def test_a_run_trains_with_yarn_flags(capsys, corpus, tmp_path):  # noqa: F811
    """The flags reach the trained model: the first loss is not the unscaled run's, and the run
    learns (the loss falls)."""
    runs = {}
    for name, flags in (("yarn", ["--rope-scaling-type", "yarn", "--rope-scaling-factor", "4",
                                  "--rope-scaling-original-max-position-embeddings", "8"]), ("plain", [])):
        code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "6", "--metrics-file",
                               str(tmp_path / f"{name}.jsonl"), *flags)
        assert code == 0, err
        runs[name] = losses(tmp_path / f"{name}.jsonl")
    assert sorted(runs["yarn"]) == list(range(1, 7))
    assert runs["yarn"][1] != runs["plain"][1]
    assert runs["yarn"][6] < runs["yarn"][1]
