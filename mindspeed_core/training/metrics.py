"""The training log: a line per --log-interval, the JSONL metrics file, and the boards
(TensorBoard event files, Weights & Biases) that show the same figures as curves.

Each report covers the steps since the previous one: tokens/s and TFLOP/s over its wall
time (evaluation and checkpointing excluded), MFU against the devices' measured matmul
rate, the mean time per step of each timed phase, and this rank's collective traffic per step
(the payload handed to the collectives, and what reached the framework's primitives, more
where a collective is emulated).

A board gets Megatron's scalars under Megatron's names: each step's loss, learning rate,
gradient norm, loss scale and batch size every --tensorboard-log-interval steps; the report's
throughput (and its timers and this rank's memory, when asked) at each report; the validation
loss (and perplexity, when asked) at each evaluation.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time

from mindspeed_core import device, dist


def probe_matmul(dtype: str) -> float:
    """The device's matmul rate in the training's dtype (a bf16 run measured against an fp32
    peak could beat it), the best of three 0.1 s rounds (a round that shares the cores with
    another process reads low)."""
    return max(device.matmul_rate(n=512, dtype=dtype, min_seconds=0.1) for _ in range(3))


@functools.cache
def matmul_peak(dtype: str) -> float:
    """MFU's denominator, probed once per process and dtype: runs that follow one another in a
    process (the tests' launches) share it instead of spending 0.3 s each (MetricsLog probes
    again when the steps beat it)."""
    return probe_matmul(dtype)


class MetricsLog:
    def __init__(self, path: str | None, say, flops_per_token: float, peak_flops: float, devices: int,
                 board=None, loss_name: str = "lm loss", reprobe=None):
        """``path``: the JSONL file (None: lines only; give it on one rank). ``peak_flops``:
        one device's measured rate; MFU is the job's rate over ``devices`` such peaks.
        ``board``: a training.boards.Board (give it on one rank). ``reprobe``: measures the
        rate again, when the steps beat the peak (see _peak)."""
        self.path, self.say = path, say
        self.flops_per_token, self.peak_flops, self.devices = flops_per_token, peak_flops, devices
        self.reprobe = reprobe
        self.board, self.loss_name = board, loss_name
        self._file = None  # opened with the first record: a run refused before its first step writes nothing
        self._start, self._tokens, self._steps, self._timers = time.perf_counter(), 0, 0, {}
        dist.reset_comm_stats()

    def step(self, tokens: int, iteration: int, loss: float, lr: float, norm: float, loss_scale: float,
             batch_size: int, timers: dict) -> None:
        """After each step: count it, add its phases' seconds (``timers``: {name: seconds}),
        and every board interval send its figures to the boards."""
        self._tokens += tokens
        self._steps += 1
        for name, seconds in timers.items():  # a skipped (fp16 overflow) step has no optimizer phase
            total, count = self._timers.get(name, (0.0, 0))
            self._timers[name] = (total + seconds, count + 1)
        if self.board and iteration % self.board.interval == 0:
            self.board.scalars(iteration, {self.loss_name: loss, "learning-rate": lr, "grad-norm": norm,
                                           "loss-scale": loss_scale, "batch-size": batch_size})

    def report(self, iteration: int, total: int, loss: float, lr: float, norm: float, moe: dict | None = None,
               stage: dict | None = None, mtp: list | None = None, indexer: float | None = None,
               qk: dict | None = None) -> dict:
        """Print the line, write the record, and start the next interval. ``moe``: the last
        step's routing statistics (Trainer._moe_step_stats), when the model has MoE layers;
        ``stage``: the last step's preference or reward figures ({name: value}), when the
        stage has them (Trainer._stage_stats); ``mtp``: the last step's loss of each
        multi-token prediction depth (Trainer._mtp_step_losses); ``indexer``: the last step's
        sparse-attention indexer loss (Trainer._indexer_step_loss); ``qk``: the last step's largest
        attention logit and the query heads --qk-clip shrank (training/qk_clip.py)."""
        tps = self._tokens / (time.perf_counter() - self._start)
        comm = dist.comm_stats()
        achieved = tps * self.flops_per_token / self.devices  # a device's rate
        peak = self._peak(achieved)
        record = {"iteration": iteration, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tps,
                  "tflops": tps * self.flops_per_token / 1e12,
                  "mfu": achieved / peak, "peak_flops": peak,
                  "comm_bytes_per_step": sum(v["bytes"] for v in comm.values()) / self._steps,
                  "comm_wire_bytes_per_step": sum(v["wire_bytes"] for v in comm.values()) / self._steps,
                  "comm": comm, "timers": {name: total / count for name, (total, count) in self._timers.items()},
                  "memory": device.memory_stats()}
        line = (f" iteration {iteration:6d}/{total} | {'loss' if stage else 'lm loss'} {loss:.4f} | lr {lr:.3e} | "
                f"grad norm {norm:.3f} | "
                f"tokens/s {tps:,.0f} | TFLOP/s {record['tflops']:.3f} | MFU {100 * record['mfu']:.1f}%")
        if "iteration" in record["timers"]:
            line += f" | {1000 * record['timers']['iteration']:.0f} ms/step"
        if moe is not None:
            record["moe"] = moe
            line += (f" | aux loss {moe['aux_loss']:.4g} | z loss {moe['z_loss']:.4g} | expert load max/mean "
                     f"{max(moe['load_balance']):.2f}" + (f" | dropped {moe['dropped']}" if moe["dropped"] else ""))
        if mtp is not None:  # megatron-core's names
            record["mtp_losses"] = mtp
            line += "".join(f" | mtp_{k} loss {value:.4f}" for k, value in enumerate(mtp, 1))
        if indexer is not None:
            record["indexer_loss"] = indexer
            line += f" | indexer loss {indexer:.4g}"
        if qk is not None:
            record.update(qk)
            line += f" | max attention logit {qk['max_attention_logit']:.4g}" + (
                f" | qk-clipped heads {qk['qk_clipped_heads']}" if qk["qk_clipped_heads"] else "")
        if stage:
            record.update(stage)
            line += "".join(f" | {name[6:].replace('_', ' ')} {value:.4f}" for name, value in stage.items())
        self.say(line)
        self.write(record)
        if self.board:
            self.board.scalars(iteration, self._board_figures(record))
        self._start, self._tokens, self._steps, self._timers = time.perf_counter(), 0, 0, {}
        dist.reset_comm_stats()
        return record

    def _peak(self, achieved: float) -> float:
        """MFU's denominator, never below what a device achieved. The probe at start can run on a
        busy machine and read low (a fresh clone's first run printed MFU 155%): when the steps beat
        it, probe again and keep the better; if they still beat it, the steps' own rate is the
        best measured, and the peak from then on. Each change is said, with its figures."""
        if achieved <= self.peak_flops:
            return self.peak_flops
        before = self.peak_flops
        if self.reprobe is not None:
            self.peak_flops = max(self.peak_flops, self.reprobe())
        source = "the matmul probe, run again"
        if achieved > self.peak_flops:
            self.peak_flops, source = achieved, "the steps' own rate (above the probe's)"
        self.say(f"MFU peak {before / 1e9:,.1f} -> {self.peak_flops / 1e9:,.1f} GFLOP/s a device: the steps ran "
                 f"faster than the matmul probe at start measured; the peak is now {source}")
        return self.peak_flops

    def _board_figures(self, record: dict) -> dict:
        figures = {"tokens-per-second": record["tokens_per_s"], "throughput": record["tflops"] / self.devices,
                   "tflops": record["tflops"], "mfu": record["mfu"],
                   "comm-bytes-per-step": record["comm_bytes_per_step"]}
        figures.update({f"mtp_{k} loss": v for k, v in enumerate(record.get("mtp_losses", ()), 1)})
        if "indexer_loss" in record:
            figures["indexer loss"] = record["indexer_loss"]
        moe = record.get("moe")
        if moe is not None:
            figures.update({"moe/aux-loss": moe["aux_loss"], "moe/z-loss": moe["z_loss"], "moe/dropped": moe["dropped"]})
            figures.update({f"moe/load-balance-layer-{k}": v for k, v in enumerate(moe["load_balance"])})
        figures.update({name.replace("_", " "): value for name, value in record.items() if name.startswith("train_")})
        if self.board.timers:
            figures.update({f"{name}-time": value for name, value in record["timers"].items()})
        if self.board.memory:
            figures.update({f"mem-{name.replace('_', '-')}": value for name, value in record["memory"].items()})
        return figures

    def validation(self, iteration: int, loss: float, stats: dict | None) -> None:
        """The evaluation's line, record and board figures (Megatron's names). ``stats``: a stage
        objective's figures ("valid_..."), or None for the language model (its perplexity)."""
        line = f" validation at iteration {iteration} | {self.loss_name} {loss:.4f}"
        if stats is None:
            line += f" | ppl {math.exp(min(loss, 50)):.2f}"
        else:
            line += "".join(f" | {k[6:].replace('_', ' ')} {v:.4f}" for k, v in stats.items())
        self.say(line)
        self.write({"iteration": iteration, "eval_loss": loss, **(stats or {})})
        if self.board:
            figures = {f"{self.loss_name} validation": loss}
            if self.board.validation_ppl:
                figures[f"{self.loss_name} validation ppl"] = math.exp(min(loss, 50))
            figures.update({name.replace("_", " "): value for name, value in (stats or {}).items()})
            self.board.scalars(iteration, figures)

    @contextlib.contextmanager
    def paused(self):
        """Work that is not training (evaluation, a checkpoint, writing a profile): its time
        stays out of the interval's tokens/s."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self._start += time.perf_counter() - began

    def write(self, record: dict) -> None:
        """One JSONL record (evaluation results, the text sample, ...)."""
        if self.path:
            if self._file is None:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self._file = open(self.path, "a")
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.board:
            self.board.close()
            self.board = None
