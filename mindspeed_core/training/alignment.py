"""What the preference and reward stages minimise (``--stage dpo | simpo | orm | prm``).

A pairwise stage (dpo, simpo, orm) takes a micro-batch of b preference pairs as one batch of
2b rows, the chosen conversations first (data/finetune_dataset.pair_batch): a pair never
splits between micro-batches, data-parallel ranks or pipeline stages (the pipeline passes the
2b rows between stages as one activation), and the last stage computes whole pairs' losses.
A reply's log-likelihood is the sum of log p over its trained tokens (the assistant's, as in
SFT); the micro-batch's loss is the mean over its pairs, so the step's is the mean over the
global batch's pairs whatever the layout.

- DPO (Rafailov et al. 2023), with the policy's log-likelihoods pc, pr of the chosen and the
  rejected reply and the reference model's rc, rr: z = (pc - pr) - (rc - rr), and
  sigmoid: -(1 - e) log s(b z) - e log s(-b z) (e: --dpo-label-smoothing), hinge:
  max(0, 1 - b z), ipo: (z - 1 / (2 b))^2 with the log-likelihoods averaged over each reply's
  tokens (as IPO's authors, TRL and LLaMA-Factory do).
- SimPO (Meng et al. 2024), no reference: z = b (avg pc - avg pr) - g, loss
  -(1 - e) log s(z) - e log s(-z).
- ORM (pairwise Bradley-Terry): a scalar head's value at each reply's last token is its
  reward; loss -log s(r_chosen - r_rejected).
- PRM: at each position the labels mark (where a step ends), cross entropy over the logits
  of the --reward-tokens only (a step's verdict, e.g. "+" or "-"), averaged over the steps.

The reference model is the model as the run starts (the SFT model of --load/--load-hf, or
LoRA's base). Its log-likelihoods of every pair of the training and validation data are
computed once, before the first step (``reference_log_likelihoods``, each data-parallel rank
a share), and kept on the host and in checkpoints (``ReferenceTable``): no second model is
held, and a resumed run, however many iterations it goes on for, compares against the same
reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mindspeed_core import autograd, features, nn, ops
from mindspeed_core.data.handlers import one_token
from mindspeed_core.errors import MindSpeedError

PAIRWISE = ("dpo", "simpo", "orm")
STATS = ("chosen_reward", "rejected_reward", "margin", "accuracy")  # pairwise stages' per-step figures


@dataclass
class Pairs:
    """The labels of a micro-batch of preference pairs: ``labels`` [2b, S] (the model's
    input layout), ``mask`` [2b, S] host numpy (1 where a label counts), ``reference``
    [2b] host numpy, the reference model's log-likelihoods (DPO only, else None)."""

    labels: object
    mask: np.ndarray
    reference: np.ndarray | None = None


def log_sigmoid(x):
    """log s(x) without overflow: min(x, 0) - log(1 + exp(-|x|))."""
    return ops.minimum(x, ops.zeros_like(x)) - ops.log(ops.exp(-ops.abs(x)) + 1.0)


def sequence_log_likelihoods(model, logits, labels, mask: np.ndarray):
    """Sum of log p(label) over each row's kept labels, [rows] float32, differentiable;
    ``logits`` as the model returns them (a vocabulary shard under TP)."""
    rows, length = mask.shape
    flat = ops.reshape(ops.cast(logits, "float32"), (-1, logits.shape[-1]))
    per_token = model.seams.token_losses(flat, ops.reshape(labels, (-1,)))  # -log p
    kept = ops.tensor(np.ascontiguousarray(mask, np.float32))
    return -ops.sum(ops.reshape(per_token, (rows, length)) * kept, dim=1)


def last_token_values(values, mask: np.ndarray):
    """values [rows, S] -> [rows]: each row's value where the model has read its reply's last
    token (one past the last kept label, whose target that token is; the last position when
    the sample fills the sequence)."""
    rows, length = mask.shape
    if not mask.any(axis=1).all():
        raise MindSpeedError("a reward-model sample has no reply tokens: preprocess with a shorter prompt or a longer "
                             "--seq-length")
    last_label = length - 1 - np.argmax(mask[:, ::-1], axis=1)
    pick = np.zeros((rows, length), np.float32)
    pick[np.arange(rows), np.minimum(last_label + 1, length - 1)] = 1.0
    return ops.sum(values * ops.tensor(pick), dim=1)


@dataclass(frozen=True)
class Settings:
    """A preference stage's loss: DPO's (--dpo-loss-type, --dpo-beta, --dpo-label-smoothing) or
    SimPO's (--simpo-beta, --simpo-label-smoothing, --simpo-gamma)."""
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.0  # SimPO's target reward margin


