"""--compile: the training step's value_and_grad compiled (torch.compile; mindspore.jit trace
capture), its first call checked against eager on the same micro-batch and random state, so a
compiler that gets a gradient wrong stops the run in one line, never silently."""

from __future__ import annotations

import copy
import time

import numpy as np

from mindspeed_core import autograd, features, ops, random
from mindspeed_core.errors import MindSpeedError


class CheckedCompiledStep:
    """``(ids, labels, tokens=None) -> (loss, grads)`` like the eager gradient function it
    replaces. The loss scale is an input of the compiled graph (a constant would be frozen by
    MindSpore's trace capture). Packed sequences and instruction data are refused with --compile
    (the matrix's compile-packed-sequences row); a micro-batch that still brings positions,
    documents or a loss mask (a packed pre-training dataset) stops the run here."""

    def __init__(self, model, params: list, names: list, eager, scaler, dtype: str, ps, say):
        _note_layout(ps)
        self.model, self.moe = model, getattr(model, "moe_layers", list)()
        if self.moe:
            self.biased = [layer for layer in self.moe if layer.router.expert_bias is not None]
            self.compiled = autograd.compiled_value_and_grad(self._moe_step, params, model, has_aux=True)
        else:
            self.compiled = autograd.compiled_value_and_grad(
                lambda ids, labels, scale: model.loss(ids, labels) * scale, params, model)
        self.names, self.eager, self.scaler, self.dtype, self.say = names, eager, scaler, dtype, say
        self.seconds = None  # the first call's duration, compilation included

    def _moe_step(self, ids, labels, scale, *biases):
        """The MoE model's step as the graph runs it: routing on the device (models/router.py
        route_on_device), the routers' losses in the gradient but not in the reported loss, and
        each layer's routing figures out for the log and the expert-bias update. The expert
        biases are inputs (a trace would freeze them as constants; the loads move them)."""
        for layer in self.moe:
            layer.on_device = True
        for layer, bias in zip(self.biased, biases):
            layer.bias_input = bias
        try:
            loss = self.model.loss(ids, labels) * scale
            figures = ops.stack([layer.figures() for layer in self.moe])
            return loss + self.model.router_losses() * scale, loss, figures
        finally:
            for layer in self.moe:
                layer.on_device, layer.bias_input = False, None

    def _call(self, ids, labels):
        scale = ops.tensor(np.float32(self.scaler.scale))
        if not self.moe:
            return self.compiled(ids, labels, scale)
        (_, (loss, figures)), grads = self.compiled(ids, labels, scale,
                                                    *(layer.router.expert_bias for layer in self.biased))
        for layer, row in zip(self.moe, ops.to_numpy(figures)):
            layer.record(row)
        return loss, grads

    def __call__(self, ids, labels, tokens=None):
        _no_tokens(tokens)
        if self.seconds is None:
            return self.check(ids, labels)
        return self._call(ids, labels)

    def check(self, ids, labels) -> tuple:
        """Eager and compiled gradients of one micro-batch from the same random state; returns
        the compiled step's (loss, gradients), the random state left after its draws. Eager
        first: the model's caches (RoPE tables) are filled before the compiler sees them, or it
        would compile the step again once they are."""
        saved = random.get_state(), random.tracker().get_states()
        stats = [copy.deepcopy(layer.stats) for layer in self.moe]
        eager_loss, eager = self.eager(ids, labels)
        for layer, before in zip(self.moe, stats):  # the micro-batch is counted once, by the compiled step
            layer.stats = before
        random.set_state(saved[0])
        random.tracker().set_states(saved[1])
        start = time.perf_counter()
        loss, grads = self._call(ids, labels)
        ops.to_numpy(loss)  # the step has run (MindSpore returns before it has)
        self.seconds = time.perf_counter() - start
        worst = _agree(zip(self.names, grads, eager), loss, eager_loss, self.dtype)
        self.say(f"--compile: compiled in {self.seconds:.1f} s; first-step gradients match eager "
                 f"(largest relative difference {worst:.1e})")
        return loss, grads


def _packed_refusal() -> MindSpeedError:
    return MindSpeedError(f"{features.get('compile-packed-sequences').pytorch.note}: this data brings them (a packed "
                          f"dataset); run without --compile")


