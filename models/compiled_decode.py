"""The decode step of generation as one compiled graph (MindSpore: trace capture), so a token
costs one graph launch instead of some 300 eagerly dispatched operations.

Every step has the same shapes: the new token of each row and the whole key/value cache, its
capacity rounded up to a bucket so that prompts of similar lengths share a graph. The cache
is functional inside the graph (each layer's buffers go in, and come out with the new slot
written), and attention runs over the whole capacity: the slots not written yet count as
padding (document 0), which the documents mask keeps out of sight as it keeps the prompts'
left padding. What forward makes on the host from positions (RoPE's rows, position ids) is
given to it as device tensors instead (models/gpt.py Tokens.position_inputs).

One graph per (batch, capacity) is kept on the model. Its first step is run both ways, and a
graph whose logits differ from eager's is dropped for eager decoding, with a warning: never a
wrong token.
"""

from __future__ import annotations

import sys

import numpy as np

from mindspeed_core import autograd, features, nn, ops, runtime

BUCKET = 64  # cache capacities are rounded up to a multiple of this
TOLERANCE = 1e-4  # the first step's logits, relative to their largest magnitude
# A bucket's graph is compiled once that many of its steps have run eagerly (counted over
# generations): compiling and checking one took 3.3 s here, and each eager step it replaces
# costs 45 ms more (bench_generate.py), so it pays back after about 75. A one-off generation of
# `mindspeed generate`'s default 64 tokens stays eager; a chat or an evaluation that keeps coming
# back to a bucket compiles it.
MIN_STEPS = 128


