"""Packed sequences: documents sharing a row attend only inside themselves and restart their
positions, so a packed row gives each document the logits it gets alone; the trainer's
reading of EOD tokens (Megatron's --reset-attention-mask / --reset-position-ids); and
`mindspeed preprocess --pack`, whose padded samples keep their padding out of the loss."""

from __future__ import annotations

import collections
import dataclasses
import json
import math

import numpy as np
import pytest

from mindspeed_core import cli, ops, random
from mindspeed_core.data import packing
from mindspeed_core.data.gpt_dataset import PAD, document_layout, unpad
from mindspeed_core.data.indexed import IndexedDataset
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.gpt import GPTModel, Tokens

EOD = 0


def _model(fused: bool, learned: bool):
    random.seed(3)
    cfg = ModelConfig(vocab_size=48, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=64, max_position_embeddings=32,
                      position_embedding_type="learned" if learned else "rope")
    cfg = dataclasses.replace(cfg, fused=frozenset({"attention"} if fused else ()))
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


def test_padding_stays_out_of_the_loss_of_a_packed_sample():
    """A pack of three documents padded to a sample: the loss is the mean over its real labels
    (the padding's none), each from the logits the document gets alone."""
    model = _model(False, False)
    g = np.random.default_rng(1)
    docs = [np.concatenate([g.integers(1, 48, n - 1), [EOD]]) for n in (5, 3, 6)]
    stream = np.concatenate(docs)
    sample = np.full((1, 21), PAD)
    sample[0, : len(stream)] = stream
    tokens, mask = unpad(sample, EOD)
    assert mask.sum() == len(stream) - 1 and (tokens != PAD).all()
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    positions, documents = document_layout(ids, EOD, True, True)
    got = float(ops.to_numpy(model.loss(ops.tensor(ids), ops.tensor(labels), Tokens(positions, documents, mask))))
    alone = np.concatenate([ops.to_numpy(model(ops.tensor(d[None])))[0] for d in docs]).astype(np.float64)
    logp = alone - np.log(np.exp(alone - alone.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        alone.max(-1, keepdims=True)
    want = -np.mean([logp[t, stream[t + 1]] for t in range(len(stream) - 1)])
    assert abs(got - want) < 1e-5 * want
    assert unpad(stream[None], EOD)[1] is None  # nothing padded, nothing masked


def test_best_fit_packs_hold_every_token_once():
    g = np.random.default_rng(2)
    lengths = [int(n) for n in g.integers(1, 40, 400)] + [95, 41, 40]  # two longer than a pack, one exact
    capacity = 40
    packs = packing.plan(lengths, capacity)
    seen = [np.zeros(n, int) for n in lengths]
    for pack in packs:
        assert 0 < sum(stop - start for _, start, stop in pack) <= capacity
        for i, start, stop in pack:
            seen[i][start:stop] += 1
    assert all((s == 1).all() for s in seen)
    assert len(packs) <= math.ceil(sum(lengths) / capacity) * 1.05 + 1  # nearly all full
    assert packing.plan(lengths, capacity) == packs


def test_preprocess_packs_whole_documents(tmp_path, capsys):
    g = np.random.default_rng(3)
    texts = ["".join(chr(97 + int(c)) for c in g.integers(0, 26, n)) for n in g.integers(1, 15, 60)]
    texts.append("z" * 40)  # longer than a sample of 16 + 1 tokens
    with open(tmp_path / "docs.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    prefix = str(tmp_path / "out" / "c")
    assert cli.main(["preprocess", "--input", str(tmp_path / "docs.jsonl"), "--output-prefix", prefix, "--append-eod",
                     "--pack", "--seq-length", "16"]) == 0
    out = capsys.readouterr().out
    assert "text: packed into" in out and "1 documents longer than a sample" in out, out
    plain, packed = IndexedDataset(prefix + "_text_document"), IndexedDataset(prefix + "_packed_text_document")
    assert all(len(packed.document(i)) <= 17 for i in range(packed.document_count))
    # the packs' sequences are the documents, the long one in sample-long pieces from its start
    want = collections.Counter(tuple(plain[i][k:k + 17].tolist()) for i in range(len(plain))
                               for k in range(0, len(plain[i]), 17))
    assert collections.Counter(tuple(packed[j].tolist()) for j in range(len(packed))) == want
    assert packed.document_count < 0.6 * len(plain)  # short documents really share samples

    assert cli.main(["preprocess", "--input", str(tmp_path / "docs.jsonl"), "--output-prefix", prefix, "--pack",
                     "--append-eod"]) == 2
    assert "--pack needs --seq-length" in capsys.readouterr().err
