"""RoPE scaling set by flags (MindSpeed-LLM's spellings) and the positions each scaling
allows; the tables themselves are checked against transformers' logits in test_hf.py."""

from __future__ import annotations

import numpy as np
import pytest

from mindspeed_core import ops
from mindspeed_core.compat.megatron_args import training_parser
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.gpt import GPTModel
from mindspeed_core.training import configuration
from test_training import SMALL, corpus, train  # noqa: F401  (corpus is a fixture)

TINY = dict(vocab_size=32, hidden_size=32, num_layers=1, num_attention_heads=2, ffn_hidden_size=64,
            max_position_embeddings=8)


def scaling_of(*flags):
    return configuration.model_config(training_parser().parse_args([*SMALL, *flags]), 300).rope_scaling


@pytest.mark.feature("yarn")
@pytest.mark.feature("rope-scaling-flags")
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


@pytest.mark.feature("yarn")
def test_a_run_trains_with_yarn_flags(capsys, corpus):  # noqa: F811
    code, out, err = train(capsys, *SMALL, "--data-path", corpus, "--train-iters", "2", "--rope-scaling-type", "yarn",
                           "--rope-scaling-factor", "4", "--rope-scaling-original-max-position-embeddings", "8")
    assert code == 0, err
