"""Mixture-of-experts routing (Megatron's TopKRouter): which experts each token goes to, with
what weight, and the losses that keep the experts evenly loaded.

Scores are the softmax (Mixtral, Qwen-MoE) or the sigmoid (DeepSeek-V3) of the router's
logits over all experts. Each token takes the top-k experts by score (plus, with
aux-loss-free balancing, a per-expert bias that shifts the choice but not the weight; with
group-limited routing only among the experts of its best groups, a group scoring the sum of
its two best experts). The weights are the chosen scores, renormalised to sum to one when
``norm_topk_prob``, times ``scaling_factor``.

Losses, added to the language-model loss by the model:
    aux_loss      coeff * E / k * sum_e f_e * P_e over the micro-batch: f_e the fraction of
                  the tokens routed to expert e (each token counted k times), P_e its mean
                  score (sigmoid scores normalised per token first)
    seq_aux_loss  the same per sequence, averaged over the sequences (DeepSeek-V3)
    z_loss        coeff * mean over tokens of logsumexp(logits)^2
With a capacity factor each expert takes at most ceil(T k / E * factor) of the T tokens'
assignments; the rest are dropped (weight 0): those of lowest weight ("probs") or the last
in token order ("position").

Selection (indices, capacity) is decided on the host: it has no gradient, and the
dispatchers need the counts there anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mindspeed_core import autograd, features, ops
from mindspeed_core.models.config import MoEConfig


@dataclass
class Routing:
    weights: object  # [T, k] float32 tensor, 0 where dropped; differentiable to the logits
    experts: np.ndarray  # [T, k] int64: the chosen experts
    kept: np.ndarray  # [T, k] bool: False where the assignment was dropped over capacity
    aux_loss: object  # scalar tensor (0 when not asked for)
    z_loss: object  # scalar tensor (0 when not asked for)
    tokens_per_expert: np.ndarray  # [E] int64: assignments each expert computes (after dropping)

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())


def scores_of(logits, moe: MoEConfig):
    """[T, E] scores from the router's logits [T, E] (float32)."""
    return ops.softmax(logits, dim=-1) if moe.score_function == "softmax" else ops.sigmoid(logits)


def select(scores, moe: MoEConfig, expert_bias=None) -> np.ndarray:
    """[T, k] chosen experts (host int64), by score plus the bias, within the best groups."""
    choice = scores if expert_bias is None else ops.add(scores, expert_bias)
    if moe.num_groups is not None:
        t, e = choice.shape
        per_group = e // moe.num_groups
        grouped = ops.reshape(choice, (t, moe.num_groups, per_group))
        best, _ = ops.topk(grouped, min(2, per_group), dim=-1)
        _, groups = ops.topk(ops.sum(best, dim=-1), moe.group_topk, dim=-1)  # [T, group_topk]
        allowed = np.zeros((t, moe.num_groups), bool)
        np.put_along_axis(allowed, ops.to_numpy(groups).astype(np.int64), True, axis=1)
        allowed = np.repeat(allowed, per_group, axis=1)
        # experts outside the chosen groups can never win (every score is finite)
        choice = ops.masked_fill(choice, ops.tensor(~allowed), float("-inf"))
    _, idx = ops.topk(choice, moe.topk, dim=-1)
    return ops.to_numpy(idx).astype(np.int64)


def capacity(tokens: int, moe: MoEConfig) -> int | None:
    """Assignments an expert may take, or None without a capacity factor."""
    if moe.capacity_factor is None:
        return None
    return math.ceil(tokens * moe.topk / moe.num_experts * moe.capacity_factor)


def keep_within_capacity(experts: np.ndarray, weights: np.ndarray, moe: MoEConfig, cap: int | None) -> np.ndarray:
    """[T, k] bool: which assignments each expert keeps within ``cap``; by ``drop_policy``
    the highest-weight ones (ties: earlier token first) or the first in token order."""
    kept = np.ones(experts.shape, bool)
    if cap is None:
        return kept
    flat_e, flat_w = experts.reshape(-1), weights.reshape(-1)
    token = np.repeat(np.arange(experts.shape[0]), experts.shape[1])
    for e in np.unique(flat_e):
        rows = np.flatnonzero(flat_e == e)
        if len(rows) <= cap:
            continue
        if moe.drop_policy == "probs":
            order = rows[np.lexsort((token[rows], -flat_w[rows]))]
        else:
            order = rows[np.argsort(token[rows], kind="stable")]
        kept.reshape(-1)[order[cap:]] = False
    return kept


def balance_loss(scores, experts: np.ndarray, moe: MoEConfig, sequences: int, counts_over=None):
    """The load-balancing loss (aux_loss or seq_aux_loss) before its coefficient. ``counts_over``
    (MoESeams.sequence_counts): where the T tokens are one share of n of each sequence (context
    parallelism), the fractions count the whole sequences' assignments, the mean scores stay this
    share's, so the shares' mean of the loss (and of its gradient) is the whole sequences'."""
    t, e = scores.shape
    groups = 1 if moe.load_balancing_type == "aux_loss" else sequences
    if t % groups:
        raise ValueError(f"{t} tokens do not split into {groups} sequences")
    per = t // groups
    counts = np.zeros((groups, e), np.float32)
    for g in range(groups):
        np.add.at(counts[g], experts[g * per:(g + 1) * per].reshape(-1), 1.0)
    counts, shares = (counts, 1) if counts_over is None else counts_over(counts)
    return _balance(scores, ops.tensor(counts / (per * shares)), moe, groups)


