"""A run's data: where it is (--data-path, or the embedded corpus built on first use), its
train / valid / test splits, and the micro-batches as this rank's loss reads them: token ids
and labels (or preference pairs, or step verdicts) checked against the tokenizer, with the
packed documents' positions, cut for context parallelism; and DPO's reference log-likelihoods
of the pairs, computed once before training."""

from __future__ import annotations

import time

import numpy as np

from mindspeed_core import dist, features, ops
from mindspeed_core.data import corpus, finetune_dataset, gpt_dataset
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models.gpt import Tokens
from mindspeed_core.parallel import context
from mindspeed_core.training import alignment


def data_path(config) -> list:
    """--data-path, or for the embedded default the standard library's source (its instructions
    for the fine-tuning twin), built once and then cached."""
    if not config.data.embedded:
        return list(config.data.paths)
    return [corpus.build_stdlib_instructions(config.data.seq_length) if config.stage.instruction
            else corpus.build_stdlib_corpus()]


def splits(config, paths: list) -> dict:
    """{"train", "valid", "test"} of the blended data (None for an empty split)."""
    d = config.data
    if config.stage.instruction:
        data = finetune_dataset.build_splits(paths, d.split, d.seq_length, d.seed, pad=config.tokenizer.eod,
                                             pairs=config.stage.pairwise, shuffle=d.shuffle,
                                             prompts=config.stage.name == "grpo")
    else:
        data = gpt_dataset.build_splits(paths, d.split, d.seq_length, d.seed, shuffle=d.shuffle)
    if config.loop.eval_iters and config.loop.eval_interval and data["valid"] is None:
        raise MindSpeedError("the validation split is empty: give --split a larger second part or use --eval-iters 0")
    return data


