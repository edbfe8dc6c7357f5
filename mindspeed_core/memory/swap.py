"""--swap-attention (MindSpeed): what a layer's attention block (its input norm and self
attention) saves for backward is copied to host memory as forward produces it, and copied
back when backward asks for it. Device memory then holds, between a layer's forward and its
backward, only what the rest of the layer saved.

It rides on the framework's saved-tensor hooks (facade autograd.saved_tensors_hooks):
PyTorch has them; MindSpore does not, and the feature matrix refuses the flag there. The
copy back happens on demand, when the backward of the op that saved the tensor runs; on a
device with copy engines it could be issued one layer ahead, which this CPU-only project
cannot measure and does not do.
"""

from __future__ import annotations

import contextlib
import weakref

from mindspeed_core import autograd, device, features, ops

_ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "int8": 1,
             "uint8": 1, "bool": 1}


class _HostCopy:
    def __init__(self, tensor, size: int):
        self.tensor, self.size, self.readers = tensor, size, 0


class HostSwap:
    """Moves saved tensors of the blocks run under ``block()`` to host memory, and counts
    the bytes: ``host_bytes`` held now, ``peak_host_bytes``, ``swapped`` tensors so far. A
    tensor several operations save (a block's input, say) is copied once."""

    def __init__(self, min_bytes: int = 1024):
        self.min_bytes = min_bytes  # smaller tensors are not worth a copy each way
        self.host_bytes = self.peak_host_bytes = self.swapped = 0
        self._copies = {}  # id(tensor) -> (weak reference, _HostCopy), within one block

    def _pack(self, x, storage):
        size = ops.numel(x) * _ITEMSIZE[ops.dtype_of(x)]  # the view's own bytes: what is copied
        if size < self.min_bytes:
            return False, x
        known = self._copies.get(id(x))
        if known is not None and known[0]() is x:
            copy = known[1]
        else:
            copy = _HostCopy(device.to_host(x), size)
            self._copies[id(x)] = (weakref.ref(x), copy)
            self.swapped += 1
            self.host_bytes += size
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        copy.readers += 1
        return True, copy

    def _unpack(self, packed):
        moved, value = packed
        if not moved:
            return value
        value.readers -= 1
        if value.readers == 0:  # the last backward that needs it: the host memory is done
            self.host_bytes -= value.size
        return device.to_device(value.tensor)

    @contextlib.contextmanager
    def block(self):
        features.note_used("swap-attention")
        try:
            with autograd.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._copies.clear()
