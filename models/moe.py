"""The mixture-of-experts MLP (Megatron-core's MoELayer), written against the facade.

A router (models/router.py) picks ``topk`` of ``num_experts`` expert MLPs per token; the
token's rows are sorted by expert, each expert's rows go through its MLP, and the results
come back to their tokens weighted by the routing weights. An optional shared expert (Qwen2-
MoE, DeepSeek) sees every token, optionally scaled by a sigmoid gate.

The experts' weights are stacked, ``experts.weight1`` [E, hidden, 2 x ffn] (gate columns
then up columns for SwiGLU) and ``experts.weight2`` [E, ffn, hidden], so one grouped matmul
(``ops.grouped_matmul``: the device's kernel where one is bound) runs every expert; the
sequential path runs them one by one with plain matmuls and is the reference.
"""

from __future__ import annotations

import math

import numpy as np

from mindspeed_core import composite, features, nn, ops
from mindspeed_core.models import router
from mindspeed_core.models.config import ModelConfig, MoEConfig
from mindspeed_core.models.gpt import MLP, GPTModel, Tokens
from mindspeed_core.models.layers import Linear, _param


def _activate(h, activation: str):
    if activation == "swiglu":
        return composite.swiglu(h)
    return ops.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig, num_local: int | None = None):
        super().__init__()
        self.activation = cfg.activation
        f = moe.ffn_hidden_size or cfg.ffn_hidden_size
        width = 2 * f if cfg.activation == "swiglu" else f
        n = num_local or moe.num_experts
        self.weight1 = _param((n, cfg.hidden_size, width), std=cfg.init_method_std)
        self.weight2 = _param((n, f, cfg.hidden_size), std=cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers))

    def forward(self, rows, counts, grouped: bool = True):
        """rows [N, hidden] sorted by expert, ``counts`` [E] host ints (rows per expert)."""
        if grouped:
            h = ops.grouped_matmul(rows, self.weight1, counts)
            return ops.grouped_matmul(_activate(h, self.activation), self.weight2, counts)
        outs, start = [], 0
        for e, n in enumerate(int(c) for c in counts):
            if n:
                h = _activate(ops.matmul(rows[start:start + n], self.weight1[e]), self.activation)
                outs.append(ops.matmul(h, self.weight2[e]))
            start += n
        if not outs:
            return ops.zeros((0, self.weight2.shape[-1]), dtype=ops.dtype_of(rows))
        return outs[0] if len(outs) == 1 else ops.cat(outs, dim=0)


class SharedExpert(nn.Module):
    """An MLP every token passes through; with a gate, scaled by sigmoid(x . gate_weight)."""

    def __init__(self, cfg: ModelConfig, size: int, gated: bool):
        super().__init__()
        self.activation = cfg.activation
        width = 2 * size if cfg.activation == "swiglu" else size
        self.linear_fc1 = Linear(cfg.hidden_size, width, False, cfg.init_method_std)
        self.linear_fc2 = Linear(size, cfg.hidden_size, False, cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers))
        self.gate_weight = _param((1, cfg.hidden_size), std=cfg.init_method_std) if gated else None

    def forward(self, x):
        y = self.linear_fc2(_activate(self.linear_fc1(x), self.activation))
        if self.gate_weight is not None:
            y = y * ops.sigmoid(ops.linear(x, self.gate_weight))
        return y


