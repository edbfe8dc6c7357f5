"""Differentiable collectives for tensor and sequence parallelism (Megatron's mappings).

Each is a facade autograd.Function whose backward is the collective's adjoint:

    copy_to_region          forward identity          backward all-reduce
    reduce_from_region      forward all-reduce        backward identity
    gather_from_region      forward all-gather (dim)  backward keep own slice
    scatter_to_region       forward keep own slice    backward all-gather (dim)
    gather_from_sequence    forward all-gather dim 0  backward reduce-scatter dim 0
    reduce_scatter_to_sequence  forward reduce-scatter dim 0, backward all-gather dim 0
    shift_ring              forward one step along the ring, backward one step back
    sequence_to_heads       forward all-to-all [b, s, h, d] -> [b, n s, h / n, d], backward the inverse
    heads_to_sequence       the inverse (Ulysses' second all-to-all)
    gather_tokens           forward all-gather dim 0  backward reduce-scatter dim 0 (expert parallelism)
    reduce_scatter_tokens   forward reduce-scatter dim 0, backward all-gather dim 0 (expert parallelism)
    all_to_all_rows         forward uneven all-to-all of rows, backward the reverse exchange

With a group of one rank they all reduce to the identity, so a model built for TP = 1 pays
nothing.

All but all_to_all_rows also have a ``traced`` formulation (see the facade's Function): the
forward's values detached, and the backward carried by ops whose autodiff is the adjoint
(slicing, concatenation, dist.sum_gradient). MindSpore's trace capture runs it.
"""

from __future__ import annotations

from mindspeed_core import features, autograd, dist, ops


def _size(group) -> int:
    return dist.world_size(group) if group is not None else 1


def _own_slice(x, group, dim):
    n = _size(group)
    return ops.chunk(x, n, dim=dim)[dist.rank(group)]


# kind -> (forward, backward), each (tensor, group, dim) -> tensor
_KINDS = {
    "copy": (lambda x, g, d: x * 1, lambda dy, g, d: dist.all_reduce(dy, group=g)),
    "reduce": (lambda x, g, d: dist.all_reduce(x, group=g), lambda dy, g, d: dy * 1),
    "gather": (lambda x, g, d: dist.all_gather(x, group=g, dim=d), lambda dy, g, d: _own_slice(dy, g, d)),
    "scatter": (lambda x, g, d: _own_slice(x, g, d), lambda dy, g, d: dist.all_gather(dy, group=g, dim=d)),
    "gather_seq": (lambda x, g, d: dist.all_gather(x, group=g, dim=d),
                   lambda dy, g, d: dist.reduce_scatter(dy, group=g, dim=d)),
    "scatter_seq": (lambda x, g, d: dist.reduce_scatter(x, group=g, dim=d),
                    lambda dy, g, d: dist.all_gather(dy, group=g, dim=d)),
}


def _all_to_all(parts, group):
    return dist.all_to_all(parts, group=group)