def capacity(positions: int) -> int:
    return -(-positions // BUCKET) * BUCKET


def eligible(model) -> bool:
    """Whether the decode step of ``model`` can be one graph here: the backend gains from it
    (features: compiled-decode), and attention needs no position-relative mask (a sliding
    window is counted back from the newest key, which is not the capacity's last slot) and no
    host-sized expert batches (MoE routing), no linear-attention state (its decode step is not
    written as a graph), and the model runs in this process (not a pipeline's stages, one after
    another on other ranks)."""
    if getattr(model, "pipelined", False):
        return False
    backend = runtime.bound()
    if features.get("compiled-decode").status(backend.NAME, backend.device.type()).kind != "supported":
        return False
    cfg = getattr(model, "cfg", None)
    return (cfg is not None and cfg.moe is None and cfg.linear_attention is None
            and all(cfg.window_of(n) is None for n in range(cfg.num_layers)))


class _GraphCache:
    """Inside the graph: KVCache's interface, written functionally."""

    def __init__(self, slot, documents, buffers: dict):
        self.slot, self.documents, self.buffers = slot, documents, buffers
        self.written: dict = {}

    def extend(self, layer: int, k, v):  # the buffers heads-first, as KVCache's
        keys, values = self.buffers[layer]
        slot = ops.reshape(self.slot, (1, 1, self.slot.shape[0], 1))
        keys, values = ops.where(slot, ops.transpose(k, 1, 2), keys), ops.where(slot, ops.transpose(v, 1, 2), values)
        self.written[layer] = (keys, values)
        return ops.transpose(keys, 1, 2), ops.transpose(values, 1, 2)

    def key_documents(self):
        return self.documents


class _Graph:
    """The compiled step of one (batch, capacity). Its inputs are few and small besides the
    weights, the cache buffers and the RoPE tables (each call's arguments are formatted as text
    by MindSpore, at a cost that grows with a small tensor's size): the new ids [rows, 1], the
    slot they go to [1], each row's first token slot [rows] (before it: left padding), their
    positions [rows, 1]; the slot's one-hot and the cache's documents are made from them."""

    def __init__(self, model, layers: list, tables: int, capacity: int):
        from mindspeed_core.models.gpt import Tokens

        self.checked, self.steps = False, 0  # steps: calls whose output was used

        def step(ids, slot, first, positions, *rest):
            tables_in, buffers = rest[:tables], rest[tables:]
            grouped = None if not tables else (tuple(tables_in[:2]), tuple(tables_in[2:]) if tables == 4 else None)
            every = ops.arange(capacity)
            documents = ops.cast(ops.logical_and(ops.ge(ops.unsqueeze(every, 0), ops.unsqueeze(first, 1)),
                                                 ops.le(ops.unsqueeze(every, 0), slot)), "int64")
            cache = _GraphCache(ops.eq(every, slot), documents, {layer: (buffers[2 * i], buffers[2 * i + 1])
                                                                 for i, layer in enumerate(layers)})
            rows = ids.shape[0]
            tokens = Tokens(documents=np.ones((rows, 1), np.int64), cache=cache,
                            position_inputs=(positions, *model.rotary_rows(grouped, positions)),
                            _documents=ops.ones((rows, 1), dtype="int64"))
            logits = ops.cast(model.gather_logits(model(ids, tokens))[:, -1], "float32")
            return (logits, *(t for layer in layers for t in cache.written[layer]))

        self.run = autograd.compiled(step, nn.parameters(model), model)


def _first_slots(documents: np.ndarray, end: int) -> np.ndarray | None:
    """Each row's first token slot, if every row is left padding then tokens up to ``end``
    (exclusive) and nothing written after: the documents the graph makes; else None."""
    first = np.argmax(documents[:, :end] != 0, axis=1)
    want = (np.arange(documents.shape[1])[None] >= first[:, None]) & (np.arange(documents.shape[1])[None] < end)
    return first.astype(np.int64) if np.array_equal(documents != 0, want) and documents[:, end - 1].all() else None


def step(model, cache, ids: np.ndarray, tokens, eager, now: bool = False) -> np.ndarray:
    """The logits [rows, vocab] (float32, host) of one decode step of ``ids`` [rows, 1] whose
    host ``tokens`` (positions, documents) and ``cache`` (models/kv_cache.py, begun for them)
    are given. ``eager()`` runs the same step eagerly (writing the cache): before the bucket's
    graph is compiled (``now``: compile it at once), for its first step, which is compared, and
    where the graph disagreed."""
    graphs = model.__dict__.setdefault("_decode_graphs", {})
    key = (ids.shape[0], cache.capacity)
    graph = graphs.get(key)
    if graph is None and not now:
        counts = model.__dict__.setdefault("_decode_steps", {})
        counts[key] = counts.get(key, 0) + 1
        if counts[key] <= MIN_STEPS:
            return eager()
    first = _first_slots(cache.documents, cache.length + 1)
    if graph is False or first is None:  # this shape's graph disagreed with eager once; documents it cannot make
        return eager()
    layers = sorted(cache.keys)
    positions, tables = model.rotary_tables(tokens, ops.dtype_of(cache.keys[layers[0]]), cache.capacity)
    tables = [] if tables is None else [t for pair in tables if pair is not None for t in pair]
    if graph is None:
        graph = graphs[key] = _Graph(model, layers, len(tables), cache.capacity)
    buffers = [t for layer in layers for t in (cache.keys[layer], cache.values[layer])]
    with autograd.no_grad():
        out = graph.run(ops.tensor(np.ascontiguousarray(ids)), ops.tensor(np.array([cache.length], np.int64)),
                        ops.tensor(first), positions, *tables, *buffers)
    logits = ops.to_numpy(out[0])
    if not graph.checked:  # its first step against eager's, which then writes the cache itself
        want = eager()
        worst = float(np.max(np.abs(logits - want))) / max(float(np.max(np.abs(want))), 1e-12)
        if not worst <= TOLERANCE:
            graphs[key] = False
            print(f"generation: the compiled decode step's logits differ from eager's by {worst:.2e} (relative); "
                  "decoding eagerly", file=sys.stderr)
            return want
        features.note_used("compiled-decode")
        graph.checked = True
        return want
    features.note_used("compiled-decode")
    graph.steps += 1
    for i, layer in enumerate(layers):
        cache.keys[layer], cache.values[layer] = out[1 + 2 * i], out[2 + 2 * i]
    return logits
