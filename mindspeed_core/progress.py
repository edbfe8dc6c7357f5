"""A small progress bar for long loops (stderr, redrawn in place on a terminal, a line per
update otherwise)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int | None, desc: str, stream=None, min_interval: float = 0.5, quiet: bool = False):
        """``quiet``: count, draw nothing (the ranks of a job but the one that reports)."""
        self.total, self.desc, self.quiet = total, desc, quiet
        self.stream = stream or sys.stderr
        self.n = 0
        self.start = self._last = time.perf_counter()
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        # redrawn in place on a terminal; into a log file a line every 10 s is plenty
        self.min_interval = min_interval if self.tty else max(min_interval, 10.0)
        self.postfix = ""

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        self.n += n
        if postfix is not None:
            self.postfix = postfix
        now = time.perf_counter()
        if now - self._last >= self.min_interval or (self.total and self.n >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        if self.quiet:
            return
        elapsed = now - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        if self.total:
            frac = min(self.n / self.total, 1.0)
            bar = "#" * int(24 * frac)
            eta = (self.total - self.n) / rate if rate > 0 else 0.0
            text = f"{self.desc} [{bar:<24}] {self.n}/{self.total} {rate:.1f}/s eta {eta:.0f}s {self.postfix}"
        else:
            text = f"{self.desc} {self.n} {rate:.1f}/s {self.postfix}"
        self.stream.write(("\r" + text.ljust(100)) if self.tty else text + "\n")
        self.stream.flush()

    def close(self) -> None:
        self._draw(time.perf_counter())
        if self.tty and not self.quiet:
            self.stream.write("\n")
        self.stream.flush()
