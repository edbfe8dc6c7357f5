"""Gradients for the MindSpore backend: value_and_grad, vjp and bprop Cells."""

from __future__ import annotations

import contextlib
import inspect
import linecache
import sys

import mindspore as ms
from mindspore import ops as P

from mindspeed_core.backends.common import GradHooks

_FLOATS = (ms.float16, ms.float32, ms.float64, ms.bfloat16)

# PyNative keeps only the newest forward recorded for gradients: a vjp whose backward comes
# after another forward was recorded (pipeline schedules hold several) must record its own again.
_recorded = [0]
# True while a compiled function's Python runs: in its eager rehearsal (which records its random
# draws) and under trace capture. Functions then take their ``traced`` formulation and
# collectives avoid the host; what cannot be traced is refused in the rehearsal, because an
# exception under trace capture leaves MindSpore's tracer half-open for the rest of the process.
_tracing = [False]


def tracing() -> bool:
    return _tracing[0]


_replaying = [0]  # > 0 while a forward runs again at its backward (vjp, compiled_vjp)


def replaying() -> bool:
    return _replaying[0] > 0


@contextlib.contextmanager
def _replay():
    _replaying[0] += 1
    try:
        yield
    finally:
        _replaying[0] -= 1


@contextlib.contextmanager
def _compiling():
    outer, _tracing[0] = _tracing[0], True
    try:
        yield
    finally:
        _tracing[0] = outer


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
    files get blank lines in linecache (what a traceback shows for them anyway).

    And a caller's file that is no module's (those, or source executed under a file name, as
    pytest-xdist runs its worker loop) is recorded as having none: ``inspect.getmodule``
    otherwise looks for its module through every module of ``sys.modules`` again, for each such
    frame of every operation traced (measured: greedy decoding of a 2-layer model in a
    ``pytest -n`` worker, 13.5 s instead of 3.0 s). The answer is the same: no module."""
    frame = sys._getframe(1)
    while frame is not None:
        name, need = frame.f_code.co_filename, max(frame.f_lineno or 1, frame.f_code.co_firstlineno)
        lines = linecache.getlines(name, frame.f_globals)
        if not lines or (name in _BLANK_SOURCES and len(lines) < need):  # one file, several frames
            linecache.cache[name] = (0, None, ["\n"] * max(need, len(lines)), name)
            _BLANK_SOURCES.add(name)
        if name not in inspect.modulesbyfile and inspect.getmodule(frame, name) is None:  # one search, not one an op
            inspect.modulesbyfile[name] = _NO_MODULE
        frame = frame.f_back


_BLANK_SOURCES: set = set()
_NO_MODULE = "<no module>"  # a name sys.modules never holds: inspect.getmodule's cache answers None


class _Traced:
    """``mindspore.jit(fn, capture_mode="trace")`` made safe to differentiate and call again.

    Three things trace capture gets wrong, measured (tests/test_compile.py), and what is done:
    - parameters that fn reads from cells become constants of the graph, so later updates
      (in place or by set_data) are not seen: here each parameter is passed to the graph as
      an input, substituted into its cell while fn is traced;
    - a Cell's hand-written ``bprop`` is ignored (the forward is differentiated instead): here
      a Function runs its ``traced`` formulation (differentiable ops whose autodiff is the
      hand-written backward), and one without it is refused;
    - host values are frozen into the graph: random draws (dropout masks) would repeat every
      step. Each input shape's draws are recorded once by an eager rehearsal of the forward
      (random.py), then drawn on the host before every call, exactly as eager would draw them,
      and passed as inputs. The rehearsal also meets any refusal before tracing starts.

    And one thing it costs: every call formats its tensor arguments and results as text for a
    debug log, whatever the log level (numpy's summary of a [4, 192, 4, 32] tensor: 2.8 ms; of
    the same tensor flat: 0.2 ms, and a decode step has some 40 of them). So the graph is
    called with tensors' text made terse (_terse_text), and tensors of two or more dimensions
    go in flat and are reshaped inside the graph (``flat_outputs`` does the same for what fn
    returns), which keeps the text short wherever it is still made.

    The graph's inputs are (*inputs, *params, *draws): ``call(inputs)`` makes them and returns
    (graph, arguments), one graph per input shapes."""

    def __init__(self, fn, params, module, flat_outputs: bool = False):
        from . import random

        self.params = params = list(params)
        position = {id(p): i for i, p in enumerate(params)}
        slots = [(cell, name, position[id(p)]) for _, cell in module.cells_and_names()
                 for name, p in cell._params.items() if p is not None and id(p) in position]
        if {i for _, _, i in slots} != set(range(len(params))):
            raise ValueError("compiled function: some params are not parameters of module")
        # input shapes -> the forward's random draws, and its outputs' shapes; argument shapes -> graph
        self.fn, self.plans, self.out_shapes, self.graphs = fn, {}, {}, {}
        counts = self.counts = [0, 0]  # the call being traced: how many inputs, how many random draws

        def with_weights(*args):
            n_inputs, n_draws = counts
            inputs, weights = args[:n_inputs], args[n_inputs:n_inputs + len(params)]
            draws = args[n_inputs + len(params):]
            for cell, name, i in slots:
                cell._params[name] = weights[i]
            try:
                with _compiling(), random.replaying(list(draws)) as left:
                    value = fn(*inputs)
                if left():
                    raise RuntimeError(f"compiled function: the traced forward drew {n_draws - left()} of the "
                                       f"{n_draws} random tensors its eager forward drew")
                if flat_outputs:
                    value = tuple(_flat(v) for v in value) if isinstance(value, (tuple, list)) else _flat(value)
                return value
            finally:
                for cell, name, i in slots:
                    cell._params[name] = params[i]

        self._with_weights = with_weights

    def call(self, inputs) -> tuple:
        """(the graph, its arguments) for these inputs, this call's random draws made."""
        from . import random

        key = tuple(tuple(a.shape) for a in inputs)
        if key not in self.plans:  # this shape's draws, from an eager rehearsal the random state is rewound after
            snapshot = _rng_snapshot()
            with no_grad(), _compiling(), random.recording() as plan:
                value = self.fn(*inputs)
            _rng_restore(snapshot)
            self.plans[key] = plan
            self.out_shapes[key] = [tuple(getattr(v, "shape", ())) for v in
                                    (value if isinstance(value, (tuple, list)) else [value])]
        draws = random.draw_plan(self.plans[key])
        self.counts[:] = [len(inputs), len(draws)]
        arguments = (*inputs, *self.params, *draws)
        shapes = tuple(None if isinstance(a, ms.Parameter) or a.ndim < 2 else tuple(a.shape) for a in arguments)
        if shapes not in self.graphs:  # a function object of its own: trace capture keys graphs by flat shapes
            def unflattened(*args):
                return self._with_weights(*(a if s is None else P.reshape(a, s) for a, s in zip(args, shapes)))

            self.graphs[shapes] = _terse_text(ms.jit(unflattened, capture_mode="trace"))
        _give_every_caller_a_source()
        return self.graphs[shapes], tuple(a if s is None else P.reshape(a, (-1,)) for a, s in zip(arguments, shapes))