def check_data(splits: dict) -> None:
    """Refuse a packed dataset (its samples' padding is masked out of the loss) at the start."""
    if any(getattr(data, "packed", False) for data in splits.values() if data is not None):
        raise _packed_refusal()


def _note_layout(ps) -> None:
    """The matrix's compile rows this run's layout exercises."""
    features.note_used("compile")
    for axis, row in (("tp", "compile-tensor-parallel"), ("pp", "compile-pipeline"), ("cp", "compile-context-parallel")):
        if ps.size(axis) > 1:
            features.note_used(row)


def _no_tokens(tokens) -> None:
    if tokens is not None:  # the compiled loss would train as if they were not there
        raise _packed_refusal()


def _agree(named_pairs, value, eager_value, dtype: str) -> float:
    """The largest relative difference of the compiled gradients from eager's; stops the run
    in one line when it (or the value's) is over the dtype's tolerance."""
    worst, where = 0.0, None
    for name, c, e in named_pairs:
        if c is None or e is None:
            continue
        c, e = ops.to_numpy(c).astype(np.float64), ops.to_numpy(e).astype(np.float64)
        diff = float(np.abs(c - e).max()) / max(float(np.abs(e).max()), 1e-12)
        if not diff <= worst:  # also catches NaN
            worst, where = diff, name
    value, eager_value = ops.to_numpy(value).astype(np.float64), ops.to_numpy(eager_value).astype(np.float64)
    off = float(np.abs(value - eager_value).max()) / max(float(np.abs(eager_value).max()), 1.0)
    tol = 1e-4 if dtype == "float32" else 3e-2
    if not (worst <= tol and off <= tol):
        raise MindSpeedError(f"--compile: the compiled step disagrees with eager on the first micro-batch (output off "
                             f"by {off:.2g} relative; gradient of {where} off by {worst:.2g} relative): run without "
                             f"--compile")
    return worst


class CheckedCompiledStage:
    """The pipeline schedule's per-chunk vjp (schedules.PipelineStage.vjp) with each model
    chunk's forward compiled (autograd.compiled_vjp). ``forward(chunk, x, labels=None,
    scale=None)``: hidden states, or on the last stage the loss times the scale (an input of
    the graph, as in CheckedCompiledStep). The first micro-batch through each chunk also runs
    eager from the same random state, and its backward compares the two."""

    def __init__(self, forward, chunk_params: list, chunks: list, names: list, scaler, dtype: str, ps, say):
        _note_layout(ps)
        self.compiled = [autograd.compiled_vjp(self._of_chunk(c), params, module)
                         for c, (params, module) in enumerate(zip(chunk_params, chunks))]
        self.forward, self.params, self.names = forward, chunk_params, names
        self.scaler, self.dtype, self.say = scaler, dtype, say
        self.checked: set = set()

    def _of_chunk(self, chunk: int):
        def forward(*inputs):  # a function, not a partial: MindSpore's vjp reads its __name__
            return self.forward(chunk, *inputs)
        return forward

    def __call__(self, chunk: int, x, labels, tokens, interleaved: bool):
        _no_tokens(tokens)
        inputs = [x] if labels is None else [x, labels, ops.tensor(np.float32(self.scaler.scale))]
        if (chunk, len(inputs)) in self.checked:
            return self.compiled[chunk](inputs, interleaved)
        self.checked.add((chunk, len(inputs)))
        saved = random.get_state(), random.tracker().get_states()
        eager_out, eager_backward = autograd.vjp(self._of_chunk(chunk), inputs, self.params[chunk],
                                                 interleaved=True)
        random.set_state(saved[0])
        random.tracker().set_states(saved[1])
        start = time.perf_counter()
        out, backward = self.compiled[chunk](inputs, interleaved)

        def checked_backward(cotangent):
            eager_inputs, eager_params = eager_backward(cotangent)
            input_grads, param_grads = backward(cotangent)
            worst = _agree([("the stage's input", input_grads[0], eager_inputs[0]),
                            *zip(self.names[chunk], param_grads, eager_params)], out, eager_out, self.dtype)
            self.say(f"--compile: model chunk {chunk}{' with the loss' if labels is not None else ''} compiled in "
                     f"{time.perf_counter() - start:.1f} s; first-step gradients match eager (largest relative "
                     f"difference {worst:.1e})")
            return input_grads, param_grads

        return out, checked_backward
