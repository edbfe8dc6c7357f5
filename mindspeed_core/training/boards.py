"""The boards: TensorBoard event files (--tensorboard-dir) and Weights & Biases in offline mode
(--wandb-project), fed the same scalars by training.metrics.MetricsLog, on rank 0."""

from __future__ import annotations

import os

from mindspeed_core import features
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.training.tensorboard import EventWriter


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

    def __init__(self, args, config: dict):
        import wandb

        folder = wandb_folder(args)
        os.makedirs(folder, exist_ok=True)
        self.run = wandb.init(project=args.wandb_project, name=args.wandb_exp_name, dir=folder, mode="offline",
                              config=config)

    def scalars(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def build(args, config: dict) -> Board | None:
    """The run's board, or None when no board was asked for. ``config``: the resolved
    configuration (Weights & Biases keeps it with the run)."""
    sinks = []
    if args.tensorboard_dir:
        features.note_used("tensorboard")
        sinks.append(EventWriter(args.tensorboard_dir, args.tensorboard_queue_size))
    if args.wandb_project:
        features.note_used("wandb")
        sinks.append(WandbSink(args, config))
    if not sinks:
        return None
    return Board(sinks, args.tensorboard_log_interval, args.log_timers_to_tensorboard, args.log_memory_to_tensorboard,
                 args.log_validation_ppl_to_tensorboard)
