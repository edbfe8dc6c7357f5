"""Activation recompute: which parts of the decoder drop their activations in forward and
compute them again in backward (Megatron's --recompute-granularity / --recompute-method /
--recompute-num-layers, MindSpeed's --recompute-norm).

* full, uniform: the layers of each model chunk in groups of N; only a group's input is kept.
* full, block: the first N layers of each model chunk (so, per pipeline stage and per
  virtual stage), one at a time; the rest keep their activations.
* selective: the core attention of every layer (scores, softmax, dropout, weighted sum),
  the largest activations per byte of compute (Korthikanti et al.).
* norm: every norm of every layer; its output stays (the next projection keeps it), what
  goes is what the norm kept for its own backward.

The model asks this policy (``Recompute``) at each of those places; ``checkpoint`` is the
facade's recompute plus two things a training step needs of it: the random numbers of the
recomputation are those of the forward pass (dropout masks, also those of the tensor-parallel
RNG tracker), and code with side effects can tell the two passes apart (``recomputing``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from mindspeed_core import autograd, features, random
from mindspeed_core.errors import MindSpeedError

_replaying = [0]  # > 0 while a recomputation runs


def recomputing() -> bool:
    """Whether the code running now is a recomputation in the backward pass (counters and
    statistics collected in forward must not count it twice): a checkpoint's, or MindSpore's
    recording again of a forward that other compute followed (a pipeline's interleaved ones)."""
    return _replaying[0] > 0 or autograd.replaying()


def _states():
    return random.get_state(), random.tracker().snapshot()


def _set_states(states) -> None:
    random.set_state(states[0])
    random.tracker().restore(states[1])


@contextlib.contextmanager
def _replay(states):
    now = _states()
    _set_states(states)
    _replaying[0] += 1
    try:
        yield
    finally:
        _replaying[0] -= 1
        _set_states(now)


def checkpoint(fn, *args):
    """fn(*args) keeping only its inputs; in backward fn runs again from the random state it
    first ran with."""
    seen = []

    def run(*a):
        if not seen:
            seen.append(_states())
            return fn(*a)
        with _replay(seen[0]):
            return fn(*a)

    return autograd.recompute(run, *args)


@dataclass(frozen=True)
class Recompute:
    """What the decoder recomputes. ``granularity``: None, "full" or "selective"; ``method``
    and ``num_layers`` for full; ``norm``: the norms, with any granularity."""

    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None
    norm: bool = False
    activation: bool = False  # --recompute-activation-function
    activation_layers: int | None = None  # --recompute-activation-function-num-layers
    moe_zero_memory: str = "disable"  # --moe-zero-memory: what MoE layers' dispatch keeps (models/moe.py)

    def activation_in(self, n: int) -> list[bool]:
        """Which of a chunk's ``n`` layers recompute their MLP's activation function: as
        MindSpeed-LLM, the layers full recompute leaves alone (the first
        ``activation_layers`` of them, if given)."""
        if not self.activation:
            return [False] * n
        free = [i for start, stop, recomputed in self.groups(n) if not recomputed for i in range(start, stop)]
        chosen = set(free if self.activation_layers is None else free[:self.activation_layers])
        return [i in chosen for i in range(n)]

    @property
    def active(self) -> bool:
        return self.granularity is not None or self.norm or self.activation or self.moe_zero_memory != "disable"

    def groups(self, n: int) -> list:
        """The decoder's ``n`` layers as runs (start, stop, recomputed as one)."""
        if self.granularity != "full":
            return [(0, n, False)] if n else []
        k = self.num_layers
        if self.method == "uniform":
            return [(i, min(i + k, n), True) for i in range(0, n, k)]
        return [(i, i + 1, i < k) for i in range(n)]  # block

    def attention(self, fn, *args):
        """The core attention fn(*args), recomputed under selective granularity."""
        if self.granularity != "selective":
            return fn(*args)
        features.note_used("recompute")
        return checkpoint(fn, *args)

    def norm_of(self, norm, x):
        if not self.norm:
            return norm(x)
        features.note_used("norm-recompute")
        return checkpoint(norm, x)


NONE = Recompute()


def _granularity(args) -> str | None:
    """--recompute-granularity, with Megatron's --recompute-activations shorthand for selective."""
    if not getattr(args, "recompute_activations", False):
        return args.recompute_granularity
    if args.recompute_granularity not in (None, "selective"):
        raise MindSpeedError("--recompute-activations is --recompute-granularity selective; it cannot be "
                             f"combined with --recompute-granularity {args.recompute_granularity}")
    return "selective"


def from_args(args) -> Recompute:
    """The policy the flags ask for (after ``check``)."""
    return Recompute(_granularity(args), args.recompute_method, args.recompute_num_layers, args.recompute_norm,
                     args.recompute_activation_function, args.recompute_activation_function_num_layers,
                     getattr(args, "moe_zero_memory", None) or "disable")


def activation(fn, h, recomputed: bool):
    """An MLP's activation function ``fn`` of h; with ``recomputed`` its output is not kept for
    backward but computed again there (--recompute-activation-function)."""
    if not recomputed:
        return fn(h)
    features.note_used("recompute-activation-function")
    return checkpoint(fn, h)


def check(args, rank_layers: list) -> None:
    """Flag combinations Megatron refuses, refused the same way before any rank starts.
    ``rank_layers``: how many layers each pipeline rank holds (over its model chunks)."""
    granularity = _granularity(args)
    zero = getattr(args, "moe_zero_memory", None) or "disable"
    if zero != "disable" and getattr(args, "compile", False):  # the compiled step runs every expert densely
        raise MindSpeedError(f"--moe-zero-memory {zero} recomputes the MoE dispatch, which a compiled step does not "
                             "run: drop --compile or --moe-zero-memory")
    if zero == "level0" and getattr(args, "moe_alltoall_overlap_comm", False):
        raise MindSpeedError("--moe-zero-memory level0 keeps fc1's output between two recomputed halves, which the "
                             "chunked exchange of --moe-alltoall-overlap-comm does not split: use level1 with it")
    if granularity == "full":
        if args.recompute_method is None or args.recompute_num_layers is None:
            raise MindSpeedError("--recompute-granularity full needs --recompute-method (uniform or block) and "
                                 "--recompute-num-layers N")
        # megatron-core's bound is the layers of a pipeline rank; the count applies per model
        # chunk, so with virtual stages a larger one recomputes every layer of a chunk (groups)
        most = max(rank_layers, default=0)
        if args.recompute_num_layers > most:
            raise MindSpeedError(f"--recompute-num-layers {args.recompute_num_layers} exceeds the {most} layers a "
                                 "pipeline rank holds")
    elif args.recompute_method is not None or args.recompute_num_layers is not None:
        given = "--recompute-method" if args.recompute_method is not None else "--recompute-num-layers"
        raise MindSpeedError(f"{given} applies to --recompute-granularity full only"
                             + ("" if granularity is None else f" (this run asks for {granularity})"))
