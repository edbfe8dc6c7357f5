"""Checkpoint save and load: sharded (every rank writes its pieces, training/sharded_checkpoint.py)
against --save-whole (the whole state gathered to rank 0, which writes it), at 1, 2 and 4 ranks
(tensor parallelism: each rank holds 1/N of the model and its optimizer state), on the largest
model this machine holds comfortably four times over. Per rank: the save's time and the resident
memory it added at its peak, the load's time (building the trainer with --load, less building
it without) and the memory it added; and the disk's own sequential write rate (a file of the
checkpoint's size written and fsynced), the limit a single writer meets.

    python benchmarks/bench_checkpoint.py --framework pytorch [--hidden 1024 --layers 12]
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


def rank_worker(out: str, argv: list[str]) -> None:
    """One rank: build a trainer and save (timed), then build one with --load (timed) and one
    without; writes rank<r>.json."""
    from mindspeed_core import dist, runtime

    runtime.bind()
    from mindspeed_core.compat.megatron_args import training_parser
    from mindspeed_core.training.trainer import Trainer

    parser = training_parser()
    ckpt = os.path.join(out, "ckpt")
    record = {}
    with open(os.devnull, "w") as null:
        saver = Trainer(parser.parse_args([*argv, "--save", ckpt]), out=null)
        saver.build()
        saver.iteration = 1
        dist.barrier()
        with PeakRSS() as save:
            saver.save()
        record["save"] = [save.seconds, save.added]
        del saver
        dist.barrier()
        with PeakRSS() as plain:
            Trainer(parser.parse_args(argv), out=null).build()
        dist.barrier()
        with PeakRSS() as load:
            Trainer(parser.parse_args([*argv, "--load", ckpt]), out=null).build()
        record["load"] = [load.seconds - plain.seconds, load.added - plain.added]
    with open(os.path.join(out, f"rank{dist.rank()}.json"), "w") as fh:
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
    parser.add_argument("--layers", type=int, default=12)
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
    try:
        for n in map(int, a.ranks.split(",")):
            for fmt, flags in (("whole (rank 0 writes)", ["--save-whole"]), ("sharded", [])):
                folder = os.path.join(root, f"{n}-{len(flags)}")
                os.makedirs(folder)
                ranks.launch(a.framework, n, [os.path.abspath(__file__), "--rank-worker", folder, *model,
                                              "--tensor-model-parallel-size", str(n), *flags], folder)
                per_rank = [json.load(open(os.path.join(folder, f"rank{r}.json"))) for r in range(n)]
                size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(folder, "ckpt"))
                           for f in fs)
                rows.append((n, fmt, per_rank, size))
                shutil.rmtree(os.path.join(folder, "ckpt"))
        rate = disk_write_rate(root, size)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib = 2**20
    print(f"{a.framework}: {a.layers} layers, hidden {a.hidden}: checkpoint {size / mib:.0f} MiB (model and AdamW "
          f"state, fp32); the disk writes {rate / mib:.0f} MiB/s (one file, fsynced): {size / rate:.2f} s for it")
    print("| ranks | format | save s (slowest rank) | save: memory added, MiB (largest rank) | load s (slowest rank) "
          "| load: memory added, MiB (largest rank) |")
    print("|---|---|---|---|---|---|")
    for n, fmt, per_rank, _ in rows:
        print(f"| {n} | {fmt} | {max(r['save'][0] for r in per_rank):.2f} | "
              f"{max(r['save'][1] for r in per_rank) / mib:.0f} | {max(r['load'][0] for r in per_rank):.2f} | "
              f"{max(r['load'][1] for r in per_rank) / mib:.0f} |")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-worker":
        rank_worker(sys.argv[2], sys.argv[3:])
    else:
        main()
