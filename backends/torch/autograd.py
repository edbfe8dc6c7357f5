"""Gradients for the PyTorch backend: one functional entry point, as on MindSpore."""

from __future__ import annotations

import sys

import torch
import torch.utils.checkpoint

from mindspeed_core.backends.common import GradHooks


def _fill_missing(grads, wrt):
    # A parameter the function did not use gets a zero gradient, as MindSpore gives.
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, wrt)]


def value_and_grad(fn, params, has_aux: bool = False):
    """``fn(*args)`` -> (value, [d value / d p for p in params]).

    With ``has_aux`` fn returns (loss, aux) and the value is (loss, aux); aux carries no
    gradient. The returned loss is detached.
    """
    params = list(params)

    def run(*args, **kwargs):
        with torch.enable_grad():
            out = fn(*args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            grads = torch.autograd.grad(loss, params, allow_unused=True) if params else ()
        value = (loss.detach(), aux) if has_aux else loss.detach()
        return value, _fill_missing(grads, params)

    return run


grad_hooks = GradHooks  # tensor hooks: a leaf's fires once per backward with its total gradient


def _compile(fn):
    """``torch.compile(fn)`` whose random ops draw from the eager generator, so a compiled step
    with dropout makes the same draws as an eager one (the trainer compares the two on the first
    step)."""
    import torch._inductor.config as inductor

    inductor.fallback_random = True
    return torch.compile(fn, dynamic=False)


def compiled_value_and_grad(fn, params, module, has_aux: bool = False):
    """value_and_grad of ``torch.compile(fn)``: Inductor compiles the forward, AOTAutograd
    the backward. ``module`` is not needed on PyTorch (parameters are graph inputs). With
    ``has_aux`` fn returns (value, *aux) and the value is (value, aux)."""
    compiled = _compile(fn)
    if not has_aux:
        return value_and_grad(compiled, params)

    def split(*args):
        value, *aux = compiled(*args)
        return value, tuple(a.detach() for a in aux)

    return value_and_grad(split, params, has_aux=True)


def compiled(fn, params, module):
    """``torch.compile(fn)`` (params are read from the module as fn runs)."""
    return _compile(fn)


def compiled_vjp(fn, params, module):
    """vjp of ``torch.compile(fn)``: ``f(inputs, interleaved=False) -> (outputs, backward)``."""
    compiled = _compile(fn)

    def call(inputs, interleaved: bool = False):
        return vjp(compiled, inputs, params, interleaved)

    return call


def replaying() -> bool:
    """Never: each output keeps its own graph, so no forward runs again at its backward."""
    return False


def vjp(fn, inputs, params=(), interleaved: bool = False):
    """Run ``fn(*inputs)`` and return (outputs, backward).

    ``backward(cotangents)`` (same structure as outputs) returns (input grads, param
    grads), each a list; an input that is not floating point gets None. It can be called
    once. Pipeline schedules keep one such closure per micro-batch. ``interleaved`` (other
    forwards run before this backward) changes nothing here: each output keeps its own graph.
    """
    params = list(params)
    ins = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    with torch.enable_grad():
        out = fn(*ins)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    detached = tuple(o.detach() for o in outs) if isinstance(out, (tuple, list)) else out.detach()

    def backward(cotangents):
        cots = list(cotangents) if isinstance(cotangents, (tuple, list)) else [cotangents]
        wrt = [x for x in ins if x.requires_grad] + params
        grads = torch.autograd.grad(outs, wrt, cots, allow_unused=True) if wrt else ()
        grads = _fill_missing(grads, wrt)
        it = iter(grads)
        in_grads = [next(it) if x.requires_grad else None for x in ins]
        return in_grads, list(it)

    return detached, backward


class _Ctx:
    """What forward hands to backward: ``ctx.save(*tensors)`` / ``ctx.saved``, plus any
    attribute set on it."""

    def __init__(self, torch_ctx):
        object.__setattr__(self, "_t", torch_ctx)

    def save(self, *tensors):
        self._t.save_for_backward(*tensors)

    @property
    def saved(self):
        return self._t.saved_tensors

    def __getattr__(self, name):
        return getattr(self._t, name)

    def __setattr__(self, name, value):
        setattr(self._t, name, value)


class Function:
    """A differentiable operation with a hand-written backward.

    Subclasses define ``forward(ctx, *args)`` and ``backward(ctx, *grad_outputs)`` as
    static methods; ``backward`` returns one gradient (or None) per forward argument.
    Call it with ``MyFn.apply(*args)``.
    """

    @classmethod
    def apply(cls, *args):
        # Under torch.compile the graph breaks at apply (the class lookup below), and Dynamo would
        # then compile the forward's frame again for every Function and shape that passes through
        # it (tensor parallelism's collectives: up to its recompile limit, a minute of Inductor on
        # these cores), to run what the eager frame runs anyway; so once a compile has loaded
        # Dynamo the forward is kept from it. Not before: importing Dynamo after the process group
        # exists keeps that group alive past dist.shutdown() (torch's modules hold it as default
        # arguments), and with it gloo's threads into the interpreter's exit (test_dist).
        compiling = "torch._dynamo" in sys.modules
        slot = "_bound_under_dynamo" if compiling else "_bound"
        bound = cls.__dict__.get(slot)
        if bound is None:
            user = cls

            def forward(ctx, *a):
                return user.forward(_Ctx(ctx), *a)

            class bound(torch.autograd.Function):
                @staticmethod
                def backward(ctx, *g):
                    grads = user.backward(_Ctx(ctx), *g)
                    return tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)

            bound.forward = staticmethod(torch.compiler.disable(forward) if compiling else forward)
            setattr(cls, slot, bound)
        return bound.apply(*args)


def no_grad():
    return torch.no_grad()


def detach(x):
    return x.detach()


def saved_tensors_hooks(pack, unpack):
    """Tensors autograd saves for backward inside the block go through ``pack(x, storage)``
    (``storage``: (key, bytes) of the memory x views, one key per buffer) and come back
    through ``unpack``. Parameters are kept as they are: they stay in memory anyway."""

    def _pack(x):
        if x.is_leaf and x.requires_grad:
            return True, x
        buffer = x.untyped_storage()
        return False, pack(x, (buffer.data_ptr(), buffer.nbytes()))

    def _unpack(packed):
        kept, value = packed
        return value if kept else unpack(value)

    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


def recompute(fn, *args):
    """Run fn without keeping its activations; recompute them during the backward pass."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