def _balance(scores, fraction, moe: MoEConfig, groups: int):
    """sum_e f_e P_e (times E / k, averaged over the groups) from ``fraction`` [groups, E]: f_e,
    the assignments to expert e per token of the group."""
    t, e = scores.shape
    probs = scores if moe.score_function == "softmax" else scores / ops.sum(scores, dim=-1, keepdim=True)
    mean_probs = ops.mean(ops.reshape(probs, (groups, t // groups, e)), dim=1)  # P_e per group
    return ops.sum(mean_probs * fraction) * (e / moe.topk / groups)


def z_loss(logits):
    return ops.mean(ops.logsumexp(logits, dim=-1) ** 2)


def route(logits, moe: MoEConfig, expert_bias=None, sequences: int = 1, counts_over=None,
          training: bool = False) -> Routing:
    """Route T tokens from the router's logits [T, E] (float32). ``expert_bias`` [E] tensor
    (aux-loss-free balancing) or None; ``sequences``: how many sequences the T tokens are,
    consecutive rows each (seq_aux_loss); ``counts_over``: see balance_loss; ``training``: a
    routing that samples in training (SparseMixer) draws its choice."""
    if moe.sparsemixer:
        return sparsemixer(logits, moe, sparsemixer_draws(*logits.shape) if training else None)
    scores = scores_of(logits, moe)
    experts = select(scores, moe, expert_bias)
    weights = ops.gather(scores, 1, ops.tensor(experts))
    if moe.norm_topk_prob and moe.topk > 1:
        weights = weights / ops.sum(weights, dim=-1, keepdim=True)
    if moe.scaling_factor != 1.0:
        weights = weights * moe.scaling_factor
    kept = keep_within_capacity(experts, ops.to_numpy(weights), moe, capacity(logits.shape[0], moe))
    if not kept.all():
        weights = weights * ops.tensor(kept.astype(np.float32))
    zero = ops.zeros(())
    aux = zero
    if moe.balanced:
        aux = balance_loss(scores, experts, moe, sequences, counts_over) * moe.aux_loss_coeff
    z = z_loss(logits) * moe.z_loss_coeff if moe.z_loss_coeff > 0 else zero
    tokens = np.bincount(experts[kept], minlength=moe.slots).astype(np.int64)
    return Routing(weights, experts, kept, aux, z, tokens)


@dataclass
class SparseMixerDraws:
    """Training's random draws for SparseMixer's two choices (j = 0, 1): ``exponential`` [2, T, E]
    float32 Exp(1) samples (the Gumbel noise is minus their log), ``uniform`` [2, T] float32 in
    [0, 1) (whether a choice other than the top one takes Heun's full weight)."""
    exponential: np.ndarray
    uniform: np.ndarray


def sparsemixer_draws(t: int, e: int) -> SparseMixerDraws:
    """The draws from the framework's default stream (the same on every TP rank; recompute
    restores it), Exp(1) as -log(1 - u), kept above zero so that a masked expert's -inf minus
    the noise's log stays -inf."""
    u = ops.to_numpy(ops.rand((2, t, e))).astype(np.float32)
    exponential = np.maximum(-np.log1p(-u), np.finfo(np.float32).tiny).astype(np.float32)
    return SparseMixerDraws(exponential, ops.to_numpy(ops.rand((2, t))).astype(np.float32))


HEUN_AWAY = np.float32(0.3333)  # the weight factor of a sampled choice that is not the top expert (1/3)


def sparsemixer(logits, moe: MoEConfig, draws: SparseMixerDraws | None = None) -> Routing:
    """Phi-3.5-MoE's routing (SparseMixer, as transformers and MindSpeed-LLM compute it): the
    logits more than 2 eps below the top one (relative: (top - s) / max(|s|, top) > 2 eps) are
    set aside; the first expert is the top logit, its weight its softmax over the rest. The
    second is chosen the same way among the others (the first set aside too), weighed against
    its own threshold. The weights are not renormalised; there is no balancing loss.

    In training (``draws`` given) each choice is sampled instead: the argmax of the kept logits
    plus Gumbel noise (-log of the exponential draws), and its weight's gradient is Heun's
    third-order estimate: the value is the softmax weight times 1 where the sampled expert is
    the top one or the uniform draw passes 0.75, times 1/3 (0.3333) otherwise, while the
    gradient stays the plain softmax weight's (the factor carries none). The choice and the
    thresholds are the host's."""
    features.note_used("family-phimoe")
    host = ops.to_numpy(logits).astype(np.float32)
    t, e = host.shape
    rows = np.arange(t)
    experts = np.zeros((t, 2), np.int64)
    aside = np.zeros((t, e), bool)  # the experts already chosen
    weights = []
    with np.errstate(divide="ignore", invalid="ignore"):  # 0 / 0 (all logits 0) compares False, as torch's
        for j in range(2):
            top = np.where(aside, -np.inf, host).max(axis=-1, keepdims=True)
            far = (top - host) / np.maximum(np.abs(host), top) > np.float32(2 * moe.sparsemixer_eps)
            masked = far | aside
            kept_logits = np.where(masked, -np.inf, host)
            best = kept_logits.argmax(axis=-1)
            experts[:, j] = best if draws is None else (kept_logits - np.log(draws.exponential[j])).argmax(axis=-1)
            probs = ops.softmax(ops.masked_fill(logits, ops.tensor(masked), float("-inf")), dim=-1)
            weight = ops.gather(probs, 1, ops.tensor(experts[:, j:j + 1]))
            if draws is not None:
                features.note_used("sparsemixer-training")
                full = (experts[:, j] == best) | (draws.uniform[j] > np.float32(0.75))
                factor = np.where(full, np.float32(1.0), HEUN_AWAY).astype(np.float32)[:, None]
                weight = weight + autograd.detach(weight * ops.tensor(factor - np.float32(1.0)))
            weights.append(weight)
            aside = aside.copy()
            aside[rows, experts[:, j]] = True
    weights = ops.cat(weights, dim=1)
    kept = keep_within_capacity(experts, ops.to_numpy(weights), moe, capacity(t, moe))
    if not kept.all():
        weights = weights * ops.tensor(kept.astype(np.float32))
    zero = ops.zeros(())
    z = z_loss(logits) * moe.z_loss_coeff if moe.z_loss_coeff > 0 else zero
    tokens = np.bincount(experts[kept], minlength=moe.num_experts).astype(np.int64)
    return Routing(weights, experts, kept, zero, z, tokens)


@dataclass
class DenseRouting:
    """Routing decided on the device, for a compiled step (--compile): no host reads, fixed
    shapes. Without a capacity every assignment is kept, so this is route()'s routing."""
    combine: object  # [T, E] float32: each token's weight for each expert (0 where not chosen)
    aux_loss: object  # scalar tensor
    z_loss: object  # scalar tensor
    tokens_per_expert: object  # [E] float32 tensor


def route_on_device(logits, moe: MoEConfig, expert_bias=None, sequences: int = 1) -> DenseRouting:
    """route() as device operations (the same top-k, weights and losses), its choice as one-hot
    masks rather than host indices. No capacity factor (dropping is a host decision here)."""
    if moe.sparsemixer:  # the matrix refuses a compiled MoE step with it (features: moe-compile-routing)
        raise ValueError("SparseMixer routing has no on-device (compiled) form")
    t, e = logits.shape
    scores = scores_of(logits, moe)
    choice = scores if expert_bias is None else ops.add(scores, expert_bias)
    if moe.num_groups is not None:
        per_group = e // moe.num_groups
        best, _ = ops.topk(ops.reshape(choice, (t, moe.num_groups, per_group)), min(2, per_group), dim=-1)
        _, groups = ops.topk(ops.sum(best, dim=-1), moe.group_topk, dim=-1)  # [T, group_topk]
        allowed = ops.sum(ops.one_hot(groups, moe.num_groups), dim=1)  # [T, G]: 1 for a chosen group
        allowed = ops.reshape(ops.expand(ops.unsqueeze(allowed, -1), (t, moe.num_groups, per_group)), (t, e))
        choice = ops.where(allowed > 0.5, choice, ops.full((t, e), float("-inf")))
    _, idx = ops.topk(choice, moe.topk, dim=-1)
    chosen = ops.one_hot(idx, e)  # [T, k, E]
    weights = ops.gather(scores, 1, idx)
    if moe.norm_topk_prob and moe.topk > 1:
        weights = weights / ops.sum(weights, dim=-1, keepdim=True)
    if moe.scaling_factor != 1.0:
        weights = weights * moe.scaling_factor
    combine = ops.sum(chosen * ops.unsqueeze(weights, -1), dim=1)
    aux = ops.zeros(())
    if moe.balanced:
        groups = 1 if moe.load_balancing_type == "aux_loss" else sequences
        per = t // groups
        fraction = ops.sum(ops.reshape(chosen, (groups, per * moe.topk, e)), dim=1) * (1.0 / per)
        aux = _balance(scores, fraction, moe, groups) * moe.aux_loss_coeff
    z = z_loss(logits) * moe.z_loss_coeff if moe.z_loss_coeff > 0 else ops.zeros(())
    return DenseRouting(combine, aux, z, ops.sum(ops.reshape(chosen, (t * moe.topk, e)), dim=0))


def updated_expert_bias(bias: np.ndarray, tokens_per_expert: np.ndarray, rate: float) -> np.ndarray:
    """Aux-loss-free balancing's step (DeepSeek-V3): raise the bias of experts below the mean
    load by ``rate``, lower those above it."""
    load = np.asarray(tokens_per_expert, np.float64)
    return (np.asarray(bias, np.float32) + rate * np.sign(load.mean() - load)).astype(np.float32)
