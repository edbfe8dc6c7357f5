"""The boards: TensorBoard event files (--tensorboard-dir) and Weights & Biases in offline mode
(--wandb-project), fed the same scalars by training.metrics.MetricsLog, on rank 0."""

from __future__ import annotations

import os
from dataclasses import dataclass

from mindspeed_core import features
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.training.tensorboard import EventWriter


@dataclass(frozen=True)
class Settings:
    """Which boards a run writes and what goes on them (Megatron's and MindSpeed-LLM's flags)."""
    tensorboard_dir: str | None
    interval: int  # --tensorboard-log-interval
    queue_size: int
    timers: bool  # --log-timers-to-tensorboard
    memory: bool
    validation_ppl: bool
    wandb_project: str | None
    wandb_name: str | None
    wandb_dir: str | None  # the offline run's folder (resolved when --wandb-project is given)


def settings(args) -> Settings:
    """From the parsed flags (the flag layer's: training/configuration.py)."""
    return Settings(args.tensorboard_dir, args.tensorboard_log_interval, args.tensorboard_queue_size,
                    bool(args.log_timers_to_tensorboard), bool(args.log_memory_to_tensorboard),
                    bool(args.log_validation_ppl_to_tensorboard), args.wandb_project, args.wandb_exp_name,
                    wandb_folder(args) if args.wandb_project else args.wandb_save_dir)


class Board:
    """Where the scalars go besides the JSONL file, and which of them (Megatron's switches)."""

    def __init__(self, sinks: list, interval: int = 1, timers: bool = False, memory: bool = False,
                 validation_ppl: bool = False):
        self.sinks, self.interval = sinks, interval
        self.timers, self.memory, self.validation_ppl = timers, memory, validation_ppl

    def scalars(self, step: int, values: dict) -> None:
        values = {tag: float(v) for tag, v in values.items() if v is not None}
        for sink in self.sinks:
            sink.scalars(step, values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def check_wandb() -> None:
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise MindSpeedError("--wandb-project needs the wandb package: pip install wandb (or drop the flag; "
                             "--tensorboard-dir needs nothing more)") from None


def wandb_folder(args) -> str:
    return args.wandb_save_dir or os.path.join(args.save or ".", "wandb")


class WandbSink:
    """An offline Weights & Biases run (``wandb sync <folder>`` uploads it later)."""

    def __init__(self, chosen: Settings, config: dict):
        import wandb

        os.makedirs(chosen.wandb_dir, exist_ok=True)
        self.run = wandb.init(project=chosen.wandb_project, name=chosen.wandb_name, dir=chosen.wandb_dir,
                              mode="offline", config=config)

    def scalars(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def build(chosen: Settings, config: dict) -> Board | None:
    """The run's board, or None when no board was asked for. ``config``: the resolved
    configuration (Weights & Biases keeps it with the run)."""
    sinks = []
    if chosen.tensorboard_dir:
        features.note_used("tensorboard")
        sinks.append(EventWriter(chosen.tensorboard_dir, chosen.queue_size))
    if chosen.wandb_project:
        features.note_used("wandb")
        sinks.append(WandbSink(chosen, config))
    if not sinks:
        return None
    return Board(sinks, chosen.interval, chosen.timers, chosen.memory, chosen.validation_ppl)
