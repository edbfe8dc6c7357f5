"""Fine-tuning samples from instruction datasets (``mindspeed preprocess --handler-name
...InstructionHandler``, data/handlers.py).

``--data-path PREFIX`` names what the preprocessing's ``--output-prefix`` was: the samples are
in PREFIX_packed_input_ids_document and PREFIX_packed_labels_document, one document each,
or several conversations per document when packed (``--pack``: each conversation a sequence
of the document). A sample is padded to --seq-length + 1 tokens; its labels are IGNORE (-100)
where nothing is trained (prompts, padding). Splits (``--split``) are over documents and
blends (``--data-path 0.7 a 0.3 b``) interleave by weight, as pre-training data does.

Preference data (``...PairwiseHandler``) holds PREFIX_packed_{chosen,rejected}_{input_ids,labels}
_document: a sample is a pair, whose chosen and rejected conversations are read from the same
document number, so they stay together in every micro-batch (``pair_batch``).
"""

from __future__ import annotations

import os

import numpy as np

from mindspeed_core import features
from mindspeed_core.data.gpt_dataset import SPLITS, BlendedSamples, Shuffled, parse_data_path, split_ranges
from mindspeed_core.data.handlers import IGNORE
from mindspeed_core.data.indexed import IndexedDataset
from mindspeed_core.errors import MindSpeedError


# a preference pair's sides: the prefixes of its chosen and its rejected files
PAIR = ("chosen_", "rejected_")


def prompts_only(prefix: str) -> bool:
    """Whether ``prefix`` holds prompts without replies (PPOAlpacaStyleInstructionHandler's data)."""
    return (not os.path.isfile(f"{prefix}_packed_labels_document.idx")
            and os.path.isfile(f"{prefix}_packed_input_ids_document.idx"))


def _part(prefix: str, key: str) -> IndexedDataset:
    path = f"{prefix}_packed_{key}_document"
    if key == "labels" and prompts_only(prefix):
        raise MindSpeedError(f"{prefix} holds prompts without replies (PPOAlpacaStyleInstructionHandler): data for "
                             "online RL (--stage grpo), not for this stage")
    if not os.path.isfile(path + ".idx"):
        pairwise = key.startswith(PAIR)
        raise MindSpeedError(f"{path}.idx does not exist: {'a preference' if pairwise else 'an instruction'} "
                             "--data-path is the --output-prefix given to 'mindspeed preprocess --handler-name "
                             + ("AlpacaStylePairwiseHandler' (or SharegptStylePairwiseHandler)" if pairwise else
                                "AlpacaStyleInstructionHandler' (or another instruction handler)"))
    return IndexedDataset(path)


