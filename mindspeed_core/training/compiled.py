"""--compile: the training step's value_and_grad compiled (torch.compile; mindspore.jit trace
capture), its first call checked against eager on the same micro-batch and random state, so a
compiler that gets a gradient wrong stops the run in one line, never silently."""

from __future__ import annotations

import time

import numpy as np

from mindspeed_core import autograd, features, ops, random
from mindspeed_core.errors import MindSpeedError


class CheckedCompiledStep:
    """``(ids, labels, tokens=None) -> (loss, grads)`` like the eager gradient function it
    replaces. The loss scale is an input of the compiled graph (a constant would be frozen by
    MindSpore's trace capture); packed sequences and context parallelism are refused with
    --compile (the matrix's compile-context-parallel row), so no tokens reach it."""

    def __init__(self, model, params: list, names: list, eager, scaler, dtype: str, tensor_parallel: bool, say):
        features.note_used("compile")
        if tensor_parallel:
            features.note_used("compile-tensor-parallel")
        self.compiled = autograd.compiled_value_and_grad(lambda ids, labels, scale: model.loss(ids, labels) * scale,
                                                         params, model)
        self.names, self.eager, self.scaler, self.dtype, self.say = names, eager, scaler, dtype, say
        self.seconds = None  # the first call's duration, compilation included

    def _call(self, ids, labels):
        return self.compiled(ids, labels, ops.tensor(np.float32(self.scaler.scale)))

    def __call__(self, ids, labels, tokens=None):
        if self.seconds is None:
            self.check(ids, labels)
        return self._call(ids, labels)

    def check(self, ids, labels) -> None:
        """Eager and compiled gradients of one micro-batch from the same random state (which is
        left as it was). Eager first: the model's caches (RoPE tables) are filled before the
        compiler sees them, or it would compile the step again once they are."""
        saved = random.get_state(), random.tracker().get_states()
        eager_loss, eager = self.eager(ids, labels)
        random.set_state(saved[0])
        random.tracker().set_states(saved[1])
        start = time.perf_counter()
        loss, grads = self._call(ids, labels)
        grads = [ops.to_numpy(g) for g in grads]
        self.seconds = time.perf_counter() - start
        random.set_state(saved[0])
        random.tracker().set_states(saved[1])
        worst, where = 0.0, None
        for name, c, e in zip(self.names, grads, eager):
            e = ops.to_numpy(e).astype(np.float64)
            diff = float(np.abs(c.astype(np.float64) - e).max()) / max(float(np.abs(e).max()), 1e-12)
            if not diff <= worst:  # also catches NaN
                worst, where = diff, name
        loss, eager_loss = float(ops.to_numpy(loss)), float(ops.to_numpy(eager_loss))
        tol = 1e-4 if self.dtype == "float32" else 3e-2
        if not (worst <= tol and abs(loss - eager_loss) <= tol * max(abs(eager_loss), 1.0)):
            raise MindSpeedError(f"--compile: the compiled step disagrees with eager on the first micro-batch (loss "
                                 f"{loss:.6g} vs {eager_loss:.6g}; gradient of {where} off by {worst:.2g} relative): "
                                 f"run without --compile")
        self.say(f"--compile: compiled in {self.seconds:.1f} s; first-step gradients match eager "
                 f"(largest relative difference {worst:.1e})")