class Batches:
    """The micro-batches of the ``data`` splits for ``stage`` (configuration.Stage), cut as
    ``settings`` (configuration.Data) say: fine-tuning micro-batches --seq-length wide, or with
    dynamic padding as wide as their longest sample, rounded up to ``settings.pad_multiple``."""

    def __init__(self, data: dict, tokenizer, stage, settings, micro_batch_size: int, ps, objective=None,
                 reference=None):
        self.data, self.tokenizer, self.stage_name, self.ps = data, tokenizer, stage.name, ps
        self.pad_multiple = settings.pad_multiple
        self.instruction, self.pairwise = stage.instruction, stage.pairwise
        self.objective, self.reference = objective, reference
        self.micro_batch_size, self.reward_tokens = micro_batch_size, stage.reward_tokens
        self.reset_position_ids, self.reset_attention_mask = settings.reset_position_ids, settings.reset_attention_mask

    def check_ids(self, split: str, ids: np.ndarray) -> None:
        low, high = int(ids.min()), int(ids.max())  # cheap: one micro-batch
        if low < 0 or high >= self.tokenizer.vocab_size:
            bad = low if low < 0 else high
            raise MindSpeedError(f"the {split} data holds token id {bad}, outside the {self.tokenizer.name} tokenizer's "
                                 f"{self.tokenizer.vocab_size} ids: it seems to have been tokenized with a vocabulary of "
                                 f"at least {high + 1} tokens; train with the tokenizer it was preprocessed with")

    def _instruction(self, split: str, samples: list):
        features.note_used("sft")
        rows = finetune_dataset.trimmed([self.data[split][k] for k in samples], self.pad_multiple)
        ids, labels, loss_mask, positions, documents = finetune_dataset.batch(None, 0, len(rows), rows)
        self.check_ids(split, ids)
        self.check_ids(split, labels)
        return ids, labels, Tokens(positions, documents, loss_mask)

    def _pairs(self, split: str, samples: list):
        """A micro-batch of preference pairs ``samples``: 2 x len(samples) rows, the chosen ones first;
        for DPO where the loss is computed (the last pipeline stage), with the pairs'
        reference log-likelihoods."""
        blend = self.data[split]
        where = [blend.locate(k) for k in samples]  # (part, sample of the part)
        pairs = [blend.parts[part][1] for part, _ in where]
        reference = None
        if self.stage_name == "dpo" and self.ps.local_rank("pp") == self.ps.pp - 1:
            numbers = [p.pair_number(i) for p, (_, i) in zip(pairs, where)]
            rows = np.stack([self.reference.lookup(split, part, k) for (part, _), k in zip(where, numbers)])
            reference = np.concatenate([rows[:, 0], rows[:, 1]])  # the chosen rows first, as the batch
        return self.pairs_on_device(split, [p[i] for p, (_, i) in zip(pairs, where)], reference)

    def pairs_on_device(self, split: str, pairs: list, reference):
        sides = finetune_dataset.trimmed([p[0] for p in pairs] + [p[1] for p in pairs], self.pad_multiple)
        ids, labels, mask = finetune_dataset.pair_batch(list(zip(sides[:len(pairs)], sides[len(pairs):])))
        self.check_ids(split, ids)
        self.check_ids(split, labels)
        target = alignment.Pairs(ops.tensor(np.ascontiguousarray(labels)), mask, reference)
        return ops.tensor(np.ascontiguousarray(ids)), target, None

    def _process_reward(self, split: str, samples: list):
        """Step-labelled samples: each label sits where its step ends (no shift), as the index
        of its verdict among --reward-tokens."""
        rows = finetune_dataset.trimmed([self.data[split][k] for k in samples], self.pad_multiple)
        ids, labels, mask, positions, documents = finetune_dataset.batch(None, 0, len(rows), rows, shift=False)
        self.check_ids(split, ids)
        candidates = self.objective.candidates
        verdicts = np.zeros_like(labels)
        for k, token in enumerate(candidates):
            verdicts[labels == token] = k
        stray = mask & ~np.isin(labels, candidates)
        if stray.any():
            raise MindSpeedError(f"the {split} data labels a step with token {int(labels[stray][0])}, which is not one of "
                                 f"--reward-tokens {' '.join(self.reward_tokens)} (token ids "
                                 f"{' '.join(map(str, candidates))})")
        return self._on_device(ids, verdicts, Tokens(positions, documents, mask))

    def micro_batch(self, split: str, samples):
        """The micro-batch of the split's samples ``samples`` (indices, as the sampler gives them)."""
        samples = list(samples)
        if self.pairwise:
            return self._pairs(split, samples)
        if self.stage_name == "prm":
            return self._process_reward(split, samples)
        if self.instruction:
            ids, labels, packed = self._instruction(split, samples)
            return self._on_device(ids, labels, packed)
        tokens = gpt_dataset.batch(self.data[split], samples)
        loss_mask = None
        if self.data[split].packed:
            tokens, loss_mask = gpt_dataset.unpad(tokens, self.tokenizer.eod)
        self.check_ids(split, tokens)
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        positions, documents = gpt_dataset.document_layout(ids, self.tokenizer.eod, self.reset_position_ids,
                                                           self.reset_attention_mask)
        packed = (None if positions is None and documents is None and loss_mask is None
                  else Tokens(positions, documents, loss_mask))
        return self._on_device(ids, labels, packed)

    def _on_device(self, ids: np.ndarray, labels: np.ndarray, packed: Tokens | None):
        if self.ps.cp > 1:  # this rank's chunks of each sequence; positions and documents stay whole
            columns = context.local_columns(ids.shape[1], self.ps.cp, self.ps.local_rank("cp"))
            ids, labels = ids[:, columns], labels[:, columns]
        return ops.tensor(np.ascontiguousarray(ids)), ops.tensor(np.ascontiguousarray(labels)), packed

    def pair_counts(self) -> dict:
        """{(split, part): pairs} of the training and validation data."""
        return {(split, part): pairs.count for split in ("train", "valid") if self.data[split] is not None
                for part, (_, pairs) in enumerate(self.data[split].parts)}

    def compute_reference(self, model, say) -> None:
        """DPO's reference: the starting model's log-likelihoods of every training and
        validation pair, computed by the whole model before it is cut for the layout, on the
        ranks holding the last pipeline stage (where the loss is), each data-parallel rank a
        share, then summed over them (zeros elsewhere: exact)."""
        if self.ps.local_rank("pp") != self.ps.pp - 1:
            return
        started, dp, me = time.perf_counter(), self.ps.dp, self.ps.local_rank("dp")
        chunk = max(self.micro_batch_size, 8)  # pairs per forward
        for (split, part), count in self.pair_counts().items():
            pairs = self.data[split].parts[part][1]
            mine = list(range(me, count, dp))
            groups = [mine[k:k + chunk] for k in range(0, len(mine), chunk)]
            batches = (self.pairs_on_device(split, [pairs.pair(k) for k in group], None)[:2] for group in groups)
            table = np.zeros((count, 2), np.float32)
            for group, ll in zip(groups, alignment.reference_log_likelihoods(model, batches)):
                table[group, 0], table[group, 1] = ll[:len(group)], ll[len(group):]
            if dp > 1:
                table = ops.to_numpy(dist.all_reduce(ops.tensor(table), group=self.ps.group("dp")))
            self.reference.tables[split, part] = table
        say(f"DPO reference: the starting model's log-likelihoods of "
                 f"{sum(self.pair_counts().values())} pairs ({time.perf_counter() - started:.1f} s)")
