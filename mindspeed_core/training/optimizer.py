"""AdamW and the learning-rate schedule, written with facade ops only."""

from __future__ import annotations

import math

import numpy as np

from mindspeed_core import autograd, features, nn, ops
from mindspeed_core.errors import CheckpointError
from mindspeed_core.training import distributed


def adamw(weights, grads, exp_avgs, exp_avg_sqs, lr: float, weight_decays, betas, eps: float, step: int):
    """One AdamW step through the facade's fused op (the device's kernel where one is bound);
    returns the new (weights, exp_avgs, exp_avg_sqs); the inputs are consumed."""
    if ops.implementations()["adamw_step"] == "native":
        features.note_used("fused-adamw")
    return ops.adamw_step(weights, [ops.cast(g, "float32") for g in grads], exp_avgs, exp_avg_sqs, lr, betas[0],
                          betas[1], eps, weight_decays, step)


def moment_bytes(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def moment_pair(moment_dtype) -> tuple[str, str]:
    """(exp_avg's dtype, exp_avg_sq's): one name for both (--o2-optimizer), or a pair
    (--exp-avg-dtype, --exp-avg-sq-dtype)."""
    return (moment_dtype, moment_dtype) if isinstance(moment_dtype, str) else tuple(moment_dtype)


def widen(moments: list) -> list:
    """Moments as the fp32 the update computes in (--o2-optimizer keeps them in bf16)."""
    return [m if ops.dtype_of(m) == "float32" else ops.cast(m, "float32") for m in moments]


def narrow(moments: list, dtype: str) -> list:
    if dtype != "float32":
        features.note_used("low-precision-optimizer-states")
    return [m if dtype == "float32" else ops.cast(m, dtype) for m in moments]


def no_weight_decay(name: str, param) -> bool:
    """Megatron's rule: norms and biases (one-dimensional parameters) are not decayed; the experts'
    stacked biases [E, width] neither."""
    return len(param.shape) == 1 or name.endswith((".bias", ".experts.bias1", ".experts.bias2"))


class AdamW:
    """AdamW with its state replicated on every data-parallel rank.

    The trainer drives any optimizer through prepare (reduce the gradients over data-parallel
    ranks), grad_norm (the global norm) and step (clip coefficient applied): the distributed
    optimizer shards the same work (training/distributed_optimizer.py)."""

    def __init__(self, named_params, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8,
                 ps=None, plan=None, moment_dtype: str = "float32", bucket_elements: int | None = None):
        """``plan``: the parallel plan of these parameters (which are sharded over TP, which
        elements the global norm counts); None on one process. ``moment_dtype``: bfloat16 for
        MindSpeed's O2 optimizer (--o2-optimizer): the moments are kept in bf16 and widened
        to fp32 for each update; or a pair (exp_avg's, exp_avg_sq's: --exp-avg-dtype,
        --exp-avg-sq-dtype). ``bucket_elements``: --ddp-bucket-size."""
        self.bucket_elements = bucket_elements
        self.named = [(n, p) for n, p in named_params if nn.requires_grad(p)]
        self.ps = ps
        self.sharded = plan.sharded() if plan is not None else [False] * len(self.named)
        self.expert = plan.flags("expert") if plan is not None else [False] * len(self.named)
        weights = plan.norm_weights([p.shape for _, p in self.named]) if plan is not None else [None] * len(self.named)
        self.norm_weights = [None if w is None else ops.tensor(w) for w in weights]
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.decay = [not no_weight_decay(n, p) for n, p in self.named]
        self.moment_dtypes = moment_pair(moment_dtype)
        mine, adam = self._held_state()
        # fp32 master weights only for low-precision parameters (an fp32 parameter is its own
        # master); fp32 moments unless --o2-optimizer / --exp-avg-dtype say otherwise
        self.master = [None if ops.dtype_of(p) == "float32" or not m else autograd.detach(ops.cast(p, "float32"))
                       for (_, p), m in zip(self.named, mine)]
        self.exp_avg = [ops.zeros(p.shape, dtype=self.moment_dtypes[0]) if a else None
                        for (_, p), a in zip(self.named, adam)]
        self.exp_avg_sq = [ops.zeros(p.shape, dtype=self.moment_dtypes[1]) if a else None
                           for (_, p), a in zip(self.named, adam)]
        self.steps = 0

    def _held_state(self) -> tuple[list[bool], list[bool]]:
        """Per trained parameter: whether this rank keeps its state (a master where it needs one),
        and whether that state is Adam's two moments; here every parameter's, Adam's (Muon
        answers for its matrices and, layer-wise, for the parameters other ranks own)."""
        return [True] * len(self.named), [True] * len(self.named)

    def wants_state(self, name: str) -> bool:
        """Whether this rank loads the checkpoint's optimizer state of parameter ``name``."""
        return True

    @property
    def params(self):
        return [p for _, p in self.named]

    def buckets(self) -> list:
        """The buckets prepare reduces the gradients in (distributed.dp_buckets)."""
        if self.ps is None:
            return []
        return distributed.dp_buckets([ops.numel(p) for p in self.params], self.ps, self.expert, self.bucket_elements)

    def prepare(self, grads, reduced: list | None = None) -> list:
        """The gradients averaged over data-parallel ranks; ``reduced``: the sums of buckets()
        already made (overlapped with backward: training/overlap.py)."""
        if self.ps is None:
            return list(grads)
        if reduced is None:
            return distributed.average_over_dp(grads, self.ps, self.expert, self.bucket_elements)
        grads = list(grads)
        for bucket, total in zip(self.buckets(), reduced):
            distributed.put_back(grads, bucket, total, 1.0 / self.ps.size("dp_cp"))
        return grads

    def whole_gradients(self, grads) -> list:
        """Each trained parameter's gradient from what prepare gave (here: those)."""
        return list(grads)

    def grad_norm(self, grads) -> float:
        if self.ps is None:
            return math.sqrt(float(ops.to_numpy(ops.sum(ops.stack([distributed.sum_of_squares(g) for g in grads])))))
        return math.sqrt(distributed.grad_norm_squared(grads, self.sharded, self.ps, self.norm_weights, self.expert))

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (moments and fp32 masters)."""
        moments = sum(moment_bytes(ops.dtype_of(t)) * ops.numel(t) for t in self._moments())
        return 4 * sum(ops.numel(w) for w in self.master if w is not None) + moments

    def _moments(self) -> list:
        """The moment tensors this optimizer keeps (Muon: its momentum buffers too)."""
        return [t for t in self.exp_avg + self.exp_avg_sq if t is not None]

    def step(self, grads, lr: float, scale: float = 1.0, gather_later: bool = False) -> None:
        """``gather_later``: the distributed optimizer's; here every rank updates whole parameters."""
        self.steps += 1
        with autograd.no_grad():
            if scale != 1.0:
                grads = [g * scale for g in grads]
            # an fp32 parameter is updated itself (in place where the kernel is fused)
            weights = [p if w is None else w for (_, p), w in zip(self.named, self.master)]
            decays = [self.weight_decay if d else 0.0 for d in self.decay]
            weights, exp_avg, exp_avg_sq = adamw(weights, grads, widen(self.exp_avg), widen(self.exp_avg_sq), lr,
                                                 decays, self.betas, self.eps, self.steps)
            self.exp_avg, self.exp_avg_sq = (narrow(m, d) for m, d in zip((exp_avg, exp_avg_sq), self.moment_dtypes))
            self._store(weights)

    def scale_rows(self, param, factors) -> None:
        """Multiply the trained 2-D ``param``'s rows by ``factors`` (numpy [rows]), in its fp32 master
        where it has one (--qk-clip)."""
        i = next(i for i, (_, p) in enumerate(self.named) if p is param)
        with autograd.no_grad():
            weight = self.master[i] if self.master[i] is not None else ops.cast(param, "float32")
            scaled = weight * ops.tensor(np.asarray(factors, np.float32).reshape(-1, 1))
            if self.master[i] is not None:
                self.master[i] = scaled
            nn.assign(param, scaled)

    def _store(self, weights) -> None:
        """The updated fp32 ``weights``: kept as the masters where there are, and into the parameters."""
        for i, ((_, p), w) in enumerate(zip(self.named, weights)):
            if self.master[i] is not None:
                self.master[i] = w
            if w is not p:
                nn.assign(p, w)

    def state(self) -> dict:
        out = {}
        for (name, _), m, v, w in zip(self.named, self.exp_avg, self.exp_avg_sq, self.master):
            out[f"exp_avg.{name}"], out[f"exp_avg_sq.{name}"] = m, v
            if w is not None:
                out[f"master.{name}"] = w
        return out

    def held_state(self) -> list:
        """This rank's state as a sharded checkpoint writes it: (state name, parameter name, None
        (all of the parameter's elements), values as numpy)."""
        return [(k, k.split(".", 1)[1], None, ops.to_numpy(v)) for k, v in self.state().items()]

    def load_state(self, tensors: dict, steps: int) -> None:
        for i, (name, p) in enumerate(self.named):
            stores = [("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)]
            if self.master[i] is not None:
                stores.append(("master", self.master))
            for key, store in stores:
                t = tensors.get(f"{key}.{name}")
                if t is None and f"momentum.{name}" in tensors:
                    raise CheckpointError(f"the checkpoint's optimizer state of {name} is Muon's momentum: it was "
                                          f"saved with --optimizer muon; add it, or start from its weights with "
                                          f"--no-load-optim")
                if t is None:
                    raise CheckpointError(missing_state(key, name))
                if tuple(t.shape) != tuple(p.shape):
                    raise CheckpointError(f"optimizer {key} of {name} has shape {tuple(t.shape)}, "
                                          f"the model's is {tuple(p.shape)}")
                store[i] = ops.cast(t, "float32" if key == "master" else self.moment_dtypes[key == "exp_avg_sq"])
        self.steps = steps


def missing_state(key: str, name: str) -> str:
    """Why a checkpoint's optimizer state cannot be resumed: it trained other parameters."""
    return (f"the checkpoint's optimizer state has no {key} for {name}: the run that saved it trained other "
            f"parameters (LoRA adapters, or sparse attention's dense warm-up its indexers); start from its weights "
            f"with --finetune or --no-load-optim")


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
