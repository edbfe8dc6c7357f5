"""Dynamic loss scaling for fp16, with Megatron's defaults; a scale of 1 that never moves for
bf16 and fp32.

fp16 gradients of small losses underflow, so the loss is multiplied by a large scale before
backward and the gradients divided by it after. A step whose loss or gradient norm is not
finite overflowed: it is skipped and the scale halved. After GROWTH_INTERVAL clean steps the
scale doubles again.
"""

from __future__ import annotations

INITIAL_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 1000


class LossScaler:
    def __init__(self, dynamic: bool, initial: float | None = None):
        self.dynamic = dynamic
        self.scale = (initial or INITIAL_SCALE) if dynamic else 1.0
        self.clean_steps = 0

    def scale_loss(self, loss):
        return loss * self.scale if self.scale != 1.0 else loss

    def step_allowed(self, finite: bool) -> bool:
        """Whether the optimizer may step on this step's gradients; updates the scale. Only a
        dynamic scaler refuses (and only an overflowed step): elsewhere a non-finite value is
        the caller's error to report."""
        if not self.dynamic:
            return True
        if not finite:
            self.scale /= 2.0
            self.clean_steps = 0
            return False
        self.clean_steps += 1
        if self.clean_steps % GROWTH_INTERVAL == 0:
            self.scale *= 2.0
        return True

    def state(self) -> dict:
        return {"loss_scale": self.scale, "clean_steps": self.clean_steps}

    def load_state(self, state: dict) -> None:
        if self.dynamic:
            self.scale, self.clean_steps = float(state["loss_scale"]), int(state["clean_steps"])
