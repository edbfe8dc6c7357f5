"""The key/value cache of generation: per layer, buffers preallocated for the whole batch and
the longest sequence the generation can reach, holding this rank's key/value heads (the
query groups; a share of them under tensor parallelism), so each decoding step computes the
new tokens only.

The buffers are heads-first, [batch, groups, capacity, head_dim], the layout attention reads
them in: the positions so far are then a view whose (batch, group) blocks merge into one batch
dimension, so each step's attention multiplies them where they lie (sequence-first buffers were
copied whole, twice a layer, every step: bench_generate's PyTorch step took 1.93 ms with them,
1.75 ms without).
``extend`` hands them back sequence-first ([batch, positions, groups, head_dim]) as views.

The rows of a batch are prompts of different lengths, padded on the left: ``documents``
marks each cached position 1 (a token) or 0 (padding), and attention keeps a query inside
its own kind, so no token ever sees padding (models/gpt.py Seams.attention).
"""

from __future__ import annotations

import numpy as np

from mindspeed_core import ops


class KVCache:
    def __init__(self, batch: int, capacity: int):
        self.batch, self.capacity = batch, capacity
        self.length = 0  # positions filled (the same for every row: padding fills the rest)
        self.keys, self.values = {}, {}  # layer number -> [batch, groups, capacity, head_dim]
        # layer number -> (convolution history, delta-rule state) of a linear-attention layer
        # (models/gated_deltanet.py): its whole past in a fixed size, whatever the length
        self.linear = {}
        self.documents = np.zeros((batch, capacity), np.int64)
        self._documents = None  # the device copy of documents[:, :length + new]

    def begin(self, documents: np.ndarray) -> None:
        """Start a forward pass over new positions whose kinds are ``documents`` [batch, new]."""
        new = documents.shape[1]
        if self.length + new > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} positions; {self.length} are filled and "
                             f"{new} more were given")
        self.documents[:, self.length:self.length + new] = documents
        self._documents = ops.tensor(np.ascontiguousarray(self.documents[:, :self.length + new]))
        self._new = new

    def extend(self, layer: int, k, v):
        """Write a layer's keys and values of the new positions [batch, new, groups, head_dim];
        returns all of them so far."""
        if layer not in self.keys:  # allocated at first use: the layer's local heads are known here
            shape = (self.batch, k.shape[2], self.capacity, k.shape[3])
            self.keys[layer] = ops.zeros(shape, dtype=ops.dtype_of(k))
            self.values[layer] = ops.zeros(shape[:3] + (v.shape[3],), dtype=ops.dtype_of(v))
        end = self.length + self._new
        ops.write_slice_(self.keys[layer], ops.transpose(k, 1, 2), 2, self.length)
        ops.write_slice_(self.values[layer], ops.transpose(v, 1, 2), 2, self.length)
        return (ops.transpose(self.keys[layer][:, :, :end], 1, 2),
                ops.transpose(self.values[layer][:, :, :end], 1, 2))

    def extend_keys(self, layer, k):
        """extend for a store of keys alone (sparse attention's indexer: one key a token, no value)."""
        if layer not in self.keys:
            self.keys[layer] = ops.zeros((self.batch, k.shape[2], self.capacity, k.shape[3]), dtype=ops.dtype_of(k))
        ops.write_slice_(self.keys[layer], ops.transpose(k, 1, 2), 2, self.length)
        return ops.transpose(self.keys[layer][:, :, :self.length + self._new], 1, 2)

    def values_per_token(self) -> int:
        """Numbers held for one position of one row, over every layer (multi-latent attention:
        its latent and rotated key, kv_lora_rank + qk_rope_head_dim a layer)."""
        return sum(int(t.shape[1] * t.shape[3]) for store in (self.keys, self.values) for t in store.values())

    def linear_state(self, layer: int) -> tuple:
        """A linear-attention layer's (convolution history, state), (None, None) before its first pass."""
        return self.linear.get(layer, (None, None))

    def keep_linear_state(self, layer: int, history, state) -> None:
        self.linear[layer] = (history, state)

    def fixed_values(self) -> int:
        """Numbers held for one row whatever its length, over every layer: the linear-attention
        layers' convolution histories and states."""
        return sum(int(np.prod(t.shape)) for kept in self.linear.values() for t in kept) // max(self.batch, 1)

    def key_documents(self):
        return self._documents

    def end(self) -> None:
        """The forward pass over the new positions is done: they are cached."""
        self.length += self._new
        self._new = 0

    def reorder(self, rows) -> None:
        """Keep the given rows (beam search): row i becomes the old row rows[i]."""
        index = ops.tensor(np.asarray(rows, np.int64))
        for store in (self.keys, self.values):
            for layer, buffer in store.items():
                store[layer] = ops.index_select(buffer, 0, index)
        for layer, kept in self.linear.items():
            self.linear[layer] = tuple(ops.index_select(t, 0, index) for t in kept)
        self.documents = self.documents[np.asarray(rows)]
        self.batch = len(rows)
