"""AdamW and the learning-rate schedule, written with facade ops only."""

from __future__ import annotations

import math

from mindspeed_core import autograd, nn, ops


def no_weight_decay(name: str, param) -> bool:
    """Megatron's rule: norms and biases (one-dimensional parameters) are not decayed."""
    return len(param.shape) == 1 or name.endswith(".bias")


class AdamW:
    def __init__(self, named_params, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8):
        self.named = [(n, p) for n, p in named_params if nn.requires_grad(p)]
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.decay = [not no_weight_decay(n, p) for n, p in self.named]
        # fp32 moments always; fp32 master weights only for low-precision parameters (an fp32
        # parameter is its own master)
        self.master = [None if ops.dtype_of(p) == "float32" else autograd.detach(ops.cast(p, "float32"))
                       for _, p in self.named]
        self.exp_avg = [ops.zeros(p.shape) for _, p in self.named]
        self.exp_avg_sq = [ops.zeros(p.shape) for _, p in self.named]
        self.steps = 0

    @property
    def params(self):
        return [p for _, p in self.named]

    def step(self, grads, lr: float) -> None:
        self.steps += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** self.steps, 1 - b2 ** self.steps
        with autograd.no_grad():
            for i, (_, p) in enumerate(self.named):
                g = ops.cast(grads[i], "float32")
                m = self.exp_avg[i] * b1 + g * (1 - b1)
                v = self.exp_avg_sq[i] * b2 + g * g * (1 - b2)
                w = autograd.detach(p) if self.master[i] is None else self.master[i]
                if self.decay[i] and self.weight_decay:
                    w = w * (1 - lr * self.weight_decay)
                w = w - (m / c1) / (ops.sqrt(v / c2) + self.eps) * lr
                self.exp_avg[i], self.exp_avg_sq[i] = m, v
                if self.master[i] is not None:
                    self.master[i] = w
                nn.assign(p, w)

    def state(self) -> dict:
        out = {}
        for (name, _), m, v, w in zip(self.named, self.exp_avg, self.exp_avg_sq, self.master):
            out[f"exp_avg.{name}"], out[f"exp_avg_sq.{name}"] = m, v
            if w is not None:
                out[f"master.{name}"] = w
        return out

    def load_state(self, tensors: dict, steps: int) -> None:
        from mindspeed_core.errors import CheckpointError

        for i, (name, p) in enumerate(self.named):
            stores = [("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)]
            if self.master[i] is not None:
                stores.append(("master", self.master))
            for key, store in stores:
                t = tensors.get(f"{key}.{name}")
                if t is None:
                    raise CheckpointError(f"optimizer state has no {key} for {name}")
                if tuple(t.shape) != tuple(p.shape):
                    raise CheckpointError(f"optimizer {key} of {name} has shape {tuple(t.shape)}, "
                                          f"the model's is {tuple(p.shape)}")
                store[i] = ops.cast(t, "float32")
        self.steps = steps


def clip_grad_norm(grads, max_norm: float):
    """Scale grads so their global L2 norm is at most max_norm; returns (grads, norm)."""
    total = ops.sum(ops.stack([ops.sum(ops.cast(g, "float32") ** 2) for g in grads]))
    norm = math.sqrt(float(ops.to_numpy(total)))
    if max_norm and max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        grads = [g * scale for g in grads]
    return grads, norm


def learning_rate(step: int, lr: float, min_lr: float, warmup: int, decay_iters: int, style: str) -> float:
    """Linear warmup to lr over ``warmup`` steps, then decay to min_lr by ``decay_iters``."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    if style == "constant":
        return lr
    span = max(decay_iters - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if style == "linear":
        return min_lr + (lr - min_lr) * (1 - progress)
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown --lr-decay-style {style!r} (constant, linear, cosine)")
