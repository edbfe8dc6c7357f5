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
#   ("sections", sizes)       rows made of sections of these sizes (dim 0), each cut in equal
#                             slices: [a_r; b_r; ...] (gated DeltaNet's in_proj: q, k, v, z, b, a)


class NumpyArrays:
    """The four array operations shard and unshard use, on numpy arrays (the default); a caller
    holding framework tensors passes its own (training/muon.py: the facade's)."""
    chunk = staticmethod(lambda x, n, axis: np.split(x, n, axis=axis))
    split = staticmethod(lambda x, sizes, axis: np.split(x, np.cumsum(sizes)[:-1], axis=axis))
    cat = staticmethod(lambda xs, axis: np.concatenate(xs, axis=axis))
    reshape = staticmethod(lambda x, shape: x.reshape(shape))


def _sections(full, sizes, xp) -> list:
    if sum(sizes) != full.shape[0]:
        raise ValueError(f"sections {list(sizes)} do not add up to the {full.shape[0]} rows")
    return xp.split(full, list(sizes), 0)


def shard(full, spec: tuple, n: int, r: int, xp=NumpyArrays):
    kind = spec[0]
    if kind == "sections":
        return xp.cat([xp.chunk(part, n, 0)[r] for part in _sections(full, spec[1], xp)], 0)
    if kind == "split":
        return xp.chunk(full, n, spec[1])[r]
    if kind == "swiglu":
        axis = spec[1] if len(spec) > 1 else 0
        gate, up = xp.chunk(full, 2, axis)
        return xp.cat([xp.chunk(gate, n, axis)[r], xp.chunk(up, n, axis)[r]], axis)
    _, groups, per, d = spec
    rep = n // groups
    g, j = divmod(r, rep)
    tail = tuple(full.shape[1:])
    grouped = xp.reshape(full, (groups, per + 2, d) + tail)[g]
    q = xp.reshape(grouped[:per], (rep, per // rep, d) + tail)[j]
    return xp.reshape(xp.cat([q, grouped[per:]], 0), (-1,) + tail)


def unshard(parts: list, spec: tuple, xp=NumpyArrays):
    kind = spec[0]
    if kind == "sections":
        local = [s // len(parts) for s in spec[1]]
        pieces = [_sections(p, local, xp) for p in parts]
        return xp.cat([piece[i] for i in range(len(local)) for piece in pieces], 0)
    if kind == "split":
        return xp.cat(parts, spec[1])
    if kind == "swiglu":
        axis = spec[1] if len(spec) > 1 else 0
        halves = [xp.chunk(p, 2, axis) for p in parts]
        return xp.cat([h[0] for h in halves] + [h[1] for h in halves], axis)
    _, groups, per, d = spec
    rep = len(parts) // groups
    tail = tuple(parts[0].shape[1:])
    local = [xp.reshape(p, (per // rep + 2, d) + tail) for p in parts]
    out = []
    for g in range(groups):
        mine = local[g * rep:(g + 1) * rep]
        out.append(xp.cat([m[: per // rep] for m in mine] + [mine[0][per // rep:]], 0))
    return xp.reshape(xp.cat(out, 0), (-1,) + tail)


# -- where a rank's tensor lies in the whole one (sharded checkpoints) ------------------------
# A box is (offset, shape): a hyper-rectangle of a tensor, offsets and sizes per dimension.
# A rank's tensor is laid out as pieces, each (local box offset, whole-tensor offset, shape,
# primary): the piece's elements are the whole tensor's box at that offset. ``primary`` is
# False for a copy another rank holds too (the copied key/value rows of a "qkv" cut), so that
# a checkpoint writes each element once.


def placement(spec, local_shape: tuple, n: int, r: int) -> tuple[tuple, list]:
    """(the whole tensor's shape, the pieces of rank ``r``'s tensor of ``local_shape``) under
    ``spec`` (None: not cut) over ``n`` tensor-parallel ranks."""
    local_shape = tuple(local_shape)
    zero = (0,) * len(local_shape)
    if spec is None or n == 1:
        return local_shape, [(zero, zero, local_shape, True)]
    kind = spec[0]
    if kind == "sections":  # each local section at its slice of the whole one
        pieces, local_at, whole_at = [], 0, 0
        rest = (0,) * (len(local_shape) - 1)
        for size in spec[1]:
            mine = size // n
            pieces.append(((local_at,) + rest, (whole_at + r * mine,) + rest, (mine,) + local_shape[1:], True))
            local_at, whole_at = local_at + mine, whole_at + size
        return (whole_at,) + local_shape[1:], pieces
    if kind in ("split", "swiglu"):
        axis = spec[1] if len(spec) > 1 else 0
        whole = _with(local_shape, axis, local_shape[axis] * n)
        if kind == "split":
            return whole, [(zero, _with(zero, axis, r * local_shape[axis]), local_shape, True)]
        h = local_shape[axis] // 2  # [gate_r; up_r] of [gate; up]
        half = _with(local_shape, axis, h)
        return whole, [(zero, _with(zero, axis, r * h), half, True),
                       (_with(zero, axis, h), _with(zero, axis, n * h + r * h), half, True)]
    _, groups, per, d = spec
    rep = n // groups
    g, j = divmod(r, rep)
    q_rows, tail = per // rep * d, local_shape[1:]
    whole = ((groups * (per + 2) * d,) + tail)
    start = g * (per + 2) * d
    rest = (0,) * len(tail)
    return whole, [(zero, (start + j * q_rows,) + rest, (q_rows,) + tail, True),
                   ((q_rows,) + rest, (start + per * d,) + rest, (2 * d,) + tail, j == 0)]


def _with(t: tuple, axis: int, value: int) -> tuple:
    return t[:axis] + (value,) + t[axis + 1:]


def with_experts(whole: tuple, pieces: list, ep: int, r: int) -> tuple[tuple, list]:
    """The placement of an expert weight cut over ``ep`` expert-parallel ranks (dim 0, before
    the tensor-parallel cut that ``whole``/``pieces`` describe), rank ``r`` holding its
    1/ep of the experts."""
    if ep == 1:
        return whole, pieces
    local = whole[0]
    return ((local * ep,) + whole[1:],
            [(lo, (go[0] + r * local,) + go[1:], shape, primary) for lo, go, shape, primary in pieces])


def flat_boxes(shape: tuple, lo: int, hi: int) -> list:
    """Boxes of a tensor of ``shape`` that hold its elements lo..hi-1 in row-major order, in
    that order (a flat slice, as the distributed optimizer owns, is at most 2 x ndim - 1 boxes)."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = int(np.prod(shape[1:], dtype=np.int64))
    first, last = lo // inner, (hi - 1) // inner
    if lo % inner == 0 and hi % inner == 0 or first == last and inner == 1:
        return [((first,) + (0,) * (len(shape) - 1), (last - first + 1,) + shape[1:])]
    if first == last:
        return [((first,) + off, (1,) + size) for off, size in flat_boxes(shape[1:], lo % inner, hi - first * inner)]
    out = []
    if lo % inner:
        out += [((first,) + off, (1,) + size) for off, size in flat_boxes(shape[1:], lo % inner, inner)]
        first += 1
    full_end = hi // inner
    if full_end > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (full_end - first,) + shape[1:]))
    if hi % inner:
        out += [((full_end,) + off, (1,) + size) for off, size in flat_boxes(shape[1:], 0, hi % inner)]
    return out


def intersect(a: tuple, b: tuple):
    """The box both boxes cover, or None."""
    (ao, ashape), (bo, bshape) = a, b
    lo = tuple(max(x, y) for x, y in zip(ao, bo))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(ao, ashape, bo, bshape))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def region(box: tuple, within: tuple | None = None) -> tuple:
    """Numpy index of ``box``, relative to the offset ``within`` (a box or offsets) if given."""
    off, shape = box
    base = (0,) * len(off) if within is None else (within[0] if isinstance(within[0], tuple) else within)
    return tuple(slice(o - b, o - b + s) for o, b, s in zip(off, base, shape))
