"""Gradient reduction overlapped with backward (--overlap-grad-reduce).

Without overlap, a step's gradients are reduced over the data-parallel ranks after the whole
backward, bucket after bucket (the optimizer's prepare). With it, the same buckets are summed
by the same collectives, only started earlier: during the backward of the step's last
micro-batch (for each pipeline chunk, its last one), a gradient hook hands over each
parameter's final gradient (accumulated over the micro-batches and scaled, as the schedule
computes it: training/schedules.py), and a bucket whose gradients are all final starts its
asynchronous sum (dist.all_reduce_async) while backward goes on. After backward the step
waits for them. Buckets holding a gradient that is first summed over model-parallel ranks
(sequence-parallel partial sums, copied key/value heads, tied embeddings across stages)
start after those sums, as before. Same buckets, same inputs, same collectives: the same
results, bit for bit.

The first step checks that: each early bucket's input must equal the one built from the
gradients backward returned, or the run stops (a hook that saw something else would be a
silent error). A hook that fires twice for one parameter in a step (a framework that
differentiates twice, e.g. a compiled step's eager check) spoils that step's early starts:
every bucket is then started again from the returned gradients.
"""

from __future__ import annotations

import numpy as np

from mindspeed_core import dist, features, ops
from mindspeed_core.errors import MindSpeedError


class _Done:
    """The sum of a bucket with nothing to sum (a group of one)."""

    def wait(self):
        return None


class OverlappedReduction:
    def __init__(self, buckets: list, summed_first: set):
        """``buckets``: the optimizer's (optimizer.buckets()), whose sums finish() returns in
        order; ``summed_first``: gradient positions summed over model-parallel ranks first."""
        self.buckets = buckets
        self.bucket_of = {i: k for k, b in enumerate(buckets) for i in b.indices}
        self.late = {k for k, b in enumerate(buckets) if summed_first & set(b.indices)}
        self.checked = False
        self.begin()

    def begin(self) -> None:
        """A step starts."""
        self.finals, self.work, self.spoiled = {}, {}, False
        self.missing = [len(b.indices) for b in self.buckets]

    def final(self, i: int, grad) -> None:
        """Gradient position ``i`` is final for this step (called from the gradient hook)."""
        k = self.bucket_of.get(i)
        if k is None or k in self.late or self.spoiled:
            return
        if i in self.finals:
            self.spoiled = True
            return
        self.finals[i] = grad
        self.missing[k] -= 1
        if self.missing[k] == 0:
            self.work[k] = self._start(k, self.finals)
            features.note_used("grad-reduce-overlap")

    def _start(self, k: int, grads):
        bucket = self.buckets[k]
        if bucket.group is None:
            return _Done()
        return dist.all_reduce_async(bucket.flat(grads), group=bucket.group)

    def finish(self, grads: list) -> list:
        """Every bucket's sum (None for a group of one), once ``grads`` (as backward returned
        them, summed over model-parallel ranks) are complete."""
        if self.spoiled:  # drain the early starts, then start everything from grads
            for work in self.work.values():
                work.wait()
            self.work = {}
        elif not self.checked and self.work:
            self._check(grads)
        for k in range(len(self.buckets)):
            if k not in self.work:
                self.work[k] = self._start(k, grads)
        sums = [self.work[k].wait() for k in range(len(self.buckets))]
        self.begin()
        return sums

    def _check(self, grads: list) -> None:
        for k in self.work:
            early, now = (ops.to_numpy(self.buckets[k].flat(g)) for g in (self.finals, grads))
            if not np.array_equal(early, now, equal_nan=True):
                raise MindSpeedError(f"--overlap-grad-reduce: the gradients the backward hooks saw differ from those "
                                     f"backward returned (bucket {k}), so the overlapped reduction would not be exact "
                                     f"here; run without --overlap-grad-reduce")
        self.checked = True