class InstructionSamples(Shuffled):
    """One sample per document of an instruction dataset, in a seeded order: (tokens, labels,
    documents), each [seq_length + 1] int64; ``documents`` numbers the conversations of a pack
    (0 without packing); the padding is -1."""

    def __init__(self, prefix: str, first: int, last: int, seq_length: int, seed: int, name: str, pad: int,
                 side: str = "", prompts: bool = False):
        # prompts: prompt-only data is welcome (its labels all IGNORE: online RL's prompts)
        self.ids = _part(prefix, side + "input_ids")
        self.labels = None if prompts and prompts_only(prefix) else _part(prefix, side + "labels")
        if self.labels is not None and (not np.array_equal(self.ids.lengths, self.labels.lengths)
                or not np.array_equal(self.ids.document_indices, self.labels.document_indices)):
            raise MindSpeedError(f"{prefix}: the input_ids and labels files describe different samples; "
                                 "preprocess again")
        self.first, self.seq_length, self.pad = first, seq_length, pad
        ends = np.concatenate([[0], np.cumsum(self.ids.lengths, dtype=np.int64)])[
            self.ids.document_indices[first:last + 1]]
        longest = int(np.diff(ends).max())
        if longest > seq_length + 1:
            raise MindSpeedError(f"{name} holds samples of up to {longest} tokens, longer than --seq-length "
                                 f"{seq_length} + 1: preprocess with --seq-length {seq_length} (longer samples are "
                                 f"dropped, or cut with --truncation cut), or train with a longer --seq-length")
        super().__init__(last - first, seed)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.document(self._sample(i))

    def document(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ``k``-th document of this split (0 <= k < count), in file order."""
        d = self.first + k
        a, b = int(self.ids.document_indices[d]), int(self.ids.document_indices[d + 1])
        n = self.seq_length + 1
        tokens, labels = np.full(n, self.pad, np.int64), np.full(n, IGNORE, np.int64)
        documents = np.full(n, -1, np.int64)
        at = 0
        for k, s in enumerate(range(a, b)):
            length = int(self.ids.lengths[s])
            tokens[at:at + length] = self.ids[s]
            if self.labels is not None:
                labels[at:at + length] = self.labels[s]
            documents[at:at + length] = k
            at += length
        return tokens, labels, documents


class PairSamples:
    """A preference pair per document: (chosen, rejected), each as InstructionSamples gives
    it; both sides are read in the same seeded order, so sample i is one pair."""

    def __init__(self, prefix: str, first: int, last: int, seq_length: int, seed: int, name: str, pad: int):
        self.sides = [InstructionSamples(prefix, first, last, seq_length, seed, name, pad, side) for side in PAIR]
        if not np.array_equal(self.sides[0].ids.document_indices, self.sides[1].ids.document_indices) or \
                self.sides[0].ids.document_count != self.sides[1].ids.document_count:
            raise MindSpeedError(f"{prefix}: the chosen and rejected files hold different pairs; preprocess again")

    @property
    def count(self) -> int:
        """The pairs of this split of the dataset."""
        return self.sides[0].count

    def pair_number(self, i: int) -> int:
        """Which of the ``count`` pairs sample ``i`` is (the seeded order, epoch after epoch)."""
        return self.sides[0]._sample(i)

    def __getitem__(self, i: int):
        return tuple(side[i] for side in self.sides)

    def pair(self, k: int):
        """Pair number ``k`` (0 <= k < count), whatever the order."""
        return tuple(side.document(k) for side in self.sides)


def build_splits(data_path: list[str], split: str, seq_length: int, seed: int, pad: int,
                 pairs: bool = False, shuffle: bool = True, prompts: bool = False) -> dict:
    """{"train": BlendedSamples | None, "valid": ..., "test": ...} of instruction samples, or
    with ``pairs`` of preference pairs (PairSamples); ``shuffle`` False: in file order;
    ``prompts``: prompt-only data (PPOAlpacaStyleInstructionHandler's) is read too."""
    blends = {name: [] for name in SPLITS}
    kind = PairSamples if pairs else InstructionSamples
    for weight, prefix in parse_data_path(data_path):
        count = _part(prefix, (PAIR[0] if pairs else "") + "input_ids").document_count
        for k, name in enumerate(SPLITS):
            a, b = split_ranges(count, split)[name]
            if b > a:
                order = seed + k if shuffle else None
                extra = {} if pairs else {"prompts": prompts}
                blends[name].append((weight, kind(prefix, a, b, seq_length, order, f"{prefix} ({name})", pad,
                                                  **extra)))
    if not blends["train"]:
        raise MindSpeedError("the training split is empty: check --data-path and --split")
    return {name: (BlendedSamples(parts) if parts else None) for name, parts in blends.items()}


def trimmed(rows: list, multiple: int | None) -> list:
    """Dynamic padding (--no-pad-to-seq-lengths): the samples (tokens, labels, documents) cut to
    the longest one's tokens rounded up to ``multiple`` (never longer than they are). Only
    padding goes: its labels are ignored and causal attention never lets a real token see it,
    so the loss is the same as at full length. ``multiple`` None: the rows as they are."""
    if multiple is None:
        return rows
    full = len(rows[0][0])
    longest = max(int((documents >= 0).sum()) for _, _, documents in rows)
    keep = min(full, -(-longest // multiple) * multiple + 1)  # +1: the last label's next token
    if keep < full:
        features.note_used("dynamic-padding")
    return [tuple(x[:keep] for x in row) for row in rows]


def batch(samples, start: int, size: int, rows=None, shift: bool = True):
    """A micro-batch of instruction samples -> (ids [b, S], labels [b, S] with 0 where not
    trained, loss mask [b, S], positions [b, S] or None, documents [b, S] or None).

    A label counts where the preprocessing kept it and the next token is of the same
    conversation. Positions restart, and attention stays, within each conversation of a
    pack; without packs the padding follows the sample, which causal attention never sees.
    ``shift=False``: a label belongs to its own position, not to the next token's (process
    reward labels: the step's verdict is read where the step ends). ``rows``: the samples
    themselves, in place of ``samples[start:start + size]``."""
    rows = [samples[start + i] for i in range(size)] if rows is None else rows
    tokens, labels, documents = (np.stack(x) for x in zip(*rows))
    ids, docs = tokens[:, :-1], documents[:, :-1]
    targets = labels[:, 1:] if shift else labels[:, :-1]
    mask = (targets != IGNORE) & ((documents[:, 1:] if shift else docs) == docs)
    targets = np.where(mask, targets, 0)
    if not (docs > 0).any():  # no row holds a second conversation
        return ids, targets, mask, None, None
    docs = np.where(docs < 0, docs.max(axis=1, keepdims=True) + 1, docs)  # the padding: a document of its own
    starts = np.concatenate([np.ones((size, 1), bool), docs[:, 1:] != docs[:, :-1]], axis=1)
    columns = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    positions = columns - np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
    return ids, targets, mask, positions.astype(np.int64), docs


def pair_batch(pairs: list):
    """Preference pairs (PairSamples items) as one batch of 2 x len(pairs) rows, the chosen
    conversations first, then the rejected ones in the same order (row i and row n + i are
    one pair): (ids, labels, loss mask) as ``batch`` gives them, [2n, S]."""
    ids, labels, mask, _, _ = batch(None, 0, 2 * len(pairs), [p[0] for p in pairs] + [p[1] for p in pairs])
    return ids, labels, mask
