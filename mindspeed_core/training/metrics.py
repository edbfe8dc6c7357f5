"""The training log: a line per --log-interval and the JSONL metrics file.

Each report covers the steps since the previous one: tokens/s and TFLOP/s over its wall
time (evaluation and checkpointing excluded), MFU against the devices' measured matmul
rate, and this rank's collective traffic per step (the payload handed to the collectives,
and what reached the framework's primitives, more where a collective is emulated).
"""

from __future__ import annotations

import json
import os
import time

from mindspeed_core import dist


class MetricsLog:
    def __init__(self, path: str | None, say, flops_per_token: float, peak_flops: float, devices: int):
        """``path``: the JSONL file (None: lines only; give it on one rank). ``peak_flops``:
        one device's measured rate; MFU is the job's rate over ``devices`` such peaks."""
        self.path, self.say = path, say
        self.flops_per_token, self.peak_flops, self.devices = flops_per_token, peak_flops, devices
        self._file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a")
        self._start, self._tokens, self._steps = time.perf_counter(), 0, 0
        dist.reset_comm_stats()

    def step(self, tokens: int) -> None:
        self._tokens += tokens
        self._steps += 1

    def report(self, iteration: int, total: int, loss: float, lr: float, norm: float, moe: dict | None = None,
               stage: dict | None = None) -> dict:
        """Print the line, write the record, and start the next interval. ``moe``: the last
        step's routing statistics (Trainer._moe_step_stats), when the model has MoE layers;
        ``stage``: the last step's preference or reward figures ({name: value}), when the
        stage has them (Trainer._stage_stats)."""
        tps = self._tokens / (time.perf_counter() - self._start)
        comm = dist.comm_stats()
        record = {"iteration": iteration, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tps,
                  "tflops": tps * self.flops_per_token / 1e12,
                  "mfu": tps * self.flops_per_token / (self.peak_flops * self.devices),
                  "comm_bytes_per_step": sum(v["bytes"] for v in comm.values()) / self._steps,
                  "comm_wire_bytes_per_step": sum(v["wire_bytes"] for v in comm.values()) / self._steps,
                  "comm": comm}
        line = (f" iteration {iteration:6d}/{total} | {'loss' if stage else 'lm loss'} {loss:.4f} | lr {lr:.3e} | "
                f"grad norm {norm:.3f} | "
                f"tokens/s {tps:,.0f} | TFLOP/s {record['tflops']:.3f} | MFU {100 * record['mfu']:.1f}%")
        if moe is not None:
            record["moe"] = moe
            line += (f" | aux loss {moe['aux_loss']:.4g} | z loss {moe['z_loss']:.4g} | expert load max/mean "
                     f"{max(moe['load_balance']):.2f}" + (f" | dropped {moe['dropped']}" if moe["dropped"] else ""))
        if stage:
            record.update(stage)
            line += "".join(f" | {name[6:].replace('_', ' ')} {value:.4f}" for name, value in stage.items())
        self.say(line)
        self.write(record)
        self._start, self._tokens, self._steps = time.perf_counter(), 0, 0
        dist.reset_comm_stats()
        return record

    def restart_clock(self) -> None:
        """After work that is not training (evaluation, a checkpoint): keep it out of tokens/s."""
        self._start = time.perf_counter()

    def write(self, record: dict) -> None:
        """One JSONL record (evaluation results, the text sample, ...)."""
        if self.path:
            if self._file is None:
                self._file = open(self.path, "a")
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
