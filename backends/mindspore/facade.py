"""The facade bound to MindSpore: the module the runtime binds (the package's own module
declares the backend without importing mindspore)."""

import mindspore

from . import NAME, device  # noqa: F401  (device first: it sizes the thread pools before any op starts them)

device.share_the_cores()

from . import autograd, dist, io, nn, ops, profiler, random  # noqa: E402,F401

FRAMEWORK_VERSION = mindspore.__version__
