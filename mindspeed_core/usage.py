"""What ran: a per-process record of the features and facade names a run actually used.

The feature matrix promises that every supported or emulated cell is tested; a test only
proves a cell when the code that implements the feature ran during it. The places where a
feature takes effect call :func:`mindspeed_core.features.note_used`, and, while recording
is on, every call of a facade name is noted too (:func:`traced`). Notes go to the file
named by ``MINDSPEED_USAGE_FILE`` (one name per line, appended), so launched ranks and
subprocesses report to the process that started them; without that variable nothing is
recorded and the facade is the backend's own modules (no cost in training runs).
"""

from __future__ import annotations

import inspect
import os

from mindspeed_core import facade

ENV_VAR = "MINDSPEED_USAGE_FILE"

# names already written to the file since the last reset(); a dict, not a set: a compiler
# tracing the facade (torch.compile) then guards on the one name each call looks up, not on
# the whole collection, so names noted after a compilation do not force another
_seen: dict = {}


def enabled() -> bool:
    return bool(os.environ.get(ENV_VAR))


def note(name: str) -> None:
    """Record ``name`` ("feature:<id>" or "facade:<namespace>.<name>") once per reset."""
    if name in _seen:
        return
    path = os.environ.get(ENV_VAR)
    if not path:
        return
    _seen[name] = True
    # one short O_APPEND write per name: lines from concurrent ranks do not interleave
    with open(path, "a") as fh:
        fh.write(name + "\n")


def reset() -> None:
    """Forget what was written, so that the next use of each name is written again (the
    test harness calls it between tests to attribute uses to each test)."""
    _seen.clear()


def read(path: str, offset: int = 0) -> tuple[set, int]:
    """The names recorded in ``path`` from byte ``offset`` on, and the offset after them."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return set(), offset
    end = offset + data.rfind(b"\n") + 1  # a line still being written is read next time
    return set(data[: end - offset].decode().split()), end


# ---- facade tracing --------------------------------------------------------------------------

def _recording(func, name: str):
    key = "facade:" + name

    def call(*args, **kwargs):
        if key not in _seen:
            note(key)
        return func(*args, **kwargs)

    call.__name__, call.__doc__, call.__wrapped__ = getattr(func, "__name__", name), func.__doc__, func
    return call


class _TracedNamespace:
    """A facade namespace (ops, nn, ...) whose listed names note their use: functions when
    called, classes and sub-namespaces (nn.Module, nn.init) when looked up."""

    def __init__(self, module, prefix: str, names):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_names", frozenset(names))
        object.__setattr__(self, "_wrapped", {})

    def __getattr__(self, attr):
        value = getattr(self._module, attr)
        if attr not in self._names:
            return value
        name = f"{self._prefix}.{attr}"
        if inspect.isclass(value) or not callable(value):
            note("facade:" + name)
            return value
        wrapped = self._wrapped.get(attr)
        if wrapped is None or wrapped.__wrapped__ is not value:  # rebinding (bind_fused) replaces it
            wrapped = self._wrapped[attr] = _recording(value, name)
        return wrapped

    def __setattr__(self, attr, value):
        setattr(self._module, attr, value)


class _TracedBackend:
    def __init__(self, backend, spec: dict):
        object.__setattr__(self, "_backend", backend)
        for namespace, names in spec.items():
            object.__setattr__(self, namespace, _TracedNamespace(getattr(backend, namespace), namespace, names))

    def __getattr__(self, attr):
        return getattr(self._backend, attr)


def traced(backend):
    """The backend seen through recording namespaces, when recording is on; else itself."""
    if not enabled():
        return backend
    return _TracedBackend(backend, facade.SPEC)
