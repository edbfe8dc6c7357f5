"""Which samples a step gives this rank, as Megatron's two pre-training samplers choose them
(--dataloader-type). Step i consumes the global batch of samples [i * G, (i + 1) * G) of the
run; it is read as micro-batches of micro-batch size x DP samples, of which data-parallel rank
r takes the r-th micro-batch size. The samplers hold no state beyond the step number, so a
resumed run reads what the uninterrupted one would have. Under pipeline parallelism every
stage reads the same micro-batches: the first needs the token ids, the last the labels, and
each the packed documents' positions and attention boundaries and each micro-batch's width."""

from __future__ import annotations

import numpy as np

from mindspeed_core import features


class PretrainingSampler:
    """--dataloader-type single (Megatron's MegatronPretrainingSampler): the samples in order."""

    def __init__(self, global_batch: int, micro_batch: int, dp_size: int, dp_rank: int):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} is not a multiple of micro-batch {micro_batch} x "
                             f"data-parallel size {dp_size}")
        self.global_batch, self.micro_batch, self.dp_size, self.dp_rank = global_batch, micro_batch, dp_size, dp_rank
        self.micro_batches_per_step = global_batch // (micro_batch * dp_size)

    def micro_batches(self, iteration: int) -> list[list[int]]:
        """The sample indices of each of this rank's micro-batches in step ``iteration``."""
        return [self.rows(iteration * self.micro_batches_per_step + k) for k in range(self.micro_batches_per_step)]

    def rows(self, consumed: int) -> list[int]:
        """This rank's samples of the run's ``consumed``-th micro-batch round (micro-batch size x
        DP samples, every rank's)."""
        first = consumed * self.micro_batch * self.dp_size + self.dp_rank * self.micro_batch
        return list(range(first, first + self.micro_batch))


class CyclicSampler(PretrainingSampler):
    """--dataloader-type cyclic (Megatron's MegatronPretrainingRandomSampler, with its default data
    sharding): the run's ``total`` samples, less the remainder of a whole micro-batch round, are
    cut into one contiguous bucket per data-parallel rank; each rank reads its bucket in an
    order drawn anew for each pass over it (epoch e's permutation is seeded by e alone, as
    Megatron seeds it, so the order does not follow --seed). The permutation is numpy's
    (RandomState(e)), where Megatron's is torch.randperm's: the same rule, another draw, and
    the same on both frameworks."""

    def __init__(self, global_batch: int, micro_batch: int, dp_size: int, dp_rank: int, total: int):
        super().__init__(global_batch, micro_batch, dp_size, dp_rank)
        features.note_used("dataloader-cyclic")
        self.rounds = total // (micro_batch * dp_size)  # micro-batch rounds per epoch
        if self.rounds == 0:
            raise ValueError(f"--dataloader-type cyclic needs at least one micro-batch round of {micro_batch} x "
                             f"{dp_size} samples; the run has {total}")
        self.bucket = self.rounds * micro_batch  # each rank's samples per epoch
        self._order = (None, None)  # (epoch, its permutation)

    def order(self, epoch: int) -> np.ndarray:
        if self._order[0] != epoch:
            self._order = (epoch, np.random.RandomState(epoch).permutation(self.bucket))
        return self._order[1]

    def rows(self, consumed: int) -> list[int]:
        epoch, within = divmod(consumed, self.rounds)
        picked = self.order(epoch)[within * self.micro_batch:(within + 1) * self.micro_batch]
        return [int(self.dp_rank * self.bucket + k) for k in picked]


def for_run(dataloader_type: str | None, global_batch: int, micro_batch: int, dp_size: int, dp_rank: int,
            train_iters: int) -> PretrainingSampler:
    """The sampler --dataloader-type names (single when not given); cyclic's samples are the
    run's, train_iters x global batch, as Megatron sizes its training dataset."""
    if dataloader_type == "cyclic":
        return CyclicSampler(global_batch, micro_batch, dp_size, dp_rank, train_iters * global_batch)
    return PretrainingSampler(global_batch, micro_batch, dp_size, dp_rank)
