"""Packing documents into training samples (``mindspeed preprocess --pack``).

Without packing, pre-training samples are cut from the concatenated corpus, so a document
often starts in one sample and ends in the next. A packed dataset instead holds packs of
whole documents, each at most one sample long (seq_length + 1 tokens); the trainer takes
one pack per sample, pads it, and leaves the padding out of the loss. With
--reset-attention-mask / --reset-position-ids the documents of a pack stay apart as if
each were trained alone.

Packs are filled best-fit decreasing (longest document first, into the fullest pack that
still has room), which comes close to the fewest packs. A document longer than a sample is
cut into sample-long pieces, each a pack of its own, and its remainder is packed like any
document: no token is dropped.
"""

from __future__ import annotations

import bisect

import numpy as np

from mindspeed_core.data import indexed


def plan(lengths, capacity: int) -> list[list[tuple[int, int, int]]]:
    """Packs of the sequences with these lengths, each a list of pieces (sequence, start,
    stop) holding at most ``capacity`` tokens; every token of every sequence is in exactly
    one piece. Deterministic: the same lengths give the same packs."""
    packs: list[list[tuple[int, int, int]]] = []
    rest = []  # (length, sequence, start) of what is left after full-capacity pieces
    for i, n in enumerate(int(x) for x in lengths):
        start = 0
        while n - start > capacity:
            packs.append([(i, start, start + capacity)])
            start += capacity
        if n > start:
            rest.append((n - start, i, start))
    rest.sort(key=lambda r: (-r[0], r[1]))
    room: list[tuple[int, int]] = []  # (free tokens, pack), sorted: the open packs
    for n, i, start in rest:
        k = bisect.bisect_left(room, (n, -1))  # the fullest pack that still fits n
        if k == len(room):
            pack = len(packs)
            packs.append([])
            free = capacity
        else:
            free, pack = room.pop(k)
        packs[pack].append((i, start, start + n))
        if free - n > 0:
            bisect.insort(room, (free - n, pack))
    return packs


def pack_dataset(source: str, target: str, capacity: int, publish: bool = True) -> tuple[dict, list]:
    """Write the packs of indexed dataset ``source`` (one sequence per document) to
    ``target``: one document per pack, one sequence per piece. Returns (counts, the renames
    left to publish: empty when ``publish``, see IndexedDatasetWriter.finalize)."""
    ds = indexed.IndexedDataset(source)
    packs = plan(ds.lengths, capacity)
    writer = indexed.IndexedDatasetWriter(target, ds.dtype)
    try:
        for pack in packs:
            writer.add_pack([ds[i][start:stop] for i, start, stop in pack])
        renames = writer.finalize(publish)
    except BaseException:
        writer.abort()
        raise
    tokens = int(np.sum(ds.lengths, dtype=np.int64))
    return {"packs": len(packs), "split_documents": int(np.sum(np.asarray(ds.lengths) > capacity)),
            "fill": tokens / max(len(packs) * capacity, 1)}, renames