class MoELayer(nn.Module):
    """x [b, s, hidden] -> [b, s, hidden]; ``self.routing`` keeps the last call's routing
    (its aux and z losses, tokens per expert) for the model's loss, and ``self.stats`` sums
    them over the calls since ``reset_stats()`` for the log."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.router = Linear(cfg.hidden_size, moe.num_experts, False, cfg.init_method_std)
        self.experts = Experts(cfg, moe)
        self.shared_experts = (SharedExpert(cfg, moe.shared_expert_size, moe.shared_expert_gate)
                               if moe.shared_expert_size else None)
        # aux-loss-free balancing: state, not a parameter (updated from the loads, not by the optimizer)
        self.expert_bias = np.zeros(moe.num_experts, np.float32) if moe.enable_expert_bias else None
        self.grouped = "grouped_matmul" in cfg.fused  # --moe-grouped-gemm; else expert by expert
        self.routing = None
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"calls": 0, "aux_loss": 0.0, "z_loss": 0.0, "dropped": 0,
                      "tokens_per_expert": np.zeros(self.moe.num_experts, np.int64)}

    def forward(self, x):
        b, s, h = x.shape
        flat = ops.reshape(x, (b * s, h))
        logits = ops.cast(self.router(flat), "float32")
        bias = None if self.expert_bias is None else ops.tensor(self.expert_bias)
        routing = self.routing = router.route(logits, self.moe, bias, sequences=b)
        features.note_used("moe")
        if self.grouped:
            features.note_used("gmm")
        stats = self.stats
        stats["calls"] += 1
        stats["aux_loss"] += float(ops.to_numpy(routing.aux_loss))
        stats["z_loss"] += float(ops.to_numpy(routing.z_loss))
        stats["dropped"] += routing.dropped
        stats["tokens_per_expert"] += routing.tokens_per_expert
        pad_to = router.capacity(b * s, self.moe) if self.moe.pad_to_capacity else None
        y = ops.cast(combine(self.experts, flat, routing, self.grouped, pad_to), ops.dtype_of(x))
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return ops.reshape(y, (b, s, h))


def combine(experts: Experts, tokens, routing: router.Routing, grouped: bool, pad_to: int | None = None):
    """Each kept (token, expert) assignment through its expert, summed back per token with
    its weight: tokens [T, hidden] -> [T, hidden] float32. ``pad_to``: every expert takes
    exactly this many rows, zero rows after its own (--moe-pad-expert-input-to-capacity: fixed
    shapes for kernels that want them), whose outputs are dropped."""
    t, k = routing.experts.shape
    slots = np.flatnonzero(routing.kept.reshape(-1))  # assignment ids t * k + j
    order = slots[np.argsort(routing.experts.reshape(-1)[slots], kind="stable")]
    token_of = (order // k).astype(np.int64)
    counts = routing.tokens_per_expert
    if pad_to is None:
        rows = experts(ops.index_select(tokens, 0, ops.tensor(token_of)), counts, grouped)
    else:  # row t of [tokens; 0] is the zero row
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        padded = np.full((len(counts), pad_to), t, np.int64)
        for e, (start, n) in enumerate(zip(starts, counts)):
            padded[e, :n] = token_of[start:start + n]
        source = ops.cat([tokens, ops.zeros((1, tokens.shape[-1]), dtype=ops.dtype_of(tokens))], dim=0)
        out = experts(ops.index_select(source, 0, ops.tensor(padded.reshape(-1))), np.full(len(counts), pad_to),
                      grouped)
        real = np.concatenate([e * pad_to + np.arange(n) for e, n in enumerate(counts)]).astype(np.int64)
        rows = ops.index_select(out, 0, ops.tensor(real))
    # back to (token, slot) order by a gather (a scatter-add with repeated indices is not
    # deterministic on every CPU backend); dropped slots read a zero row and have weight 0
    h = tokens.shape[-1]
    where = np.full(t * k, len(order), np.int64)
    where[order] = np.arange(len(order))
    rows = ops.cat([ops.cast(rows, "float32"), ops.zeros((1, h))], dim=0)
    per_slot = ops.reshape(ops.index_select(rows, 0, ops.tensor(where)), (t, k, h))
    return ops.sum(per_slot * ops.unsqueeze(routing.weights, -1), dim=1)


class MoEModel(GPTModel):
    """The decoder-only transformer whose layers in ``cfg.moe_layers`` (all by default) have
    an MoE MLP: Mixtral, Qwen2-MoE, Qwen3-MoE. In training its loss adds the routers' aux and
    z losses (regularisers: evaluation reports the language-model loss alone)."""

    def make_mlp(self, number: int) -> nn.Module:
        return MoELayer(self.cfg, self.cfg.moe) if self.cfg.is_moe_layer(number) else MLP(self.cfg)

    def moe_layers(self) -> list:
        return [layer.mlp for layer in self.decoder.layers if isinstance(layer.mlp, MoELayer)]

    def router_losses(self):
        """The sum of this model's MoE layers' aux and z losses from its last forward."""
        total = ops.zeros(())
        for layer in self.moe_layers():
            total = total + layer.routing.aux_loss + layer.routing.z_loss
        return total

    def loss_from_logits(self, logits, labels, tokens: Tokens | None = None):
        loss = super().loss_from_logits(logits, labels, tokens)
        return loss + self.router_losses() if nn.is_training(self) else loss
