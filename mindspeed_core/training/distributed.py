"""What the training step does differently when it runs on several ranks: gradient
reduction over data-parallel ranks (in buckets), the sums the parallel plan asks for
(sequence-parallel partial gradients, key/value copies, tied embeddings across pipeline
stages), the global gradient norm, and full (unsharded, all stages) state for checkpoints,
so a checkpoint loads at any layout."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from mindspeed_core import dist, features, ops
from mindspeed_core.parallel.sharding import shard, unshard

BUCKET_ELEMENTS = 4 * 2**20  # float32 elements per all-reduce (16 MiB), Megatron's order of size


def by_size(indices: list[int], sizes: list[int], limit: int | None = None) -> list[tuple]:
    """``indices`` in order, cut into runs of at least ``limit`` elements (the last may be
    smaller): the buckets gradients are reduced in."""
    limit = BUCKET_ELEMENTS if limit is None else limit
    out, bucket, size = [], [], 0
    for i in indices:
        bucket.append(i)
        size += sizes[i]
        if size >= limit:
            out.append(tuple(bucket))
            bucket, size = [], 0
    if bucket:
        out.append(tuple(bucket))
    return out


@dataclass(frozen=True)
class Bucket:
    """Gradients reduced together: their positions in the gradient list, laid end to end
    (cast to ``dtype`` for the distributed optimizer's flat vector, with ``pad`` zeros after
    them), summed over ``group``; None: a group of one, nothing to sum."""

    indices: tuple
    group: object
    pad: int = 0
    dtype: str | None = None  # None: the gradients' own

    def flat(self, grads):
        pieces = [ops.reshape(grads[i] if self.dtype is None else ops.cast(grads[i], self.dtype), (-1,))
                  for i in self.indices]
        if self.pad:
            pieces.append(ops.zeros((self.pad,), dtype=ops.dtype_of(pieces[0])))
        return ops.cat(pieces)

    def reduce(self, grads):
        """The summed flat vector, or None for a group of one."""
        return None if self.group is None else dist.all_reduce(self.flat(grads), group=self.group)


def put_back(grads: list, bucket: Bucket, reduced, scale: float) -> None:
    """Write a bucket's sum (``reduced``; None: nothing was summed), times ``scale``, over
    its gradients in ``grads``."""
    if reduced is None:
        for i in bucket.indices:
            grads[i] = grads[i] * scale
        return
    if scale != 1.0:
        reduced = reduced * scale
    sizes = [ops.numel(grads[i]) for i in bucket.indices]
    for i, piece in zip(bucket.indices, ops.split(reduced, sizes)):
        grads[i] = ops.reshape(piece, tuple(grads[i].shape))


def sum_partial_over_tp(grads: list, ps, partial: list[int]) -> list:
    """Sequence parallelism leaves replicated decoder parameters with partial gradients
    (each rank saw a slice of the sequence): sum them over the tensor-parallel group."""
    grads = list(grads)
    if partial and ps.tp > 1:
        bucket = Bucket(tuple(partial), ps.group("tp"))
        put_back(grads, bucket, bucket.reduce(grads), 1.0)
    return grads


def sum_kv_copies(grads: list, plan) -> list:
    """When key/value heads are copied to several TP ranks, each copy's gradient only saw
    that rank's query heads: sum the copies' rows over the ranks sharing them."""
    if plan.kv is None:
        return grads
    grads = list(grads)
    for i in plan.indices("kv_copies"):
        q, kv = grads[i][:plan.kv.q_rows], grads[i][plan.kv.q_rows:]
        grads[i] = ops.cat([q, dist.all_reduce(kv, group=plan.kv.group)], dim=0)
    return grads


TIED_EMBEDDING = "embedding.word_embeddings.weight"


def sum_tied_embeddings(grads: list, plan, ps, tied: bool) -> list:
    """With tied input and output embeddings and several pipeline stages, the first stage's
    word embeddings and the last stage's copy each got part of the gradient: sum the two
    over the embedding group (the first and last pipeline rank), so the copies stay equal."""
    grads = list(grads)
    positions = _tied_embedding_positions(plan, ps, tied)
    if len(positions) > 1 and any(not plan.params[i].tied_copy for i in positions):
        # DualPipeV's first rank holds the embedding and the last stage's copy: the sum is here
        total = grads[positions[0]]
        for i in positions[1:]:
            total = total + grads[i]
        for i in positions:
            grads[i] = total
        return grads
    for i in positions:
        grads[i] = dist.all_reduce(grads[i], group=ps.group("embedding"))
    return grads


def _tied_embedding_positions(plan, ps, tied: bool) -> list[int]:
    """This rank's copies of tied word embeddings that sum_tied_embeddings sums across stages."""
    if ps.pp == 1 or not tied:
        return []
    return [i for i, p in enumerate(plan.params)
            if p.tied_copy or (p.name == TIED_EMBEDDING and ps.local_rank("pp") == 0)]


