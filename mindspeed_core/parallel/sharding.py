"""How a whole tensor is cut over tensor-parallel ranks, and joined again: numpy only, so the
checkpoint converter (compat/mcore.py) uses it without binding a framework."""

from __future__ import annotations

import numpy as np


# A shard spec says how a parameter is cut over the tensor-parallel group:
#   ("split", dim)            equal slices along dim
#   ("swiglu", dim=0)         [gate; up] along dim -> [gate_r; up_r]
#   ("qkv", groups, per, d)   fused qkv rows when the query groups are fewer than the TP
#                             ranks: each rank keeps a slice of its group's query heads and a
#                             copy of the group's key and value heads


def shard(full: np.ndarray, spec: tuple, n: int, r: int) -> np.ndarray:
    kind = spec[0]
    if kind == "split":
        return np.split(full, n, axis=spec[1])[r]
    if kind == "swiglu":
        axis = spec[1] if len(spec) > 1 else 0
        gate, up = np.split(full, 2, axis=axis)
        return np.concatenate([np.split(gate, n, axis=axis)[r], np.split(up, n, axis=axis)[r]], axis=axis)
    _, groups, per, d = spec
    rep = n // groups
    g, j = divmod(r, rep)
    grouped = full.reshape((groups, per + 2, d) + full.shape[1:])[g]
    q = grouped[:per].reshape((rep, per // rep, d) + full.shape[1:])[j]
    return np.concatenate([q, grouped[per:]]).reshape((-1,) + full.shape[1:])


def unshard(parts: list, spec: tuple) -> np.ndarray:
    kind = spec[0]
    if kind == "split":
        return np.concatenate(parts, axis=spec[1])
    if kind == "swiglu":
        axis = spec[1] if len(spec) > 1 else 0
        halves = [np.split(p, 2, axis=axis) for p in parts]
        return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=axis)
    _, groups, per, d = spec
    rep = len(parts) // groups
    tail = parts[0].shape[1:]
    local = [p.reshape((per // rep + 2, d) + tail) for p in parts]
    out = []
    for g in range(groups):
        mine = local[g * rep:(g + 1) * rep]
        out.append(np.concatenate([m[: per // rep] for m in mine] + [mine[0][per // rep:]]))
    return np.concatenate(out).reshape((-1,) + tail)
