"""The distributed optimizer (--use-distributed-optimizer): AdamW whose state is sharded
over the data-parallel ranks (ZeRO stage 1, Megatron's DistributedOptimizer).

All trainable parameters of this rank are laid end to end in one flat float32 vector,
padded to a multiple of the data-parallel size; data-parallel rank r owns the r-th slice.
Per step:

    gradients   reduce-scattered (and averaged): each rank receives its slice only
    norm        sums of squares of the slices, all-reduced (sharded TP pieces also over TP)
    update      Adam on the slice, with fp32 master weights and moments for the slice only
    parameters  the updated slices all-gathered and copied back into the parameters

so each rank keeps 3/DP of the fp32 state (masters, two moments) instead of the full two
or three copies. Checkpoints hold the same full per-parameter state as plain AdamW, so a
run can switch optimizers or layouts when it resumes.
"""

from __future__ import annotations

import math

import numpy as np

from mindspeed_core import autograd, dist, features, nn, ops
from mindspeed_core.errors import CheckpointError
from mindspeed_core.training.distributed import over_pipeline, sum_of_squares
from mindspeed_core.training.optimizer import adamw, no_weight_decay


class DistributedAdamW:
    def __init__(self, named_params, lr: float, weight_decay: float, betas, eps: float, ps, plan):
        named_params = list(named_params)
        pairs = [(n, p, s) for (n, p), s in zip(named_params, plan.sharded()) if nn.requires_grad(p)]
        norm_weights = plan.norm_weights([p.shape for _, p in named_params])
        self.named = [(n, p) for n, p, _ in pairs]
        self.lr, self.weight_decay, self.betas, self.eps, self.ps = lr, weight_decay, betas, eps, ps
        self.sizes = [ops.numel(p) for _, p in self.named]
        total = sum(self.sizes)
        # sharded over the ranks holding the same parameters: DP, times CP with context parallelism
        self.ranks, self.group = ps.size("dp_cp"), ps.group("dp_cp")
        self.shard = -(-total // self.ranks)
        self.padded = self.shard * self.ranks
        self.start = ps.local_rank("dp_cp") * self.shard
        window = slice(self.start, self.start + self.shard)
        decay = np.zeros(self.padded, np.float32)
        tp_sharded = np.zeros(self.padded, np.float32)
        counted = np.zeros(self.padded, np.float32)  # elements the global norm counts on this rank
        weights = norm_weights or [None] * len(self.named)
        offset = 0
        for (name, p), (_, _, is_sharded), size, w in zip(self.named, pairs, self.sizes, weights):
            decay[offset:offset + size] = 0.0 if no_weight_decay(name, p) else weight_decay
            tp_sharded[offset:offset + size] = 1.0 if is_sharded else 0.0
            counted[offset:offset + size] = 1.0 if w is None else np.asarray(w, np.float32).reshape(-1)
            offset += size
        self.decay = ops.tensor(decay[window])
        self.tp_mask = ops.tensor(tp_sharded[window])
        self.counted = ops.tensor(counted[window])
        self.master = self._my_slice(self._flatten([autograd.detach(p) for _, p in self.named]))
        self.exp_avg = ops.zeros((self.shard,))
        self.exp_avg_sq = ops.zeros((self.shard,))
        self.steps = 0

    # -- flat layout ------------------------------------------------------------------------
    def _flatten(self, tensors):
        flat = ops.cat([ops.reshape(ops.cast(t, "float32"), (-1,)) for t in tensors])
        pad = self.padded - sum(self.sizes)
        return ops.cat([flat, ops.zeros((pad,))]) if pad else flat

    def _my_slice(self, flat):
        return flat[self.start:self.start + self.shard]

    def _unflatten(self, flat) -> list:
        pieces = ops.split(flat[: sum(self.sizes)], self.sizes)
        return [ops.reshape(x, tuple(p.shape)) for x, (_, p) in zip(pieces, self.named)]

    def _gather(self, part):
        return dist.all_gather(part, group=self.group) if self.ranks > 1 else part

    # -- the trainer's interface -------------------------------------------------------------
    def prepare(self, grads):
        flat = self._flatten(grads)
        if self.ranks == 1:
            return flat
        if self.ps.dp > 1:
            features.note_used("data-parallel")
        return dist.reduce_scatter(flat, group=self.group) * (1.0 / self.ranks)

    def grad_norm(self, g) -> float:
        counted = g * self.counted  # masks are 0/1, so squares of the masked gradient are the counted squares
        on_tp = sum_of_squares(counted * self.tp_mask)
        both = ops.stack([on_tp, sum_of_squares(counted) - on_tp])
        if self.ranks > 1:
            both = dist.all_reduce(both, group=self.group)
        sharded, replicated = (float(x) for x in ops.to_numpy(both))
        if self.ps.tp > 1:
            sharded = float(ops.to_numpy(dist.all_reduce(ops.tensor([sharded]), group=self.ps.group("tp")))[0])
        return math.sqrt(over_pipeline(sharded + replicated, self.ps))

    def step(self, g, lr: float, scale: float = 1.0) -> None:
        features.note_used("distributed-optimizer")
        self.steps += 1
        with autograd.no_grad():
            if scale != 1.0:
                g = g * scale
            # decoupled weight decay first (per element: the flat shard mixes decayed and
            # undecayed parameters), then the fused step without decay: the same update, as
            # Adam's term does not read the weights
            master = self.master - self.master * (self.decay * lr)
            (self.master,), (self.exp_avg,), (self.exp_avg_sq,) = adamw(
                [master], [g], [self.exp_avg], [self.exp_avg_sq], lr, [0.0], self.betas, self.eps, self.steps)
            for (_, p), value in zip(self.named, self._unflatten(self._gather(self.master))):
                nn.assign(p, value)

    def state_bytes(self) -> int:
        return 4 * 3 * self.shard

    # -- checkpoints: the same per-parameter state as plain AdamW ----------------------------
    def state(self) -> dict:
        out = {}
        for key, part in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq), ("master", self.master)):
            for (name, p), value in zip(self.named, self._unflatten(self._gather(part))):
                if key != "master" or ops.dtype_of(p) != "float32":
                    out[f"{key}.{name}"] = value
        return out

    def load_state(self, tensors: dict, steps: int) -> None:
        parts = {}
        for key in ("exp_avg", "exp_avg_sq", "master"):
            values = []
            for name, p in self.named:
                t = tensors.get(f"{key}.{name}")
                if t is None and key == "master":
                    t = autograd.detach(p)  # an fp32 parameter is its own master
                if t is None:
                    raise CheckpointError(f"optimizer state has no {key} for {name}")
                if tuple(t.shape) != tuple(p.shape):
                    raise CheckpointError(f"optimizer {key} of {name} has shape {tuple(t.shape)}, "
                                          f"the model's is {tuple(p.shape)}")
                values.append(t)
            parts[key] = self._my_slice(self._flatten(values))
        self.exp_avg, self.exp_avg_sq, self.master = parts["exp_avg"], parts["exp_avg_sq"], parts["master"]
        self.steps = steps
