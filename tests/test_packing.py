"""Packed sequences: documents sharing a row attend only inside themselves and restart their
positions, so a packed row gives each document the logits it gets alone; and the trainer's
reading of EOD tokens (Megatron's --reset-attention-mask / --reset-position-ids)."""

from __future__ import annotations

import numpy as np
import pytest

from mindspeed_core import ops, random
from mindspeed_core.data.gpt_dataset import document_layout
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.gpt import GPTModel, Tokens

EOD = 0


def _model(fused: bool, learned: bool):
    random.seed(3)
    cfg = ModelConfig(vocab_size=48, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=64, max_position_embeddings=32,
                      position_embedding_type="learned" if learned else "rope")
    cfg.fused = frozenset({"attention"} if fused else ())
    return GPTModel(cfg)


@pytest.mark.feature("flash-attention-varlen")
@pytest.mark.parametrize("fused", [True, False], ids=["flash-attn", "composite"])
@pytest.mark.parametrize("learned", [False, True], ids=["rope", "learned-positions"])
def test_a_packed_row_gives_each_document_its_own_logits(fused, learned):
    model = _model(fused, learned)
    g = np.random.default_rng(0)
    docs = [np.concatenate([g.integers(1, 48, n - 1), [EOD]]) for n in (5, 3, 6)]
    row = np.concatenate(docs)[None]
    positions, documents = document_layout(row, EOD, True, True)
    packed = ops.to_numpy(model(ops.tensor(row), Tokens(positions, documents)))
    start = 0
    for doc in docs:
        alone = ops.to_numpy(model(ops.tensor(doc[None])))
        np.testing.assert_allclose(packed[:, start:start + len(doc)], alone, rtol=1e-5, atol=1e-5)
        start += len(doc)
    # and without the reset flags the documents do see each other
    mixed = ops.to_numpy(model(ops.tensor(row)))
    assert np.abs(mixed[:, 5:] - packed[:, 5:]).max() > 1e-3


def test_documents_end_at_each_eod():
    ids = np.array([[5, 5, EOD, 5, 5, 5, EOD, 5], [EOD, 1, 2, 3, EOD, EOD, 4, 4]])
    positions, documents = document_layout(ids, EOD, True, True)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 0, 0, 1]]
    assert documents.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 2, 3, 3]]
    assert document_layout(ids, EOD, False, False) == (None, None)
    positions, documents = document_layout(ids, EOD, False, True)
    assert positions is None and documents is not None
