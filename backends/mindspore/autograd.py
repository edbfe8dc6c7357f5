"""Gradients for the MindSpore backend: value_and_grad, vjp and bprop Cells."""

from __future__ import annotations

import linecache
import sys

import mindspore as ms
from mindspore import ops as P

from mindspeed_core.backends.common import GradHooks

_FLOATS = (ms.float16, ms.float32, ms.float64, ms.bfloat16)

# PyNative keeps only the newest forward recorded for gradients: a vjp whose backward comes
# after another forward was recorded (pipeline schedules hold several) must record its own again.
_recorded = [0]


def _rng_snapshot():
    from . import random

    return random.device_generator().bit_generator.state, random.tracker().get_states()


def _rng_restore(snapshot) -> None:
    from . import random

    random.device_generator().bit_generator.state = snapshot[0]
    random.tracker().set_states(snapshot[1])


def value_and_grad(fn, params, has_aux: bool = False):
    """``fn(*args)`` -> (value, [d value / d p for p in params]); see the torch backend."""
    params = list(params)
    if not params:
        def run_nothing(*args, **kwargs):
            return fn(*args, **kwargs), []
        return run_nothing
    grad_fn = ms.value_and_grad(fn, None, params, has_aux=has_aux)

    def run(*args, **kwargs):
        _recorded[0] += 1
        value, grads = grad_fn(*args, **kwargs)
        if has_aux:
            loss, aux = value
            value = (loss, aux)
        return value, list(grads)

    return run


def _give_every_caller_a_source() -> None:
    """Trace capture names a graph by its callers' source lines (``inspect.stack()``) and
    fails with a TypeError on a frame whose source cannot be read: ``python -m`` puts
    ``<frozen runpy>`` at the bottom of every stack, ``python -c`` a ``<string>``. Such
    files get blank lines in linecache (what a traceback shows for them anyway)."""
    frame = sys._getframe(1)
    while frame is not None:
        name, need = frame.f_code.co_filename, max(frame.f_lineno or 1, frame.f_code.co_firstlineno)
        lines = linecache.getlines(name, frame.f_globals)
        if not lines or (name in _BLANK_SOURCES and len(lines) < need):  # one file, several frames
            linecache.cache[name] = (0, None, ["\n"] * max(need, len(lines)), name)
            _BLANK_SOURCES.add(name)
        frame = frame.f_back


_BLANK_SOURCES: set = set()


def compiled_value_and_grad(fn, params, module):
    """value_and_grad of ``mindspore.jit(fn, capture_mode="trace")``.

    Two things trace capture gets wrong, measured (tests/test_compile.py):
    - parameters that fn reads from cells become constants of the graph, so later updates
      (in place or by set_data) are not seen: here each parameter is passed to the graph as
      an input, substituted into its cell while fn is traced;
    - a Cell's hand-written ``bprop`` is ignored (the forward is differentiated instead):
      the trainer refuses --compile where the model relies on one (collectives' adjoints
      under tensor parallelism), and compares compiled with eager gradients on the first
      step of every compiled run.
    """
    params = list(params)
    position = {id(p): i for i, p in enumerate(params)}
    slots = [(cell, name, position[id(p)]) for _, cell in module.cells_and_names()
             for name, p in cell._params.items() if p is not None and id(p) in position]
    if {i for _, _, i in slots} != set(range(len(params))):
        raise ValueError("compiled_value_and_grad: some params are not parameters of module")

    def with_weights(*args):
        inputs, weights = args[:len(args) - len(params)], args[len(args) - len(params):]
        for cell, name, i in slots:
            cell._params[name] = weights[i]
        try:
            return fn(*inputs)
        finally:
            for cell, name, i in slots:
                cell._params[name] = params[i]

    compiled = ms.jit(with_weights, capture_mode="trace")
    cache: dict = {}

    def run(*args):
        n = len(args)
        if n not in cache:
            cache[n] = ms.value_and_grad(compiled, tuple(range(n, n + len(params))))
        _recorded[0] += 1
        _give_every_caller_a_source()
        value, grads = cache[n](*args, *params)
        return value, list(grads) if isinstance(grads, (tuple, list)) else [grads]  # one position: a bare tensor

    return run


def vjp(fn, inputs, params=(), interleaved: bool = False):
    """Run ``fn(*inputs)`` and return (outputs, backward); see the torch backend.

    PyNative keeps only the newest forward recorded for gradients, and a recorded forward
    that is never pulled back stays allocated for the life of the process (measured: its
    saved activations, every time). So a forward the caller says will be ``interleaved``
    with other forwards before its backward runs without recording, and ``backward`` records
    it again with the random state it had (same dropout draws, same values) and pulls back at
    once: one more forward, no graph held between the two. An undeclared one that another
    forward superseded is replayed the same way, but its first recording stays allocated."""
    params = list(params)
    inputs = list(inputs)
    snapshot = _rng_snapshot()
    if interleaved:
        with no_grad():
            out = fn(*inputs)
        mine, pullback = None, None
    else:
        _recorded[0] += 1
        mine = _recorded[0]
        out, pullback = ms.vjp(fn, *inputs, weights=params or None)
    floating = [x.dtype in _FLOATS for x in inputs]

    def backward(cotangents):
        cots = tuple(cotangents) if isinstance(cotangents, (tuple, list)) else cotangents
        replay = pullback
        if _recorded[0] != mine:
            now = _rng_snapshot()
            _rng_restore(snapshot)
            _recorded[0] += 1
            _, replay = ms.vjp(fn, *inputs, weights=params or None)
            _rng_restore(now)
        grads = replay(cots)
        in_grads, p_grads = (grads if params else (grads, ()))
        in_grads = list(in_grads) if isinstance(in_grads, (tuple, list)) else [in_grads]
        in_grads = [g if f else None for g, f in zip(in_grads, floating)]
        return in_grads, list(p_grads)

    return out, backward


class _Ctx:
    """What forward hands to backward: ``ctx.save(*tensors)`` / ``ctx.saved`` and any
    attribute set on it."""

    def save(self, *tensors):
        self.saved = tensors


class _FunctionCell(ms.nn.Cell):
    # One Cell per call: MindSpore's bprop sees only inputs, output and output gradient,
    # so what forward saved must live on an object owned by that one call.
    def __init__(self, fn_cls):
        super().__init__()
        self._fn_cls = fn_cls
        self._ctx = _Ctx()

    def construct(self, *args):
        return self._fn_cls.forward(self._ctx, *args)

    def bprop(self, *args):
        inputs, dout = args[:-2], args[-1]
        grads = self._fn_cls.backward(self._ctx, *(dout if isinstance(dout, tuple) else (dout,)))
        grads = tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
        return tuple(P.zeros_like(x) if g is None else g for g, x in zip(grads, inputs))


class Function:
    """A differentiable operation with a hand-written backward; see the torch backend."""

    @classmethod
    def apply(cls, *args):
        return _FunctionCell(cls)(*args)


grad_hooks = GradHooks  # Parameter.register_hook in PyNative (see there)


def no_grad():
    return ms._no_grad()


def detach(x):
    return P.stop_gradient(x)


def saved_tensors_hooks(pack, unpack):
    raise NotImplementedError("MindSpore has no hook on the tensors autograd saves for backward")


def recompute(fn, *args):
    # early_stop off: stopping raises out of our custom-backward Cells (TP, CP, EP operators)
    # in the middle of their bprop recording, which PyNative cannot unwind
    return ms.recompute(fn, *args, use_reentrant=False, early_stop=False)
