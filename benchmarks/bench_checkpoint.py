"""Checkpoint save and load: sharded (every rank writes its pieces, training/sharded_checkpoint.py)
against --save-whole (the whole state gathered to rank 0, which writes it), at 1, 2 and 4 ranks
(tensor parallelism: each rank holds 1/N of the model and its optimizer state), on the largest
model this machine holds comfortably four times over. Per rank: the save's time and the resident
memory it added at its peak, the load's time (building the trainer with --load, less building
it without) and the memory it added; and the disk's own sequential write rate (a file of the
checkpoint's size written and fsynced), the limit a single writer meets. With --async-save, the
time the training thread is blocked (the host copy) and the time the writers go on after it,
which the next steps hide.

    python benchmarks/bench_checkpoint.py --framework pytorch [--hidden 1024 --layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


FORMATS = (("whole (rank 0 writes)", ["--save-whole"]), ("sharded", []), ("sharded, --async-save", ["--async-save"]))


class PeakRSS:
    """The highest resident memory of this process while the block runs, sampled every 2 ms,
    above what it held when the block began."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.added = self.peak - self.base

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())


def rank_worker(mode: str, out: str, argv: list[str]) -> None:
    """One rank of a fresh launch, so that what one measurement freed does not flatter the
    next: ``mode`` "save" builds a trainer and saves (timed: the training thread's part, then
    the rest until published), "plain" builds one, "load" builds one with --load; writes
    rank<r>-<mode>.json: seconds and the resident memory the block added at its peak."""
    from mindspeed_core import dist, runtime

    runtime.bind()
    from mindspeed_core.compat.megatron_args import training_parser

    from mindspeed_core.training.trainer import Trainer

    parser = training_parser()
    ckpt = os.path.join(out, "ckpt")
    flags = {"save": ["--save", ckpt], "plain": [], "load": ["--load", ckpt]}[mode]
    record = {}
    with open(os.devnull, "w") as null:
        if mode == "save":
            saver = Trainer(parser.parse_args([*argv, *flags]), out=null)
            saver.build()
            saver.iteration = 1
            dist.barrier()
            with PeakRSS() as save:
                saver.checkpoints.save(saver.iteration)  # --async-save: returns once the host copy is taken
            with PeakRSS() as publish:  # --async-save: the writers' remaining time, which steps would hide
                saver.checkpoints.finish()
            record = {"seconds": save.seconds, "added": save.added, "publish": publish.seconds}
        else:
            dist.barrier()
            with PeakRSS() as build:
                Trainer(parser.parse_args([*argv, *flags]), out=null).build()
            record = {"seconds": build.seconds, "added": build.added}
    with open(os.path.join(out, f"rank{dist.rank()}-{mode}.json"), "w") as fh:
        json.dump(record, fh)
    dist.shutdown()


def disk_write_rate(folder: str, size: int) -> float:
    """Bytes per second of one file of ``size`` bytes written in 64 MiB blocks and fsynced."""
    block = os.urandom(1 << 20) * 64
    path = os.path.join(folder, "disk-probe")
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        written = 0
        while written < size:
            fh.write(block)
            written += len(block)
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - t0
    os.remove(path)
    return written / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", default="pytorch")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ranks", default="1,2,4")
    a = parser.parse_args()
    sys.path.insert(0, HERE)
    import ranks

    model = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "16",
             "--ffn-hidden-size", str(4 * a.hidden), "--seq-length", "128", "--micro-batch-size", "1",
             "--global-batch-size", "4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
             "--train-iters", "1", "--eval-iters", "0", "--no-progress", "--sample-tokens", "0"]
    os.environ["MINDSPEED_AI_FRAMEWORK"] = a.framework
    from mindspeed_core import runtime

    runtime.bind(a.framework)
    from mindspeed_core.measure import _random_data

    model += ["--data-path", _random_data(32000)]
    root = tempfile.mkdtemp(prefix="bench-checkpoint-")
    rows, size = [], 0

    def run(n: int, folder: str, mode: str, flags: list) -> list:
        ranks.launch(a.framework, n, [os.path.abspath(__file__), "--rank-worker", mode, folder, *model,
                                      "--tensor-model-parallel-size", str(n), *flags], folder)
        out = []
        for r in range(n):
            with open(os.path.join(folder, f"rank{r}-{mode}.json")) as fh:
                out.append(json.load(fh))
        return out

    try:
        for n in map(int, a.ranks.split(",")):
            plain = None
            for k, (fmt, flags) in enumerate(FORMATS):
                folder = os.path.join(root, f"{n}-{k}")
                os.makedirs(folder)
                saved = run(n, folder, "save", flags)
                size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(folder, "ckpt"))
                           for f in fs)
                loaded = None
                if "--async-save" not in flags:  # the same files as without it
                    plain = plain or run(n, folder, "plain", [])
                    loaded = run(n, folder, "load", [])
                rows.append((n, fmt, saved, plain, loaded))
                shutil.rmtree(os.path.join(folder, "ckpt"))
        rate = disk_write_rate(root, size)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib = 2**20
    print(f"{a.framework}: {a.layers} layers, hidden {a.hidden}: checkpoint {size / mib:.0f} MiB (model and AdamW "
          f"state, fp32); the disk writes {rate / mib:.0f} MiB/s (one file, fsynced): {size / rate:.2f} s for it")
    print("| ranks | format | save: training blocked, s | save: written after, s | save: memory added, MiB | "
          "load, s | load: memory added, MiB |")
    print("|---|---|---|---|---|---|---|")
    for n, fmt, saved, plain, loaded in rows:
        # the slowest rank's seconds and the largest rank's memory; a load is the build with --load
        # less the build without, each rank against itself
        cells = [f"{max(r['seconds'] for r in saved):.2f}",
                 f"{max(r['publish'] for r in saved):.2f}" if "async" in fmt else "-",
                 f"{max(r['added'] for r in saved) / mib:.0f}"]
        if loaded is None:
            cells += ["as sharded", "as sharded"]
        else:
            cells += [f"{max(x['seconds'] - p['seconds'] for x, p in zip(loaded, plain)):.2f}",
                      f"{max(x['added'] - p['added'] for x, p in zip(loaded, plain)) / mib:.0f}"]
        print(f"| {n} | {fmt} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--rank-worker":
        rank_worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main()