class Objective:
    """The loss of one micro-batch from the model's output, for one stage. ``stats``
    collects each micro-batch's host figures (``STATS``, or PRM's step accuracy) for the log.
    ``settings``: the preference stages' (None for the reward models')."""

    def __init__(self, stage: str, settings: Settings | None = None, reward_token_ids: list[int] | None = None):
        self.stage = stage
        settings = settings or Settings()
        self.loss_type, self.beta = settings.loss_type, settings.beta
        self.smoothing, self.gamma = settings.label_smoothing, settings.gamma
        self.candidates = reward_token_ids
        self.stats: list[np.ndarray] = []

    def __call__(self, model, out, target, tokens=None):
        features.note_used(f"stage-{self.stage}")
        if self.stage == "prm":
            return self._process_reward(model, out, target, tokens)
        if self.stage == "orm":
            rewards = last_token_values(ops.reshape(ops.cast(out, "float32"), out.shape[:2]), target.mask)
            chosen, rejected = self._halves(rewards)
            margin = chosen - rejected
            return self._finish(-log_sigmoid(margin), chosen, rejected)
        ll = sequence_log_likelihoods(model, out, target.labels, target.mask)
        counts = ops.tensor(np.maximum(target.mask.sum(axis=1), 1).astype(np.float32))
        if self.stage == "simpo":
            chosen, rejected = self._halves(ll / counts)
            chosen, rejected = chosen * self.beta, rejected * self.beta
            return self._finish(self._smoothed(chosen - rejected - self.gamma), chosen, rejected)
        if target.reference is None:
            raise RuntimeError("a DPO micro-batch without reference log-likelihoods")
        reference = target.reference
        if self.loss_type == "ipo":  # averaged over the reply's tokens
            ll = ll / counts
            reference = reference / np.maximum(target.mask.sum(axis=1), 1)
        chosen, rejected = self._halves(ll - ops.tensor(np.asarray(reference, np.float32)))
        z = chosen - rejected
        if self.loss_type == "sigmoid":
            losses = self._smoothed(z * self.beta)
        elif self.loss_type == "hinge":
            losses = ops.relu(-(z * self.beta) + 1.0)
        else:
            losses = (z - 1.0 / (2.0 * self.beta)) * (z - 1.0 / (2.0 * self.beta))
        return self._finish(losses, chosen * self.beta, rejected * self.beta)

    @staticmethod
    def _halves(x):
        chosen, rejected = ops.split(x, [x.shape[0] // 2, x.shape[0] // 2], dim=0)
        return chosen, rejected

    def _smoothed(self, z):
        loss = -log_sigmoid(z)
        if self.smoothing:
            loss = loss * (1.0 - self.smoothing) - log_sigmoid(-z) * self.smoothing
        return loss

    def _finish(self, losses, chosen, rejected):
        c, r = (ops.to_numpy(autograd.detach(x)).astype(np.float64) for x in (chosen, rejected))
        self.stats.append(np.array([c.mean(), r.mean(), (c - r).mean(), (c > r).mean()]))
        return ops.mean(losses)

    def _process_reward(self, model, logits, labels, tokens):
        """Cross entropy over the reward tokens' logits where tokens.loss_mask marks a step's
        end; ``labels`` hold the index of the step's verdict among the reward tokens."""
        flat = ops.reshape(ops.cast(logits, "float32"), (-1, logits.shape[-1]))
        picked = model.seams.vocab_columns(flat, self.candidates)  # [N, k]
        mask = np.asarray(tokens.loss_mask, np.float32).reshape(-1)
        per_step = ops.cross_entropy(picked, ops.reshape(labels, (-1,)), reduction="none")
        loss = ops.sum(per_step * ops.tensor(mask / max(float(mask.sum()), 1.0)))
        right = ops.to_numpy(ops.argmax(autograd.detach(picked), dim=-1)) == ops.to_numpy(ops.reshape(labels, (-1,)))
        self.stats.append(np.array([float((right * mask).sum() / max(mask.sum(), 1.0))]))
        return loss

    def take_stats(self) -> np.ndarray | None:
        """The mean of the figures since the last call (None if no micro-batch ended here)."""
        if not self.stats:
            return None
        out, self.stats = np.mean(self.stats, axis=0), []
        return out


def reference_log_likelihoods(model, batches) -> list[np.ndarray]:
    """The whole, single-device ``model``'s log-likelihood of each row of each (ids, Pairs)
    batch, without gradients or dropout: the reference of DPO, taken before the model is
    cut for the parallel layout and trained."""
    out = []
    nn.set_training(model, False)
    try:
        with autograd.no_grad():
            for ids, target in batches:
                ll = sequence_log_likelihoods(model, model(ids), target.labels, target.mask)
                out.append(ops.to_numpy(ll).astype(np.float32))
    finally:
        nn.set_training(model, True)
    return out


class ReferenceTable:
    """DPO's reference: the (chosen, rejected) log-likelihoods of every pair, by split, data
    part (of a --data-path blend) and pair number."""

    def __init__(self):
        self.tables: dict[tuple[str, int], np.ndarray] = {}  # (split, part) -> [pairs, 2] float32

    def __bool__(self) -> bool:
        return bool(self.tables)

    def lookup(self, split: str, part: int, pair: int) -> np.ndarray:
        """[2]: the chosen and the rejected log-likelihood of pair number ``pair``."""
        return self.tables[split, part][pair]

    def state(self) -> dict:
        # float32 survives JSON exactly
        return {f"{split}/{part}": [[float(c), float(r)] for c, r in table] for (split, part), table in
                self.tables.items()}

    def load(self, state: dict, counts: dict) -> None:
        """A saved table, checked against this run's data: ``counts`` {(split, part): pairs}."""
        tables = {}
        for key, rows in state.items():
            split, part = key.split("/")
            tables[split, int(part)] = np.asarray(rows, np.float32).reshape(-1, 2)
        have = {k: len(t) for k, t in tables.items()}
        if have != counts:
            raise MindSpeedError(f"the checkpoint's DPO reference covers other data ({sorted(have.items())} pairs by "
                                 f"split and part) than --data-path and --split give ({sorted(counts.items())}): "
                                 "resume with the same data, or start DPO from these weights with --finetune")
        self.tables = tables


def reward_token_ids(tokenizer, texts: list[str]) -> list[int]:
    """--reward-tokens as token ids, one token each (given: configuration.check_configuration)."""
    ids = [one_token(tokenizer, text, "--reward-tokens") for text in texts]
    if len(set(ids)) != len(ids):
        raise MindSpeedError("--reward-tokens are the same token twice")
    return ids