def _no_text(tensor) -> str:
    return "Tensor(...)"  # not even the shape: reading a result's shape waits for the graph


def _terse_text(graph):
    """``graph``, called with MindSpore tensors' text being a placeholder: the text trace capture
    makes of every argument and result for its debug log, formatted whatever the log level
    (measured: 8.5 of a 13 ms decode step). Nothing of ours reads a tensor's text meanwhile."""
    def call(*args):
        saved = ms.Tensor.__repr__, ms.Tensor.__str__
        ms.Tensor.__repr__ = ms.Tensor.__str__ = _no_text
        try:
            return graph(*args)
        finally:
            ms.Tensor.__repr__, ms.Tensor.__str__ = saved
    return call


def _flat(x):
    return P.reshape(x, (-1,)) if x.ndim >= 2 else x


def compiled(fn, params, module):
    """``mindspore.jit(fn, capture_mode="trace")`` without gradients (see _Traced)."""
    traced = _Traced(fn, params, module, flat_outputs=True)

    def run(*args):
        with no_grad():
            graph, arguments = traced.call(args)
            out = graph(*arguments)
        outs = out if isinstance(out, (tuple, list)) else [out]
        # Wait for the graph (a result's shape is known once it has run) before queueing more
        # work: on CPU, eager operations queued while a graph runs slow both (measured on the
        # decode step: 235-271 tok/s without the wait, 313-361 with it)
        for o in outs:
            o.shape  # noqa: B018
        shapes = traced.out_shapes[tuple(tuple(a.shape) for a in args)]  # what the graph gave flat
        if not isinstance(out, (tuple, list)):
            return P.reshape(out, shapes[0])
        return tuple(P.reshape(o, s) for o, s in zip(out, shapes))

    return run


def compiled_value_and_grad(fn, params, module, has_aux: bool = False):
    """value_and_grad of ``mindspore.jit(fn, capture_mode="trace")`` (see _Traced). With
    ``has_aux`` fn returns (value, *aux): the first output alone is differentiated."""
    traced = _Traced(fn, params, module)
    grads_of: dict = {}

    def run(*args):
        n = len(args)
        graph, arguments = traced.call(args)
        if graph not in grads_of:
            grads_of[graph] = ms.value_and_grad(graph, tuple(range(n, n + len(traced.params))), has_aux=has_aux)
        _recorded[0] += 1
        value, grads = grads_of[graph](*arguments)
        if has_aux:
            value = (value[0], tuple(value[1:]))
        return value, list(grads) if isinstance(grads, (tuple, list)) else [grads]  # one position: a bare tensor

    return run


def compiled_vjp(fn, params, module):
    """vjp with ``fn`` compiled by trace capture (see _Traced and vjp): ``f(inputs,
    interleaved=False) -> (outputs, backward)``. An interleaved forward runs its graph without
    recording and records it again, with the same random draws, when its backward comes."""
    traced = _Traced(fn, params, module)
    n_params = len(traced.params)

    def call(inputs, interleaved: bool = False):
        inputs = list(inputs)
        graph, arguments = traced.call(inputs)
        counts = list(traced.counts)
        if interleaved:
            with no_grad():
                out = graph(*arguments)
            mine, pullback = None, None
        else:
            _recorded[0] += 1
            mine = _recorded[0]
            out, pullback = ms.vjp(graph, *arguments)

        def backward(cotangents):
            cots = tuple(cotangents) if isinstance(cotangents, (tuple, list)) else cotangents
            replay = pullback
            if _recorded[0] != mine:
                traced.counts[:] = counts
                _give_every_caller_a_source()
                _recorded[0] += 1
                _, replay = ms.vjp(graph, *arguments)
            grads = replay(cots)
            in_grads = [P.reshape(g, x.shape) if x.dtype in _FLOATS else None  # the graph took x flat
                        for g, x in zip(grads[:len(inputs)], inputs)]
            return in_grads, list(grads[len(inputs):len(inputs) + n_params])

        return out, backward

    return call


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
            with _replay():
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
        if _tracing[0]:  # trace capture would differentiate forward and ignore backward
            traced = getattr(cls, "traced", None)
            if traced is None:
                raise NotImplementedError(f"{cls.__name__} has a hand-written backward and no traced formulation, "
                                          f"which MindSpore's trace capture needs")
            return traced(*args)
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
