"""Which framework the facade is bound to, decided once per process.

Precedence: the ``--ai-framework`` flag of an entry point, then ``set_backend()``, then the
environment variable ``MINDSPEED_AI_FRAMEWORK``, then the default ``pytorch``. Binding
imports the backend's facade (``mindspeed_core.backends.<name>.facade``; the package itself,
:func:`declaration`, imports no framework) and selects the device; it
happens once, before any model code runs, and binding to a second framework later in the
same process is an error: tensors, modules and parameters of one framework cannot be mixed
with the other's.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading

from mindspeed_core import usage
from mindspeed_core.errors import BackendError

ENV_VAR = "MINDSPEED_AI_FRAMEWORK"
DEVICE_ENV_VAR = "MINDSPEED_DEVICE"
DEFAULT = "pytorch"

# framework name -> its backend package (what it declares: backends/<name>/__init__.py)
FRAMEWORKS = {
    "pytorch": "mindspeed_core.backends.torch",
    "mindspore": "mindspeed_core.backends.mindspore",
}
DEVICES = ("auto", "cpu", "cuda", "npu", "gpu", "ascend")
DEVICE_ALIASES = {"gpu": "cuda", "ascend": "npu"}  # the one definition: every device flag takes them

_lock = threading.Lock()
_requested: str | None = None  # set_backend()
_requested_device: str | None = None
_bound = None  # the backend module once bound


def check_name(name: str) -> str:
    key = (name or "").strip().lower()
    if key not in FRAMEWORKS:
        raise BackendError(
            f"unknown AI framework {name!r}; choose one of: {', '.join(FRAMEWORKS)}"
        )
    return key


def declaration(name: str):
    """The backend package of framework ``name``, imported without its framework: NAME,
    IMPORT_NAME, EXTRA, FACADE, LAUNCHER, LAUNCH_ENV, launch_command()."""
    return importlib.import_module(FRAMEWORKS[check_name(name)])


def set_backend(name: str, device: str | None = None) -> None:
    """Choose the framework (and optionally the device) before anything is bound."""
    global _requested, _requested_device
    key = check_name(name)
    if _bound is not None and _bound.NAME != key:
        raise BackendError(
            f"the facade is already bound to {_bound.NAME} in this process; it cannot switch "
            f"to {key} (start a new process with --ai-framework {key})"
        )
    _requested = key
    if device is not None:
        _requested_device = device


def resolve(flag: str | None = None) -> str:
    """The framework name that binding would use, without binding."""
    if flag:
        return check_name(flag)
    if _requested:
        return _requested
    env = os.environ.get(ENV_VAR)
    if env:
        return check_name(env)
    return DEFAULT


def bind(flag: str | None = None, device: str | None = None):
    """Bind the facade (idempotent for the same framework) and return the backend module."""
    global _bound
    name = resolve(flag)
    with _lock:
        if _bound is not None:
            if _bound.NAME != name:
                raise BackendError(
                    f"the facade is already bound to {_bound.NAME} in this process; a second "
                    f"framework ({name}) cannot be bound (start a new process)"
                )
            wanted = DEVICE_ALIASES.get((device or "auto").lower(), (device or "auto").lower())
            if wanted != "auto" and wanted != _bound.device.type():
                raise BackendError(f"the facade is already bound to {_bound.device.type()} in this process; "
                                   f"--device {device} needs a new process")
            return _bound
        declared = declaration(name)
        try:
            backend = importlib.import_module(declared.FACADE)
        except ImportError as exc:
            if (exc.name or "").split(".")[0] != declared.IMPORT_NAME:
                raise
            raise BackendError(
                f"--ai-framework {name} needs the {declared.IMPORT_NAME!r} package, which cannot be "
                f"imported ({exc}); install it with: pip install 'mindspeed-core[{declared.EXTRA}]'"
            ) from None
        wanted = device or _requested_device or os.environ.get(DEVICE_ENV_VAR) or "auto"
        if wanted.lower() not in DEVICES:
            raise BackendError(f"unknown device {wanted!r}; choose one of: {', '.join(DEVICES)}")
        backend.ops.bind_fused(backend.device.select(wanted.lower()))
        _bound = usage.traced(backend)  # the backend itself unless a harness records what runs
        return backend


def bound():
    """The bound backend module, binding with the resolved defaults on first use."""
    return _bound if _bound is not None else bind()


def implementations() -> dict:
    """What runs natively and what is composed or emulated, on the bound framework/device."""
    b = bound()
    return {"ops": b.ops.implementations(), "dist": b.dist.implementations(), "random": b.random.implementation()}


def is_bound() -> bool:
    return _bound is not None


def exit_process(code) -> None:
    """End this process (an entry point's last call) with ``code`` (an int, None: 0). Bound to
    MindSpore, the exit handlers run and stdio is flushed, then the process leaves without the
    interpreter's teardown: there MindSpore's runtime crashes now and then (SIGSEGV with no Python
    frame left, after a rank had written everything: seen in two CI-sized runs of six), which turned
    finished jobs into failed ones. Other frameworks exit as usual."""
    code = 0 if code is None else int(code)
    if _bound is not None and _bound.NAME == "mindspore":
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or gone: nothing left to keep
                pass
        os._exit(code)
    sys.exit(code)
