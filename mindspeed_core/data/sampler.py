"""Which samples a step gives this rank, as Megatron's pre-training sampler does: step i
takes the consecutive global batch [i * G, (i + 1) * G); data-parallel rank r takes the r-th
contiguous share of it, cut into micro-batches. Under pipeline parallelism every stage reads
the same micro-batches: the first needs the token ids, the last the labels, and each the
packed documents' positions and attention boundaries and each micro-batch's width."""

from __future__ import annotations


class PretrainingSampler:
    def __init__(self, global_batch: int, micro_batch: int, dp_size: int, dp_rank: int):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} is not a multiple of micro-batch {micro_batch} x "
                             f"data-parallel size {dp_size}")
        self.global_batch, self.micro_batch, self.dp_rank = global_batch, micro_batch, dp_rank
        self.micro_batches_per_step = global_batch // (micro_batch * dp_size)

    def micro_batch_starts(self, iteration: int) -> list[int]:
        """The first sample index of each of this rank's micro-batches in step ``iteration``."""
        share = self.micro_batches_per_step * self.micro_batch
        first = iteration * self.global_batch + self.dp_rank * share
        return [first + k * self.micro_batch for k in range(self.micro_batches_per_step)]