def average_over_dp(grads: list, ps, expert: list[bool] | None = None, limit: int | None = None) -> list:
    """Average gradients over the data-parallel group (with context parallelism: the DP x CP
    ranks, which hold the same parameters), one all-reduce per bucket. ``expert`` marks
    expert weights cut over expert parallelism: their gradients already sum the tokens of
    the EP group, so they are summed over the expert-data-parallel group (DP x CP ranks
    holding the same experts) and divided by the whole DP x CP size."""
    grads = list(grads)
    n = ps.size("dp_cp")
    if n == 1 and ps.size("edp") == 1:  # (EP across TP: experts held twice with DP x CP 1 still sum)
        return grads
    if ps.dp > 1:
        features.note_used("data-parallel")
    for bucket in dp_buckets([ops.numel(g) for g in grads], ps, expert, limit):
        put_back(grads, bucket, bucket.reduce(grads), 1.0 / n)
    return grads


def dp_buckets(sizes: list[int], ps, expert: list[bool] | None = None, limit: int | None = None) -> list[Bucket]:
    """The buckets average_over_dp reduces, dense gradients first (see there); none when the
    data-parallel group has one rank and no other rank holds the same experts."""
    if ps.size("dp_cp") == 1 and ps.size("edp") == 1:
        return []
    expert = expert if expert is not None and ps.ep > 1 else [False] * len(sizes)
    dense = [i for i, e in enumerate(expert) if not e] if ps.size("dp_cp") > 1 else []
    experts = [i for i, e in enumerate(expert) if e]
    edp = ps.group("edp") if ps.size("edp") > 1 else None
    return ([Bucket(b, ps.group("dp_cp")) for b in by_size(dense, sizes, limit)]
            + [Bucket(b, edp) for b in by_size(experts, sizes, limit)])


def summed_across_model_parallel(plan, ps, tied: bool) -> set:
    """Positions of the gradients the step sums over model-parallel ranks before reducing them
    over data-parallel ranks (sum_partial_over_tp, sum_kv_copies, sum_tied_embeddings)."""
    out = set(plan.indices("partial")) if ps.tp > 1 else set()
    if plan.kv is not None:
        out |= set(plan.indices("kv_copies"))
    return out | set(_tied_embedding_positions(plan, ps, tied))


def sum_of_squares(x):
    """sum(x * x) in float32, as a scalar tensor. Written as a [1, n] x [n, 1] matmul: a
    plain reduction over 26M elements takes ~150-200 ms on MindSpore's CPU kernels, the
    matmul 46 ms (torch: equal either way)."""
    flat = ops.reshape(ops.cast(x, "float32"), (1, -1))
    return ops.reshape(ops.matmul(flat, ops.transpose(flat, 0, 1)), ())


def grad_norm_squared(grads: list, sharded: list[bool], ps, weights: list | None = None,
                      expert: list[bool] | None = None) -> float:
    """Squared global L2 norm: sharded pieces summed over tensor-parallel ranks, expert
    weights over expert-parallel ranks, replicated ones counted once, every pipeline stage's
    part summed; ``weights`` masks elements that another rank counts."""
    if weights is not None:
        grads = [g if w is None else g * w for g, w in zip(grads, weights)]
    expert = expert if expert is not None and ps.ep > 1 else [False] * len(grads)

    def sumsq(on_tp: bool, of_experts: bool):
        items = [g for g, s, e in zip(grads, sharded, expert) if s == on_tp and e == of_experts]
        return ops.sum(ops.stack([sum_of_squares(g) for g in items])) if items else ops.zeros(())

    if any(expert):  # [TP-sharded, replicated] sums of the experts here, summed over EP first
        experts = dist.all_reduce(ops.stack([sumsq(True, True), sumsq(False, True)]), group=ps.group("ep"))
    else:
        experts = ops.zeros((2,))
    on_tp = sumsq(True, False) + experts[0]
    total = float(ops.to_numpy(dist.all_reduce(on_tp, group=ps.group("tp")))) if any(sharded) else 0.0
    rest = float(ops.to_numpy(sumsq(False, False) + experts[1]))
    return over_pipeline(total + rest, ps)


def over_pipeline(value: float, ps) -> float:
    """A per-stage sum summed over the pipeline stages."""
    if ps.pp == 1:
        return value
    return float(ops.to_numpy(dist.all_reduce(ops.tensor(np.array([value], np.float32)), group=ps.group("pp")))[0])


def sum_over_dp_and_pp(values: np.ndarray, ps, kinds=("dp", "pp")) -> np.ndarray:
    """Host figures (float32) summed over the data-parallel and pipeline ranks: the step's
    statistics of the other tokens (DP) and of the stages a rank does not hold (PP, zeros
    there). ``kinds=("dp",)``: figures every stage holds alike (GRPO's rollouts)."""
    for kind in kinds:
        if ps.size(kind) > 1:
            values = ops.to_numpy(dist.all_reduce(ops.tensor(values), group=ps.group(kind)))
    return values


