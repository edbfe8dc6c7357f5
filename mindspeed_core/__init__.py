"""mindspeed-core: one LLM training codebase for PyTorch and MindSpore.

The facade is reached as attributes of this package and is bound to a framework on first
use (see :mod:`mindspeed_core.runtime`)::

    from mindspeed_core import nn, ops, autograd, random, dist, device, io, profiler

Each of those names is the matching module of the bound backend
(``mindspeed_core.backends.torch.ops`` or ``mindspeed_core.backends.mindspore.ops``, ...);
both backends expose the same names, listed with their contracts in
:mod:`mindspeed_core.facade`.
"""

import os as _os

from mindspeed_core.runtime import bind, resolve, set_backend  # noqa: F401

__version__ = "0.1.0"

FACADE_NAMESPACES = ("ops", "nn", "autograd", "random", "dist", "device", "io", "profiler")

# Run from a source checkout (no install), backends/, compat/ and models/ sit beside this
# folder rather than inside it; adding the checkout's root to the package path lets
# mindspeed_core.backends (and the others) resolve the same way they do once installed.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "backends")) and _os.path.isfile(
    _os.path.join(_root, "pyproject.toml")
):
    __path__.append(_root)  # noqa: F821 (__path__ exists in a package's __init__)


def get_backend() -> str:
    """Name of the framework the facade is (or would be) bound to."""
    from mindspeed_core import runtime

    return runtime.bound().NAME if runtime.is_bound() else runtime.resolve()


def __getattr__(name):
    if name in FACADE_NAMESPACES:
        from mindspeed_core import runtime

        return getattr(runtime.bound(), name)
    raise AttributeError(f"module 'mindspeed_core' has no attribute {name!r}")
