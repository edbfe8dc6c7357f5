"""Pre-training samples from indexed datasets: splits, blends, deterministic order.

Each split (train / valid / test, by ``--split 98,1,1`` over documents) concatenates its
documents (which end with EOD when preprocessed with --append-eod) and cuts samples of
seq_length + 1 tokens; their order is a permutation drawn from the seed, drawn anew each
epoch. Blends (``--data-path 0.7 a 0.3 b``) interleave datasets by weight with Megatron's
greedy rule (always take the dataset furthest below its share), so sample i of a run is
fixed by the seed alone: that is what makes resuming reproduce the uninterrupted run.
"""

from __future__ import annotations

import math

import numpy as np

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


def split_ranges(num_docs: int, split: str) -> dict:
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise MindSpeedError(f"--split {split!r} must be numbers like 98,1,1") from None
    if len(parts) > 3 or not all(math.isfinite(x) and x >= 0 for x in parts):
        raise MindSpeedError(f"--split {split!r} takes up to three parts (train, valid, test), each zero or positive")
    parts = (parts + [0.0, 0.0])[:3]
    if sum(parts) <= 0:
        raise MindSpeedError(f"--split {split!r} has no positive part")
    bounds = [0]
    for frac in np.cumsum(parts) / sum(parts):
        bounds.append(int(round(frac * num_docs)))
    return {name: (bounds[i], bounds[i + 1]) for i, name in enumerate(SPLITS)}


class TokenSamples:
    """Samples of seq_length + 1 tokens cut from a token stream, in a seeded order."""

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int, name: str):
        self.tokens, self.seq_length, self.seed = tokens, seq_length, seed
        self.count = (len(tokens) - 1) // seq_length
        if self.count <= 0:
            raise MindSpeedError(f"{name} has {len(tokens)} tokens: too few for one sample of --seq-length "
                                 f"{seq_length} (+1)")
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.RandomState((self.seed + 7919 * epoch) % 2**32).permutation(self.count)}
        return self._orders[epoch]

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(self._order(i // self.count)[i % self.count])
        start = j * self.seq_length
        return self.tokens[start : start + self.seq_length + 1].astype(np.int64)


class BlendedSamples:
    def __init__(self, parts: list[tuple[float, TokenSamples]]):
        self.parts = parts
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

    def __getitem__(self, i: int) -> np.ndarray:
        if len(self.parts) == 1:
            return self.parts[0][1][i]
        self._extend(i + 1)
        return self.parts[int(self._which[i])][1][int(self._index[i])]


def build_splits(data_path: list[str], split: str, seq_length: int, seed: int) -> dict:
    """{"train": BlendedSamples | None, "valid": ..., "test": ...}; empty splits are None."""
    blends = {name: [] for name in SPLITS}
    for weight, prefix in parse_data_path(data_path):
        ds = IndexedDataset(prefix)
        for k, name in enumerate(SPLITS):
            a, b = split_ranges(len(ds), split)[name]
            if b > a:
                blends[name].append((weight, TokenSamples(ds.tokens(a, b), seq_length, seed + k, f"{prefix} ({name})")))
    if not blends["train"]:
        raise MindSpeedError("the training split is empty: check --data-path and --split")
    return {name: (BlendedSamples(parts) if parts else None) for name, parts in blends.items()}


def batch(samples, start: int, size: int) -> np.ndarray:
    return np.stack([samples[start + i] for i in range(size)])


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
