"""How a step's micro-batches go through forward and backward on this rank.

A schedule takes the gradient function of one micro-batch (``grad_fn(ids, labels) ->
(scaled loss, gradients)``) and the step's micro-batches, and returns the step's mean loss
and mean gradients, unscaled. The optimizer, gradient reduction and logging do not care
which schedule ran. The first one is the plain loop; pipeline schedules come next to it.
"""

from __future__ import annotations

from mindspeed_core import ops


def forward_backward_no_pipelining(grad_fn, micro_batches, scale: float = 1.0,
                                   float32_grads: bool = False) -> tuple[float, list]:
    """Each micro-batch's forward and backward in turn, the gradients summed as they come.
    ``float32_grads``: low-precision gradients are accumulated in float32."""
    total_loss, grads, count = 0.0, None, 0
    for ids, labels in micro_batches:
        loss, g = grad_fn(ids, labels)
        total_loss += float(ops.to_numpy(loss)) / scale
        g = [ops.cast(x, "float32") for x in g] if float32_grads else g
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        count += 1
    if count == 0:
        raise ValueError("a step needs at least one micro-batch")
    if count > 1 or scale != 1.0:
        grads = [g / (count * scale) for g in grads]
    return total_loss / count, grads
