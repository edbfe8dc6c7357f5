"""Communication overlapped with computation: gradient reduction with backward
(--overlap-grad-reduce), and the distributed optimizer's parameter gathering with what follows
the update, up to each layer's forward in the next step (--overlap-param-gather).

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

from mindspeed_core import dist, features, nn, ops
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


class OverlappedParamGather:
    def __init__(self, optimizer, chunks: list):
        """``chunks``: this rank's model chunks, whose modules get the forward pre-hooks."""
        self.optimizer, self.pending, self.hooks = optimizer, {}, []
        where = {id(p): (id(part), b) for part in optimizer.partitions for b, run in enumerate(part.runs)
                 for k in run for p in [part.named[k][1]]}
        modules = {}  # (chunk, module path) -> the buckets of the parameters it owns
        for c, chunk in enumerate(chunks):
            for name, p in nn.named_parameters(chunk):
                if id(p) in where:
                    modules.setdefault((c, name.rsplit(".", 1)[0] if "." in name else ""), set()).add(where[id(p)])
        for (c, path), keys in modules.items():
            self.hooks.append(nn.forward_pre_hook(_module_at(chunks[c], path),
                                                  lambda module, keys=frozenset(keys): self.wait(keys)))

    def started(self, works: list) -> None:
        """The optimizer's step started these gathers: [(partition, bucket, work)]."""
        self.pending = {(id(part), b): (part, b, work) for part, b, work in works}

    def wait(self, keys) -> None:
        if not self.pending:
            return
        for key in keys:
            entry = self.pending.pop(key, None)
            if entry is not None:
                self.optimizer.assign_gathered(*entry)
                features.note_used("param-gather-overlap")

    def wait_all(self) -> None:
        for key in sorted(self.pending, key=lambda k: self.pending[k][1]):
            self.wait([key])


def _module_at(root, path: str):
    """The submodule at a dotted path (ModuleList entries by number)."""
    module = root
    for part in path.split(".") if path else ():
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module