def clip_coefficient(norm: float, max_norm: float) -> float:
    return max_norm / (norm + 1e-6) if max_norm and max_norm > 0 and norm > max_norm else 1.0


def _gathered_pieces(arrays: dict, group, size: int) -> dict:
    """{name: [each rank's piece, in rank order]} of {name: numpy} whose shapes are the same on
    every rank of ``group``: one all-gather per dtype of everything flattened (each collective,
    and on MindSpore each new shape, has a fixed cost far above these sizes)."""
    out = {}
    by_dtype: dict = {}
    for name, a in arrays.items():
        by_dtype.setdefault(str(a.dtype), []).append(name)
    for dtype, names in sorted(by_dtype.items()):
        flat = np.concatenate([np.ascontiguousarray(arrays[n]).reshape(-1) for n in names])
        rows = ops.to_numpy(dist.all_gather(ops.tensor(flat[None], dtype=dtype), group=group, dim=0))
        start = 0
        for n in names:
            count = arrays[n].size
            out[n] = [rows[r, start:start + count].reshape(arrays[n].shape) for r in range(size)]
            start += count
    return out


def full_tensors(named: dict, spec: dict, ps, experts: set = frozenset()) -> dict:
    """{name: numpy} of full (unsharded) values: sharded ones gathered over TP, then those
    named in ``experts`` over EP (their experts, dim 0)."""
    out = {name: ops.to_numpy(value) for name, value in named.items()}
    if ps.tp > 1:
        pieces = _gathered_pieces({n: out[n] for n in named if n in spec}, ps.group("tp"), ps.tp)
        out.update((n, unshard(p, spec[n])) for n, p in pieces.items())
    if ps.ep > 1:
        pieces = _gathered_pieces({n: out[n] for n in named if n in experts}, ps.group("ep"), ps.ep)
        out.update((n, np.concatenate(p, axis=0)) for n, p in pieces.items())
    return out


def gather_pipeline(arrays: dict, ps) -> dict:
    """{name: numpy} of every pipeline stage, on global rank 0 (a collective: every rank
    calls it with its stage's full tensors). The first rank of each later stage in rank 0's
    pipeline group sends its arrays to rank 0; other ranks get their own arrays back."""
    if ps.pp == 1:
        return arrays
    coords = ps.coords(ps.rank)
    sender = coords["pp"] > 0 and coords["tp"] == 0 and coords["cp"] == 0 and coords["dp"] == 0
    listing = gather_json([[n, list(a.shape), str(a.dtype)] for n, a in sorted(arrays.items())] if sender else [], ps)
    if sender:  # one message per dtype, everything flattened (each send has a fixed cost)
        for dtype in sorted({str(a.dtype) for a in arrays.values()}):
            flat = np.concatenate([np.ascontiguousarray(a).reshape(-1) for _, a in sorted(arrays.items())
                                   if str(a.dtype) == dtype])
            dist.send(ops.tensor(flat, dtype=dtype), 0)
        return arrays
    if ps.rank != 0:
        return arrays
    out = dict(arrays)
    for src, entries in enumerate(listing):
        for dtype in sorted({d for _, _, d in entries}):
            mine = [(name, shape) for name, shape, d in entries if d == dtype]
            flat = ops.to_numpy(dist.recv((sum(int(np.prod(s)) for _, s in mine),), dtype, src))
            start = 0
            for name, shape in mine:
                count = int(np.prod(shape))
                out.setdefault(name, flat[start:start + count].reshape(shape))  # a tied copy arrives twice, equal
                start += count
    return out


def local_array(name: str, full: np.ndarray, spec: dict, ps, experts: set = frozenset()) -> np.ndarray:
    """This rank's piece of a full array (its experts first, then its TP slice)."""
    if name in experts and ps.ep > 1:
        full = np.split(full, ps.ep, axis=0)[ps.local_rank("ep")]
    if name in spec and ps.tp > 1:
        return shard(full, spec[name], ps.tp, ps.local_rank("tp"))
    return full


def gather_json(value, ps) -> list:
    """Every rank's JSON-serialisable ``value``, in rank order (a collective). Sent as UTF-8
    bytes in float32 (exact for 0..255) through all_gather on the world group, the one
    gather that works on every backend; shorter messages are padded with zeros, which JSON
    text never contains."""
    if ps.world == 1:
        return [value]
    blob = np.frombuffer(json.dumps(value).encode(), np.uint8)
    longest = int(ops.to_numpy(dist.all_reduce(ops.tensor(np.array([blob.size], np.float32)), op="max"))[0])
    padded = np.zeros(longest, np.float32)
    padded[:blob.size] = blob
    rows = ops.to_numpy(dist.all_gather(ops.tensor(padded))).reshape(ps.world, longest).astype(np.uint8)
    return [json.loads(row.tobytes().rstrip(b"\0")) for row in rows]
