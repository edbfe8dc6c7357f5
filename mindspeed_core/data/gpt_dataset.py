"""Pre-training samples from indexed datasets: splits, blends, deterministic order.

Each split (train / valid / test, by ``--split 98,1,1`` over documents) concatenates its
documents (which end with EOD when preprocessed with --append-eod) and cuts samples of
seq_length + 1 tokens; their order is a permutation drawn from the seed, drawn anew each
epoch. Blends (``--data-path 0.7 a 0.3 b``) interleave datasets by weight with Megatron's
greedy rule (always take the dataset furthest below its share), so sample i of a run is
fixed by the seed alone: that is what makes resuming reproduce the uninterrupted run.
A packed dataset (``mindspeed preprocess --pack``, named ``..._packed_<key>_document``)
gives one sample per pack instead, padded with PAD.
"""

from __future__ import annotations

import math
import re

import numpy as np

from mindspeed_core import features
from mindspeed_core.data.indexed import IndexedDataset
from mindspeed_core.errors import MindSpeedError

SPLITS = ("train", "valid", "test")


def parse_data_path(values: list[str]) -> list[tuple[float, str]]:
    """``a`` or ``0.7 a 0.3 b`` -> [(weight, prefix)], weights normalised."""
    if len(values) == 1:
        return [(1.0, values[0])]
    if len(values) % 2:
        raise MindSpeedError("--data-path takes one prefix, or weight/prefix pairs (0.7 a 0.3 b)")
    pairs = []
    for w, p in zip(values[::2], values[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise MindSpeedError(f"--data-path: {w!r} is not a weight (expected weight/prefix pairs)") from None
        if not math.isfinite(weight) or weight <= 0:
            raise MindSpeedError(f"--data-path: weight {w} of {p} must be a positive number")
        pairs.append((weight, p))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def split_parts(split: str) -> list[float]:
    """``--split 98,1,1`` (or 98/1/1, fewer parts meaning zero) -> [train, valid, test] weights."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise MindSpeedError(f"--split {split!r} must be numbers like 98,1,1") from None
    if len(parts) > 3 or not all(math.isfinite(x) and x >= 0 for x in parts):
        raise MindSpeedError(f"--split {split!r} takes up to three parts (train, valid, test), each zero or positive")
    parts = (parts + [0.0, 0.0])[:3]
    if sum(parts) <= 0:
        raise MindSpeedError(f"--split {split!r} has no positive part")
    return parts


def split_ranges(num_docs: int, split: str) -> dict:
    parts = split_parts(split)
    bounds = [0]
    for frac in np.cumsum(parts) / sum(parts):
        bounds.append(int(round(frac * num_docs)))
    return {name: (bounds[i], bounds[i + 1]) for i, name in enumerate(SPLITS)}


class Shuffled:
    """``count`` samples in a seeded order, drawn anew each epoch; with ``seed`` None, in file
    order every epoch (--no-shuffle)."""

    def __init__(self, count: int, seed: int | None):
        self.count, self.seed = count, seed
        self._orders: dict[int, np.ndarray] = {}

    def _sample(self, i: int) -> int:
        if self.seed is None:
            features.note_used("no-shuffle")
            return i % self.count
        epoch = i // self.count
        if epoch not in self._orders:
            self._orders = {epoch: np.random.RandomState((self.seed + 7919 * epoch) % 2**32).permutation(self.count)}
        return int(self._orders[epoch][i % self.count])


class TokenSamples(Shuffled):
    """Samples of seq_length + 1 tokens cut from a token stream, in a seeded order."""

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int, name: str):
        self.tokens, self.seq_length = tokens, seq_length
        count = (len(tokens) - 1) // seq_length
        if count <= 0:
            raise MindSpeedError(f"{name} has {len(tokens)} tokens: too few for one sample of --seq-length "
                                 f"{seq_length} (+1)")
        super().__init__(count, seed)

    def __getitem__(self, i: int) -> np.ndarray:
        start = self._sample(i) * self.seq_length
        return self.tokens[start : start + self.seq_length + 1].astype(np.int64)


# a packed sample's padding (not a token id: the trainer leaves it out of the loss)
PAD = -1
PACKED = re.compile(r"_packed_[^/\\]*_document$")


class PackedSamples(Shuffled):
    """One sample per pack of a packed dataset (``mindspeed preprocess --pack``): the pack's
    documents, then PAD up to seq_length + 1 tokens."""

    def __init__(self, ds: IndexedDataset, first: int, last: int, seq_length: int, seed: int, name: str):
        self.ds, self.first, self.seq_length = ds, first, seq_length
        ends = np.concatenate([[0], np.cumsum(ds.lengths, dtype=np.int64)])[ds.document_indices[first : last + 1]]
        sizes = np.diff(ends)
        if sizes.max() > seq_length + 1:
            raise MindSpeedError(f"{name} holds packs of up to {int(sizes.max())} tokens, longer than a sample of "
                                 f"--seq-length {seq_length} (+1): train with the --seq-length it was packed for, or "
                                 f"pack again")
        super().__init__(last - first, seed)

    def __getitem__(self, i: int) -> np.ndarray:
        out = np.full(self.seq_length + 1, PAD, np.int64)
        pack = self.ds.document(self.first + self._sample(i))
        out[: len(pack)] = pack
        return out


def unpad(tokens: np.ndarray, eod: int):
    """Packed samples [b, S + 1] -> (tokens with each PAD an end of document, so that padding
    is a document of its own under --reset-attention-mask; the loss mask [b, S] of the
    labels, 0 where the label is padding), or (tokens, None) without padding."""
    padding = tokens == PAD
    if not padding.any():
        return tokens, None
    return np.where(padding, eod, tokens), ~padding[:, 1:]


class BlendedSamples:
    def __init__(self, parts: list[tuple[float, TokenSamples | PackedSamples]]):
        self.parts = parts
        self.packed = any(isinstance(p, PackedSamples) for _, p in parts)  # samples may hold PAD
        self.weights = np.array([w for w, _ in parts], np.float64)
        self._cache_n = 0
        self._which = np.zeros(0, np.int64)
        self._index = np.zeros(0, np.int64)

    def _extend(self, n: int) -> None:
        if n <= self._cache_n:
            return
        n = max(n, 2 * self._cache_n, 1024)
        counts = np.zeros(len(self.parts), np.int64)
        which, index = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for i in range(n):
            d = int(np.argmax(self.weights * (i + 1) - counts))
            which[i], index[i] = d, counts[d]
            counts[d] += 1
        self._which, self._index, self._cache_n = which, index, n

    def locate(self, i: int) -> tuple[int, int]:
        """(part, sample of that part) of sample ``i`` of the blend."""
        if len(self.parts) == 1:
            return 0, i
        self._extend(i + 1)
        return int(self._which[i]), int(self._index[i])

    def __getitem__(self, i: int) -> np.ndarray:
        if len(self.parts) == 1:
            return self.parts[0][1][i]
        self._extend(i + 1)
        return self.parts[int(self._which[i])][1][int(self._index[i])]


def build_splits(data_path: list[str], split: str, seq_length: int, seed: int, shuffle: bool = True) -> dict:
    """{"train": BlendedSamples | None, "valid": ..., "test": ...}; empty splits are None.
    ``shuffle`` False: each dataset's samples in file order."""
    blends = {name: [] for name in SPLITS}
    for weight, prefix in parse_data_path(data_path):
        ds = IndexedDataset(prefix)
        packed = bool(PACKED.search(prefix))
        for k, name in enumerate(SPLITS):
            a, b = split_ranges(ds.document_count if packed else len(ds), split)[name]
            if b <= a:
                continue
            where = f"{prefix} ({name})"
            order = seed + k if shuffle else None
            samples = (PackedSamples(ds, a, b, seq_length, order, where) if packed
                       else TokenSamples(ds.tokens(a, b), seq_length, order, where))
            blends[name].append((weight, samples))
    if not blends["train"]:
        raise MindSpeedError("the training split is empty: check --data-path and --split")
    return {name: (BlendedSamples(parts) if parts else None) for name, parts in blends.items()}


def batch(samples, rows) -> np.ndarray:
    """The samples at indices ``rows``, stacked."""
    return np.stack([samples[k] for k in rows])


def document_layout(ids: np.ndarray, eod: int, reset_position_ids: bool, reset_attention_mask: bool):
    """Packed samples (Megatron's reset flags): documents end at each EOD token (the EOD
    belongs to the document it ends). Returns (positions, documents) [b, s] int64 for ids
    [b, s], each None when its flag is off: positions restart at 0 after an EOD, document
    ids count the EODs before each token."""
    if not (reset_position_ids or reset_attention_mask):
        return None, None
    ends = ids == eod
    documents = np.zeros(ids.shape, np.int64)
    documents[:, 1:] = np.cumsum(ends[:, :-1], axis=1)
    positions = None
    if reset_position_ids:
        columns = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
        starts = np.where(np.concatenate([np.ones((ids.shape[0], 1), bool), ends[:, :-1]], axis=1), columns, 0)
        positions = (columns - np.maximum.accumulate(starts, axis=1)).astype(np.int64)
    return positions, (documents if reset_attention_mask else None)
