"""The facade's front end: ``from mindspeed_core import ops, nn, ...`` binds nothing.

Each namespace is a :class:`Namespace` that looks a name up in the bound backend when the name
is first used, and the two base classes code derives from at import time, ``nn.Module`` and
``autograd.Function``, are framework-neutral here and meet the framework's own classes when
first instantiated or applied. So the order of imports never decides the framework: entry
points bind it (:func:`mindspeed_core.runtime.bind`) before they use the facade, and a library
user who never binds gets the resolved default on first use. The names and their contracts
are :mod:`mindspeed_core.facade`'s.
"""

from __future__ import annotations

import functools

from mindspeed_core import runtime
from mindspeed_core.facade import REDUCE_OPS, names


class _BindsOnFirstInstance(type):
    """Metaclass of the neutral :class:`Module`: a class statement needs no framework; the first
    instance of each class makes (once) the class that also derives from the bound backend's
    Module, and every instance is of that class, so ``isinstance(obj, cls)`` and ``super()``
    behave as with a direct subclass."""

    def __call__(cls, *args, **kwargs):
        if "_framework_class_of" in cls.__dict__:  # already the framework-backed class
            return super().__call__(*args, **kwargs)
        real = cls.__dict__.get("_framework_class")
        if real is None:
            base = runtime.bound().nn.Module
            real = type(cls)(cls.__name__, (cls, base), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                "_framework_class_of": cls})
            type.__setattr__(cls, "_framework_class", real)
        return type.__call__(real, *args, **kwargs)


class Module(metaclass=_BindsOnFirstInstance):
    """Base of every facade module (``nn.Module``): define ``__init__`` (calling
    ``super().__init__()`` first) and ``forward``, as in PyTorch. Instances are
    ``torch.nn.Module`` or ``mindspore.nn.Cell`` objects of the bound framework."""


class Function:
    """A differentiable operation with a hand-written backward (``autograd.Function``).

    Subclasses define ``forward(ctx, *args)`` and ``backward(ctx, *grad_outputs)`` as static
    methods (``ctx.save(*tensors)`` / ``ctx.saved`` carry tensors across); ``backward`` returns
    one gradient (or None) per forward argument. Call it as ``MyFn.apply(*args)``.
    """

    @classmethod
    def apply(cls, *args):
        # the bound backend's Function.apply, run for this class
        return runtime.bound().autograd.Function.apply.__func__(cls, *args)


_NEUTRAL = {("nn", "Module"): Module, ("autograd", "Function"): Function}


# ---- argument checks: written once here, so every backend gets them ----------------------
# A caller's mistake in a collective otherwise hangs the job or surfaces as a framework error
# from deep inside; each check below runs before the bound backend's function.

def _member(group, what: str) -> None:
    if group is not None and runtime.bound().dist.rank(group) < 0:
        raise ValueError(f"{what}: this process is not a member of group {group.ranks}")


def _reduce_op(op, what: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"{what} op {op!r} is not supported; use one of {', '.join(REDUCE_OPS)}")


def _check_all_reduce(x, op="sum", group=None):
    _member(group, "all_reduce")
    _reduce_op(op, "all_reduce")


def _check_reduce_scatter(x, op="sum", group=None, dim=0):
    _member(group, "reduce_scatter")
    _reduce_op(op, "reduce_scatter")
    n = runtime.bound().dist.world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dimension {dim} of size {x.shape[dim]} does not split over {n} ranks")


def _check_all_to_all(x, group=None, input_splits=None, output_splits=None):
    _member(group, "all_to_all")
    n = runtime.bound().dist.world_size(group)
    if input_splits is None:
        if output_splits is not None:
            raise ValueError("all_to_all with output_splits also needs input_splits")
        if x.shape[0] % n:
            raise ValueError(f"all_to_all: {x.shape[0]} rows do not split evenly over {n} ranks")
        return
    if output_splits is None:
        raise ValueError("all_to_all with input_splits also needs output_splits")
    if len(input_splits) != n or len(output_splits) != n:
        raise ValueError(f"all_to_all: input_splits and output_splits need one entry per rank ({n})")
    if sum(input_splits) != x.shape[0]:
        raise ValueError(f"all_to_all: input_splits {list(input_splits)} do not add up to the {x.shape[0]} rows")


def _membership(what):
    def check(x, *args, group=None, **kwargs):
        _member(group if group is not None else _positional_group(what, args), what)
    return check


def _positional_group(what, args):
    # all_gather(x, group, dim), broadcast(x, src, group), shift(x, offset, group)
    position = {"all_gather": 0, "all_reduce_async": 0, "sum_gradient": 0, "all_gather_async": 0, "broadcast": 1, "shift": 1,
                "shift_async": 1}[what]
    return args[position] if len(args) > position else None


_CHECKS = {
    ("dist", "all_reduce"): _check_all_reduce,
    ("dist", "reduce_scatter"): _check_reduce_scatter,
    ("dist", "all_to_all"): _check_all_to_all,
    ("dist", "all_gather"): _membership("all_gather"),
    ("dist", "all_reduce_async"): _membership("all_reduce_async"),
    ("dist", "sum_gradient"): _membership("sum_gradient"),
    ("dist", "all_gather_async"): _membership("all_gather_async"),
    ("dist", "broadcast"): _membership("broadcast"),
    ("dist", "shift"): _membership("shift"),
    ("dist", "shift_async"): _membership("shift_async"),
}


def _checked(func, check):
    @functools.wraps(func)
    def call(*args, **kwargs):
        check(*args, **kwargs)
        return func(*args, **kwargs)
    return call


class Namespace:
    """One facade namespace (``ops``, ``nn``, ...): a name resolves in the bound backend the
    first time it is used (binding the resolved default if no entry point has bound yet) and
    is kept, since a process binds once. Setting a name sets it in the backend too."""

    def __init__(self, name: str):
        object.__setattr__(self, "_namespace", name)

    def __getattr__(self, attr):
        if attr.startswith("__"):  # introspection (copy, pickle, inspect) must not bind
            raise AttributeError(attr)
        neutral = _NEUTRAL.get((self._namespace, attr))
        if neutral is not None:
            return neutral
        value = getattr(getattr(runtime.bound(), self._namespace), attr)
        check = _CHECKS.get((self._namespace, attr))
        if check is not None:
            value = _checked(value, check)
        object.__setattr__(self, attr, value)
        return value

    def __setattr__(self, attr, value):
        setattr(getattr(runtime.bound(), self._namespace), attr, value)
        object.__setattr__(self, attr, value)

    def __delattr__(self, attr):
        delattr(getattr(runtime.bound(), self._namespace), attr)
        self.__dict__.pop(attr, None)

    def __dir__(self):
        return names(self._namespace)

    def __repr__(self):
        state = runtime.bound().NAME if runtime.is_bound() else "not bound yet"
        return f"<facade namespace {self._namespace} ({state})>"


ops = Namespace("ops")
nn = Namespace("nn")
autograd = Namespace("autograd")
random = Namespace("random")
dist = Namespace("dist")
device = Namespace("device")
io = Namespace("io")
profiler = Namespace("profiler")
