"""``mindspeed plot METRICS.jsonl [more runs ...] -o curves.png``: the loss, validation loss,
reward (online RL) and throughput curves of one or several runs (PyTorch against MindSpore, TP1 against TP2, ...) in
one PNG.

A run is a metrics file (the trainer's --metrics-file) or a folder holding metrics.jsonl (a
--save folder). Where a file holds an iteration twice (a run resumed from an earlier
checkpoint, or started again into the same file), the later record wins: the curve is the
run as it stands. Needs matplotlib (``pip install 'mindspeed-core[plot]'``).
"""

from __future__ import annotations

import json
import os

from mindspeed_core import files
from mindspeed_core.compat.megatron_args import ArgumentParser
from mindspeed_core.errors import MindSpeedError

PANELS = (("loss", "training loss"), ("eval_loss", "validation loss"), ("train_reward", "mean reward (--stage grpo)"),
          ("tokens_per_s", "tokens/s"))


def read_run(path: str) -> dict:
    """{figure: {iteration: value}} of the PANELS' figures."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        raise MindSpeedError(f"{path}: no such metrics file (give the trainer's --metrics-file, or a --save folder "
                             "holding metrics.jsonl)")
    series = {name: {} for name, _ in PANELS}
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise MindSpeedError(f"{path}:{number}: not a JSON line; is this a metrics file?") from None
            if not isinstance(record, dict) or "iteration" not in record:
                continue
            iteration = record["iteration"]
            if type(iteration) is not int or iteration < 0:
                raise MindSpeedError(f"{path}:{number}: the iteration is {iteration!r}, not a step number; is this a "
                                     "metrics file of mindspeed train?")
            for name in series:
                value = record.get(name)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    series[name][iteration] = float(value)
    if not series["loss"]:
        raise MindSpeedError(f"{path}: no training losses in it (is it a metrics file of mindspeed train?)")
    return series


def labels_for(paths: list[str]) -> list[str]:
    """A run's folder name for <folder>/metrics.jsonl, else the file's name without .jsonl;
    repeated names get their position."""
    names = []
    for path in paths:
        path = os.path.normpath(path)
        if os.path.isdir(path) or os.path.basename(path) == "metrics.jsonl":
            name = os.path.basename(path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)))
        else:
            name = os.path.basename(path).removesuffix(".jsonl")
        names.append(name)
    return [f"{name} ({k + 1})" if names.count(name) > 1 else name for k, name in enumerate(names)]


def draw(runs: dict, output: str, title: str | None = None):
    """The PNG of ``runs`` ({label: read_run(...)}); returns matplotlib's figure."""
    pyplot = _pyplot()

    panels = [(name, what) for name, what in PANELS if any(series[name] for series in runs.values())]
    fig, axes = pyplot.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (name, what) in zip(axes[0], panels):
        for label, series in runs.items():
            points = sorted(series[name].items())
            if points:
                ax.plot([i for i, _ in points], [v for _, v in points], label=label,
                        marker="o" if len(points) < 12 else None)
        ax.set_title(what)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    if title:
        fig.suptitle(title)
    return _save(fig, output, pyplot)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MindSpeedError("mindspeed plot needs matplotlib: pip install 'mindspeed-core[plot]' "
                             "(or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    return pyplot


def draw_timelines(timelines: dict, output: str, unit: str = "time"):
    """A PNG of pipeline timelines, one panel each ({title: {rank: [(F|B, chunk, micro-batch,
    start, end)]}}, as schedules.simulated_timeline gives them or as measured): a row per rank,
    forwards light and backwards dark, a --moe-fb-overlap pair of the two purple, chunk 1 hatched,
    each box labelled with its micro-batch; the gaps are the bubble. The panels share the time axis."""
    pyplot = _pyplot()
    fig, axes = pyplot.subplots(len(timelines), 1, figsize=(12, 1.2 + 0.5 * sum(len(t) for t in timelines.values())),
                                squeeze=False, sharex=True)
    colours = {"F": "#9ecae1", "B": "#3182bd", "FB": "#756bb1"}
    for ax, (title, timeline) in zip(axes[:, 0], timelines.items()):
        for rank, actions in timeline.items():
            for kind, chunk, mb, start, end in actions:
                ax.barh(rank, end - start, left=start, color=colours[kind], edgecolor="black", linewidth=0.5,
                        hatch="//" if chunk else None)
                ax.text((start + end) / 2, rank, str(mb), ha="center", va="center", fontsize=7,
                        color="black" if kind == "F" else "white")
        ax.set_yticks(list(timeline))
        ax.set_yticklabels([f"rank {r}" for r in timeline])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
    axes[-1][0].set_xlabel(unit)
    return _save(fig, output, pyplot)


def _save(fig, output: str, pyplot):
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    temporary = f"{output}.tmp-{os.getpid()}.png"  # an existing picture stays until the new one is whole
    try:
        fig.tight_layout()
        fig.savefig(temporary, dpi=100)
        os.replace(temporary, output)
    except ValueError as exc:  # matplotlib's mathtext: a "$" in a title or label starts a formula
        raise MindSpeedError(f"matplotlib cannot draw a title or label ({str(exc).splitlines()[0]}); a '$' starts "
                             "a formula there: write it as '\\$'") from None
    finally:
        pyplot.close(fig)
        if os.path.exists(temporary):
            os.remove(temporary)
    return fig


def parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mindspeed plot", description="draw the curves of one or several training runs")
    parser.add_argument("runs", nargs="+", metavar="METRICS", help="metrics files (or --save folders)")
    parser.add_argument("-o", "--output", default="curves.png", help="the PNG to write (default curves.png)")
    parser.add_argument("--labels", nargs="+", default=None, help="one name per run (default: from the paths)")
    parser.add_argument("--title", default=None)
    return parser


def run(args, backend=None) -> int:
    """`mindspeed plot` once its flags are parsed (no framework: matplotlib draws)."""
    if args.labels is not None and len(args.labels) != len(args.runs):
        raise MindSpeedError(f"--labels gives {len(args.labels)} names for {len(args.runs)} runs")
    if not args.output.lower().endswith(".png"):
        raise MindSpeedError(f"-o {args.output}: the picture is a PNG; name it *.png")
    if os.path.isdir(args.output):
        raise MindSpeedError(f"-o {args.output} is a folder: name the PNG to write")
    files.check_writable(os.path.dirname(os.path.abspath(args.output)), f"-o {args.output}'s folder")
    labels = args.labels or labels_for(args.runs)
    runs = {label: read_run(path) for label, path in zip(labels, args.runs)}
    draw(runs, args.output, args.title)
    print(f"wrote {args.output}: " + "; ".join(f"{label}: {len(s['loss'])} iterations, last loss "
                                                f"{s['loss'][max(s['loss'])]:.4f}" for label, s in runs.items()))
    return 0
