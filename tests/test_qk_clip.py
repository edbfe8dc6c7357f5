"""QK-clip (--qk-clip, training/qk_clip.py) on the selected framework: the measured logits, the
clip's exact effect on them, and a training run where it acts."""

from __future__ import annotations

import numpy as np
import pytest

from mindspeed_core import nn, ops, random
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.gpt import GPTModel
from mindspeed_core.training import qk_clip
from mindspeed_core.training.optimizer import AdamW
from test_training import corpus  # noqa: F401  (a fixture)


def _max_logits(model, ids) -> list:
    qk_clip.track([model])
    model(ids)
    found = [a.max_logits for a in qk_clip.attentions([model])]
    for a in qk_clip.attentions([model]):
        a.max_logits = None
    return found


@pytest.mark.feature("qk-clip")
def test_clipping_brings_each_groups_largest_logit_to_the_threshold():
    """GQA (4 query heads in 2 groups), RoPE, init wide enough for logits of O(10): after the clip
    (through AdamW's fp32 weights), the same tokens' first-layer logits of each group over the
    threshold shrink by threshold / its maximum, so its largest is the threshold, and the others
    stay; the clipped heads are counted."""
    random.seed(3)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=48, init_method_std=0.3)
    model = GPTModel(cfg)
    nn.set_training(model, True)
    ids = ops.tensor(np.random.default_rng(0).integers(0, 64, (2, 24)).astype(np.int64))
    before = _max_logits(model, ids)
    assert all(m.shape == (4,) for m in before) and max(m.max() for m in before) > 5.0, before
    threshold = float(np.median(np.concatenate(before)))  # some groups over it, some under
    named = [(n, p) for n, p in nn.named_parameters(model)]
    clip = qk_clip.QKClip(threshold, 0.5, clip=True)
    qk_clip.track([model])
    model(ids)
    stats = clip.after_step([model], AdamW(named, 1e-3), None)
    assert stats["max_attention_logit"] == pytest.approx(max(m.max() for m in before), rel=1e-6)
    after = _max_logits(model, ids)
    layer0 = after[0]  # the first layer's input is unchanged by the clip: its logits shrink exactly
    for group in range(2):
        was, now = before[0][2 * group:2 * group + 2], layer0[2 * group:2 * group + 2]
        if was.max() > threshold:
            np.testing.assert_allclose(now, was * threshold / was.max(), rtol=2e-5)
        else:
            np.testing.assert_allclose(now, was, rtol=1e-6)
    assert stats["qk_clipped_heads"] == 2 * sum(int(m.reshape(2, 2).max(1).__gt__(threshold).sum()) for m in before)


@pytest.mark.feature("qk-clip")
def test_training_with_qk_clip_logs_and_holds_the_logits(capsys, corpus, tmp_path):  # noqa: F811
    """A run whose logits grow (a high learning rate) logs its largest logit each step; with --qk-clip
    at a threshold under them the heads are clipped and the later steps' largest logits stay below
    the unclipped run's."""
    from test_training import SMALL, train

    flags = [*SMALL, "--data-path", corpus, "--train-iters", "5", "--lr", "3e-2", "--init-method-std", "0.2"]

    def run(name, *extra):
        metrics = tmp_path / f"{name}.jsonl"
        code, out, err = train(capsys, *flags, *extra, "--metrics-file", str(metrics))
        assert code == 0, err
        import json

        return [r for r in map(json.loads, open(metrics)) if "loss" in r], out

    logged, out = run("log", "--log-max-attention-logit")
    assert "| max attention logit " in out and "qk-clipped" not in out, out
    free = [r["max_attention_logit"] for r in logged]
    threshold = free[0] * 0.5
    clipped, out = run("clip", "--qk-clip", "--qk-clip-threshold", f"{threshold:.4f}")
    held = [r["max_attention_logit"] for r in clipped]
    assert held[0] == pytest.approx(free[0], rel=1e-5)  # the first step's forward ran before any clip
    assert all(r["qk_clipped_heads"] > 0 for r in clipped), clipped
    assert all(h < f for h, f in zip(held[1:], free[1:])), (held, free)
