"""The parallel plan: per parameter of this rank, how it is laid out over the ranks and what
its gradient needs before the optimizer may use it.

``mindspeed_core.parallel.layers.parallelize`` makes one for each model chunk; the trainer
joins the chunks' plans. Gradient reduction, the global gradient norm, both optimizers and
checkpoints read this one structure (nothing reads attributes off the model).

Per parameter (``ParamPlan``):

    name        the whole model's name (checkpoints: independent of the layout)
    shard       how tensor parallelism cuts it (see parallel.sharding.shard), None: replicated
    partial     its gradient is a partial sum over the tensor-parallel group (sequence
                parallelism: replicated weights inside the decoder saw a slice of the tokens)
    kv_copies   its rows from ``kv.q_rows`` on are key/value heads copied to several TP ranks:
                their gradients are summed over ``kv.group``, and the norm counts them on one
    tied_copy   the last pipeline stage's copy of the tied word embeddings: its gradient is
                summed with the first stage's (the embedding group); the norm counts it there
    expert      an MoE layer's stacked expert weights: this rank holds 1/EP of the experts
                (dim 0, cut over the expert-parallel group before any TP cut); its gradient
                is averaged over the expert-data-parallel group, the norm sums it over EP
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ParamPlan:
    name: str
    shard: tuple | None = None
    partial: bool = False
    kv_copies: bool = False
    tied_copy: bool = False
    expert: bool = False


@dataclass(frozen=True)
class KVCopies:
    group: object  # the ranks sharing one key/value head
    q_rows: int  # rows before the key/value rows of the fused qkv shard
    copy_index: int  # this rank's place among them (0 counts the rows in the norm)


@dataclass
class ParallelPlan:
    params: list = field(default_factory=list)  # ParamPlan per parameter, in the trainer's order
    kv: KVCopies | None = None

    @staticmethod
    def join(plans) -> "ParallelPlan":
        plans = list(plans)
        kv = next((p.kv for p in plans if p.kv is not None), None)
        return ParallelPlan([q for p in plans for q in p.params], kv)

    def subset(self, keep: list[bool]) -> "ParallelPlan":
        """The plan of the parameters ``keep`` marks, in order (the trained ones: LoRA)."""
        return ParallelPlan([p for p, k in zip(self.params, keep) if k], self.kv)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    @property
    def shard_specs(self) -> dict:
        """{whole-model name: shard spec} of the parameters tensor parallelism cuts."""
        return {p.name: p.shard for p in self.params if p.shard is not None}

    @property
    def expert_names(self) -> set:
        """Whole-model names of the parameters cut over the expert-parallel group."""
        return {p.name for p in self.params if p.expert}

    def flags(self, what: str) -> list[bool]:
        return [bool(getattr(p, what)) for p in self.params]

    def indices(self, what: str) -> list[int]:
        return [i for i, p in enumerate(self.params) if getattr(p, what)]

    def sharded(self) -> list[bool]:
        return [p.shard is not None for p in self.params]

    def norm_weights(self, shapes) -> list:
        """Per parameter: None (every element counts in the global norm) or a 0/1 mask:
        key/value copies count on one rank of those sharing them, a tied copy not at all."""
        out = []
        for p, shape in zip(self.params, shapes):
            if p.tied_copy:
                out.append(np.zeros(tuple(shape), np.float32))
            elif p.kv_copies and self.kv is not None and self.kv.copy_index:
                mask = np.ones(tuple(shape), np.float32)
                mask[self.kv.q_rows:] = 0.0
                out.append(mask)
            else:
                out.append(None)
        return out
