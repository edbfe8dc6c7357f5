"""mindspeed-core: one LLM training codebase for PyTorch and MindSpore.

The facade is reached as attributes of this package; importing it binds nothing (see
:mod:`mindspeed_core.frontend` and :mod:`mindspeed_core.runtime`)::

    from mindspeed_core import nn, ops, autograd, random, dist, device, io, profiler

Each name resolves, when first used, in the matching module of the bound backend
(``mindspeed_core.backends.torch.ops`` or ``mindspeed_core.backends.mindspore.ops``, ...);
both backends expose the same names, listed with their contracts in
:mod:`mindspeed_core.facade`.
"""

from mindspeed_core import runtime
from mindspeed_core.facade import NAMESPACES as FACADE_NAMESPACES  # noqa: F401
from mindspeed_core.frontend import autograd, device, dist, io, nn, ops, profiler, random  # noqa: F401
from mindspeed_core.runtime import bind, resolve, set_backend  # noqa: F401

__version__ = "0.1.0"


def get_backend() -> str:
    """Name of the framework the facade is (or would be) bound to."""
    return runtime.bound().NAME if runtime.is_bound() else runtime.resolve()