def _sequence_to_heads(x, group, exchange=_all_to_all):
    """[b, s, h, d] holding this rank's tokens of every head -> [b, n s, h / n, d] holding
    every rank's tokens (in group-rank order) of this rank's n-th of the heads."""
    n = _size(group)
    b, s, h, d = x.shape
    parts = ops.permute(ops.reshape(x, (b, s, n, h // n, d)), (2, 0, 1, 3, 4))  # [n, b, s, h/n, d]
    got = exchange(parts, group)  # [source rank, b, s, h/n, d]
    return ops.reshape(ops.permute(got, (1, 0, 2, 3, 4)), (b, n * s, h // n, d))


def _heads_to_sequence(x, group, exchange=_all_to_all):
    n = _size(group)
    b, ns, hn, d = x.shape
    parts = ops.permute(ops.reshape(x, (b, n, ns // n, hn, d)), (1, 0, 2, 3, 4))  # [n, b, s, h/n, d]
    got = exchange(parts, group)  # [source rank (its heads), b, s, h/n, d]
    return ops.reshape(ops.permute(got, (1, 2, 0, 3, 4)), (b, ns // n, n * hn, d))


def _in_slot(x, group, dim):
    """x in this rank's slot of n along dim, zeros elsewhere: summed over the group, every
    member's x in rank order (an all-gather; exact, as the other addends are zeros)."""
    zeros = ops.zeros_like(x)
    return ops.cat([x if i == dist.rank(group) else zeros for i in range(_size(group))], dim=dim)


def _values_of(value, carrier):
    """value's values with carrier's gradient (same shape); exact: carrier minus itself
    detached is zero."""
    return autograd.detach(value) + (carrier - autograd.detach(carrier))


def _traced_gather_seq(x, g, d):
    slots = _in_slot(x, g, d)  # backward: the summed gradient's own slot, a reduce-scatter
    return _values_of(dist.all_reduce(slots, group=g), dist.sum_gradient(slots, g))


def _traced_gather(x, g, d):
    slots = _in_slot(x, g, d)  # backward: the gradient's own slot
    return _values_of(dist.all_reduce(slots, group=g), slots)


def _traced_exchange(x, g, pick):
    """What pick(all) takes of every member's x gathered ([n, *x.shape], one sum of slots);
    backward: each member's gradient goes back into its slots of the sum, so every rank gets
    the gradients of what the others took of its x (the exchange's adjoint)."""
    slots = _in_slot(ops.unsqueeze(x, 0), g, 0)
    return _values_of(pick(dist.all_reduce(slots, group=g)), pick(dist.sum_gradient(slots, g)))


def _traced_all_to_all(parts, g):  # [n, ...] -> [source rank, ...]: each member's part for this rank
    return _traced_exchange(parts, g, lambda every: every[:, dist.rank(g)])


def _traced_shift(x, g, d):  # from the previous member of the ring, as dist.shift(x, 1)
    return _traced_exchange(x, g, lambda every: every[(dist.rank(g) - 1) % _size(g)])


def _traced_scatter_seq(x, g, d):  # backward: the gradient in its slot, summed (an all-gather)
    return _values_of(_own_slice(dist.all_reduce(x, group=g), g, d), _own_slice(dist.sum_gradient(x, g), g, d))


# kind -> the same forward and backward in ops a tracing compiler differentiates correctly
_TRACED = {
    "copy": lambda x, g, d: dist.sum_gradient(x, g),
    "reduce": lambda x, g, d: _values_of(dist.all_reduce(x, group=g), x),
    "gather": _traced_gather,
    "scatter": lambda x, g, d: _own_slice(dist.sum_gradient(x, g), g, d),  # backward: all-gather
    "gather_seq": _traced_gather_seq, "gather_ring": _traced_gather_seq, "gather_tokens": _traced_gather_seq,
    "scatter_seq": _traced_scatter_seq, "scatter_tokens": _traced_scatter_seq,
    "shift": _traced_shift,
    "seq_to_heads": lambda x, g, d: _sequence_to_heads(x, g, _traced_all_to_all),
    "heads_to_seq": lambda x, g, d: _heads_to_sequence(x, g, _traced_all_to_all),
}


def max_over(x, group):
    """The element-wise maximum over the group, without gradient (every member's x gathered
    by one float32 sum, then the max, which a tracing compiler can follow)."""
    if _size(group) == 1:
        return autograd.detach(x)
    slots = _in_slot(ops.unsqueeze(ops.cast(autograd.detach(x), "float32"), 0), group, 0)
    return ops.cast(ops.amax(dist.all_reduce(slots, group=group), dim=0), ops.dtype_of(x))


_KINDS.update({
    "shift": (lambda x, g, d: dist.shift(x, 1, group=g), lambda dy, g, d: dist.shift(dy, -1, group=g)),
    "seq_to_heads": (lambda x, g, d: _sequence_to_heads(x, g), lambda dy, g, d: _heads_to_sequence(dy, g)),
    "heads_to_seq": (lambda x, g, d: _heads_to_sequence(x, g), lambda dy, g, d: _sequence_to_heads(dy, g)),
    "gather_ring": _KINDS["gather_seq"],  # every ring member's key/value block at once
})
_KINDS.update({  # expert parallelism's all-gather token dispatcher: the same adjoint pair
    "gather_tokens": _KINDS["gather_seq"],
    "scatter_tokens": _KINDS["scatter_seq"],
})
# context and expert parallelism note their algorithms themselves
_CONTEXT_KINDS = ("shift", "seq_to_heads", "heads_to_seq", "gather_ring", "gather_tokens", "scatter_tokens")
_CLASSES: dict = {}


def _apply(kind: str, x, group, dim=0):
    if _size(group) == 1:
        return x
    if kind not in _CONTEXT_KINDS:
        features.note_used("tensor-parallel")
    if kind in ("gather_seq", "scatter_seq"):
        features.note_used("sequence-parallel")
    # One Function class per (kind, group, dim): torch Functions and MindSpore bprop Cells
    # see only tensors, so the group and dim are closed over by the class.
    key = (kind, group.ranks, dim)
    cls = _CLASSES.get(key)
    if cls is None:
        fwd, bwd = _KINDS[kind]

        class _Collective(autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return fwd(t, group, dim)

            @staticmethod
            def backward(ctx, grad):
                return bwd(grad, group, dim)

        if kind in _TRACED:
            _Collective.traced = staticmethod(lambda t, traced=_TRACED[kind]: traced(t, group, dim))

        _Collective.__name__ = f"{kind}_{'_'.join(map(str, group.ranks))}_{dim}"
        cls = _CLASSES[key] = _Collective
    return cls.apply(x)


class Arrival:
    """A ring exchange started by start_shift_ring / start_gather_ring and still travelling:
    wait() gives what the synchronous mapping would, with the same backward (which runs
    synchronously). Between start and wait the caller computes on what it already holds."""

    def __init__(self, kind: str, x, group, dim: int, pending):
        self.kind, self.x, self.group, self.dim, self.pending = kind, x, group, dim, pending

    def wait(self):
        key = ("arrival", self.kind, self.group.ranks, self.dim)
        cls = _CLASSES.get(key)
        if cls is None:
            _, bwd = _KINDS[self.kind]
            group, dim = self.group, self.dim

            class _Arrival(autograd.Function):
                # the work under way reaches forward through the class (Functions see only tensors);
                # each apply is preceded by its own start, also when recompute runs forward again
                @staticmethod
                def forward(ctx, t):
                    pending, cls.pending = cls.pending, None  # each start is waited for once
                    if pending is None:
                        raise RuntimeError("a ring exchange was waited for without being started")
                    return pending.wait()

                @staticmethod
                def backward(ctx, grad):
                    return bwd(grad, group, dim)

            _Arrival.__name__ = f"arrival_{self.kind}_{'_'.join(map(str, group.ranks))}_{dim}"
            _Arrival.pending = None
            cls = _CLASSES[key] = _Arrival
        cls.pending = self.pending
        return cls.apply(self.x)


def start_shift_ring(x, group) -> Arrival:
    """shift_ring(x, group), started: the step's send and receive travel while the caller computes."""
    features.note_used("cp-send-recv-overlap")
    return Arrival("shift", x, group, 0, dist.shift_async(autograd.detach(x), 1, group=group))


def start_gather_ring(x, group, dim=1) -> Arrival:
    """gather_ring(x, group, dim), started: every member's x concatenated along dim (the work
    stacks them along dim 0; the pieces are put side by side along dim on arrival)."""
    features.note_used("cp-send-recv-overlap")
    return Arrival("gather_ring", x, group, dim, _Sided(dist.all_gather_async(autograd.detach(x), group=group),
                                                         _size(group), dim))


class _Sided:
    def __init__(self, pending, n, dim):
        self.pending, self.n, self.dim = pending, n, dim

    def wait(self):
        stacked = self.pending.wait()  # [n x b, ...]
        rows = stacked.shape[0] // self.n
        return ops.cat([stacked[i * rows:(i + 1) * rows] for i in range(self.n)], dim=self.dim)


def copy_to_region(x, group):
    return _apply("copy", x, group)


def reduce_from_region(x, group):
    return _apply("reduce", x, group)


def gather_from_region(x, group, dim=-1):
    return _apply("gather", x, group, dim)


def scatter_to_region(x, group, dim=-1):
    return _apply("scatter", x, group, dim)


def gather_from_sequence(x, group, dim=1):
    return _apply("gather_seq", x, group, dim)


def reduce_scatter_to_sequence(x, group, dim=1):
    return _apply("scatter_seq", x, group, dim)


def shift_ring(x, group):
    return _apply("shift", x, group)


def gather_ring(x, group, dim=1):
    return _apply("gather_ring", x, group, dim)


def gather_tokens(x, group):
    """Every expert-parallel rank's tokens [T, h] -> [n T, h]; backward reduce-scatter."""
    return _apply("gather_tokens", x, group, 0)


def reduce_scatter_tokens(x, group):
    """[n T, h] partial sums -> this rank's [T, h] summed over the group; backward all-gather."""
    return _apply("scatter_tokens", x, group, 0)


def sequence_to_heads(x, group):
    return _apply("seq_to_heads", x, group)


def heads_to_sequence(x, group):
    return _apply("heads_to_seq", x, group)


def all_to_all_rows(x, group, send_splits, recv_splits):
    """Rows of ``x`` go out ``send_splits[j]`` to group rank j, in order; ``recv_splits[i]``
    arrive from rank i (uneven, zero allowed). The backward sends the gradients back the same
    way reversed. Expert parallelism's token exchange."""
    if _size(group) == 1:
        return x
    send, recv = [int(n) for n in send_splits], [int(n) for n in recv_splits]

    class _AllToAllRows(autograd.Function):  # a class per call: the splits change every step
        @staticmethod
        def forward(ctx, t):
            return dist.all_to_all(t, group=group, input_splits=send, output_splits=recv)

        @staticmethod
        def backward(ctx, grad):
            return dist.all_to_all(grad, group=group, input_splits=recv, output_splits=send)

    return _AllToAllRows.apply(x)


class RowsArrival:
    """An all_to_all_rows started by start_all_to_all_rows and still travelling: wait() gives
    what all_to_all_rows would, with its backward (the gradients sent back the same way,
    synchronously)."""

    def __init__(self, x, group, send: list, recv: list, pending):
        self.x, self.group, self.send, self.recv, self.pending = x, group, send, recv, pending

    def wait(self):
        pending, group, send, recv = self.pending, self.group, self.send, self.recv

        class _ArrivedRows(autograd.Function):  # a class per exchange: its splits and its work under way
            @staticmethod
            def forward(ctx, t):
                return pending.wait()

            @staticmethod
            def backward(ctx, grad):
                return dist.all_to_all(grad, group=group, input_splits=recv, output_splits=send)

        return _ArrivedRows.apply(self.x)


def start_all_to_all_rows(x, group, send_splits, recv_splits) -> RowsArrival:
    """all_to_all_rows(x, group, send_splits, recv_splits), started: the rows travel while the
    caller computes on what it already holds (--moe-alltoall-overlap-comm)."""
    send, recv = [int(n) for n in send_splits], [int(n) for n in recv_splits]
    return RowsArrival(x, group, send, recv, dist.all_to_all_async(autograd.detach(x), group=group, input_splits=send,
                                                                   output_splits=recv))
