"""The facade bound to MindSpore (PyNative mode): CPU, GPU or Ascend."""

import os

# MindSpore logs every probe of an absent device (Ascend, GPU) as warnings; keep its C++ and
# Python logs to errors unless the user chose a level.
os.environ.setdefault("GLOG_v", "3")

import mindspore  # noqa: E402

from . import device  # noqa: E402  (first: it sizes the thread pools before any op starts them)

device.share_the_cores()

from . import autograd, dist, io, nn, ops, profiler, random  # noqa: E402

NAME = "mindspore"
FRAMEWORK_VERSION = mindspore.__version__

