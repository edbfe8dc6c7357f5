"""A last checkpoint on preemption (Megatron's --exit-signal-handler): SIGTERM or SIGINT,
which schedulers and `mindspeed launch` send before killing a job, makes every rank finish the
step it is in, save, and leave with the shell's code for that signal (128 + its number).

Each rank notes the signal in its handler, which does nothing else (a step must not stop
halfway); after each step the ranks agree, by a max all-reduce of what they noted, so that all
of them save the same iteration even when only some got the signal. Later signals are ignored:
a rank often gets the same one twice (from `mindspeed launch` and again from msrun or torchrun
passing it on), and impatience is the launcher's (a second signal to `mindspeed launch` kills the
job). A rank that dies outright (SIGKILL, a crash) cannot be saved from: the job then keeps its
last saved checkpoint.
"""

from __future__ import annotations

import signal

from mindspeed_core import dist, ops

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalWatch:
    def __init__(self):
        self.received = None
        self.previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}

    def _on_signal(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum

    def agreed(self, ps) -> int | None:
        """The signal some rank received, on every rank (a collective over the whole job)."""
        mine = float(self.received or 0)
        if ps.world > 1:
            mine = float(ops.to_numpy(dist.all_reduce(ops.tensor([mine]), op="max"))[0])
        return int(mine) or None

    def close(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}
