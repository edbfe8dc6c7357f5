"""Operations: TensorBoard event files (read back by TensorBoard's own reader), Weights & Biases
offline runs, the profiler's window and operator table, and deterministic runs in one process
(the TP2 x DP2 ones are in test_parallel.py)."""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import subprocess
import sys
import time

import pytest

from test_training import SMALL, corpus, losses, train  # noqa: F401  (corpus is a fixture)

from mindspeed_core.training import tensorboard

RUN = [*SMALL, "--sample-tokens", "0", "--split", "90,10,0"]


def board_scalars(folder) -> dict:
    """{tag: {step: value}} as TensorBoard reads the folder."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def test_event_records_carry_the_crc_tensorboard_checks(tmp_path):
    """CRC-32C's check value; a record whose bytes were damaged is dropped by TensorBoard's
    reader (it checks our CRCs), the others are read."""
    assert tensorboard.crc32c(b"123456789") == 0xE3069283
    writer = tensorboard.EventWriter(str(tmp_path), queue_size=2)
    for step in (1, 2, 3):
        writer.scalars(step, {"lm loss": 10.0 - step, "negative step check": -1.5})
    writer.close()
    assert board_scalars(tmp_path)["lm loss"] == {1: 9.0, 2: 8.0, 3: 7.0}
    data = bytearray(open(writer.path, "rb").read())
    data[-6] ^= 0xFF  # inside the last record's payload
    open(writer.path, "wb").write(bytes(data))
    assert board_scalars(tmp_path)["lm loss"] == {1: 9.0, 2: 8.0}


@pytest.mark.feature("tensorboard")
def test_tensorboard_shows_what_the_metrics_file_holds(capsys, corpus, tmp_path):  # noqa: F811
    """Megatron's scalars and names: the step figures every --tensorboard-log-interval steps,
    throughput, timers and memory at each report, validation loss and perplexity at each
    evaluation; the values are the metrics file's."""
    metrics, board = tmp_path / "m.jsonl", tmp_path / "tb"
    code, out, err = train(capsys, *RUN, "--data-path", corpus, "--train-iters", "4", "--metrics-file", str(metrics),
                           "--eval-iters", "1", "--eval-interval", "2", "--log-interval", "2", "--tensorboard-dir",
                           str(board), "--tensorboard-log-interval", "2", "--log-timers-to-tensorboard",
                           "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard")
    assert code == 0, err
    got = board_scalars(board)
    records = [json.loads(line) for line in open(metrics)]
    steps = {r["iteration"]: r for r in records if "loss" in r}
    evals = {r["iteration"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(steps) == [2, 4] and sorted(evals) == [2, 4]
    assert got["lm loss"] == {i: f32(r["loss"]) for i, r in steps.items()}
    assert got["learning-rate"] == {i: f32(r["lr"]) for i, r in steps.items()}
    assert got["grad-norm"] == {i: f32(r["grad_norm"]) for i, r in steps.items()}
    assert got["batch-size"] == {2: 8.0, 4: 8.0} and got["loss-scale"] == {2: 1.0, 4: 1.0}
    assert got["tokens-per-second"] == {i: f32(r["tokens_per_s"]) for i, r in steps.items()}
    assert got["mfu"] == {i: f32(r["mfu"]) for i, r in steps.items()}
    assert got["lm loss validation"] == {i: f32(v) for i, v in evals.items()}
    assert got["lm loss validation ppl"] == pytest.approx({i: math.exp(v) for i, v in evals.items()}, rel=1e-6)
    for name in ("forward-backward", "optimizer", "iteration"):
        assert got[f"{name}-time"] == {i: f32(r["timers"][name]) for i, r in steps.items()}
        assert all(v > 0 for v in got[f"{name}-time"].values())
    assert all(got["forward-backward-time"][i] + got["optimizer-time"][i] <= got["iteration-time"][i] * 1.0001
               for i in steps)
    assert all(v > 2**20 for v in got["mem-host-rss-bytes"].values())


@pytest.mark.feature("wandb")
def test_wandb_keeps_an_offline_run_of_the_same_figures(capsys, corpus, tmp_path):  # noqa: F811
    """An offline run in --wandb-save-dir, holding each logged loss (wandb writes its records'
    values as JSON text)."""
    metrics = tmp_path / "m.jsonl"
    code, out, err = train(capsys, *RUN, "--data-path", corpus, "--train-iters", "2", "--metrics-file", str(metrics),
                           "--eval-iters", "0", "--wandb-project", "mindspeed-test", "--wandb-exp-name", "tiny",
                           "--wandb-save-dir", str(tmp_path / "wb"))
    assert code == 0, err
    runs = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, os.listdir(tmp_path / "wb")
    # wandb's own process writes the file; finish() may return before the last write lands
    for _ in range(60):
        data = open(runs[0], "rb").read()
        if all(json.dumps(loss).encode() in data for loss in losses(metrics).values()):
            break
        time.sleep(0.5)
    assert b"mindspeed-test" in data and b"tiny" in data and b"lm loss" in data
    for loss in losses(metrics).values():
        assert json.dumps(loss).encode() in data


def test_wandb_without_the_package_is_one_line(capsys, monkeypatch, corpus):  # noqa: F811
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    code, out, err = train(capsys, *RUN, "--data-path", corpus, "--train-iters", "2", "--wandb-project", "p")
    assert code == 2 and "pip install wandb" in err and len(err.strip().splitlines()) == 1


MATMUL = {"pytorch": "aten::mm", "mindspore": "MatMul"}


def profile_run(capsys, framework, corpus, folder, start, end, *extra):  # noqa: F811
    code, out, err = train(capsys, *RUN, "--data-path", corpus, "--train-iters", "4", "--eval-iters", "0", "--profile",
                           "--profile-step-start", str(start), "--profile-step-end", str(end), "--profile-save-path",
                           str(folder), *extra)
    assert code == 0, err
    table = (folder / "top_ops_rank0.txt").read_text()
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    return out, table, rows


@pytest.mark.feature("profiling")
def test_the_profile_window_holds_its_steps_and_names_the_top_operators(capsys, framework, corpus, tmp_path):  # noqa: F811
    """A window of one step and one of two (from step 1): the two-step window counts every
    matmul twice; each writes the framework's trace, and the table is printed."""
    out, table, rows = profile_run(capsys, framework, corpus, tmp_path / "one", 1, 2)
    out2, table2, rows2 = profile_run(capsys, framework, corpus, tmp_path / "two", 1, 3, "--profile-with-stack",
                                      "--profile-with-memory", "--profile-record-shapes", "--profile-with-cpu")
    assert "profiled steps 2-2 on rank 0" in out and "profiled steps 2-3 on rank 0" in out2
    assert table in out and table2 in out2
    assert table.splitlines()[0].split() == ["operator", "calls", "total", "ms", "mean", "ms", "share"]
    matmul = MATMUL[framework]
    assert matmul in rows and int(rows2[matmul][1]) == 2 * int(rows[matmul][1]) > 0
    if framework == "pytorch":
        traces = glob.glob(str(tmp_path / "two" / "rank0.*.pt.trace.json"))
        events = json.load(open(traces[0]))["traceEvents"]
    else:
        traces = glob.glob(str(tmp_path / "two" / "rank0" / "*" / "ASCEND_PROFILER_OUTPUT" / "trace_view.json"))
        events = json.load(open(traces[0]))
    assert len(traces) == 1 and traces[0] in out2
    names = {e.get("name") for e in events if e.get("ph") == "X"}
    assert matmul in names


@pytest.mark.parametrize("flags, says", [
    (["--profile-step-start", "3", "--profile-step-end", "3"], "must be after --profile-step-start"),
    (["--profile-step-start", "4"], "no step would be profiled"),
    (["--profile-ranks", "0", "2", "--profile-step-start", "1", "--profile-step-end", "2"],
     "--profile-ranks 2: the job has ranks 0..0"),
])
def test_a_profile_window_that_cannot_be_is_one_line(capsys, corpus, flags, says):  # noqa: F811
    code, out, err = train(capsys, *RUN, "--data-path", corpus, "--train-iters", "4", "--profile", *flags)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1


DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]


@pytest.mark.feature("deterministic")
def test_two_deterministic_runs_give_the_same_losses_bit_for_bit(framework, corpus, tmp_path):  # noqa: F811
    """The same seed, with dropout: two processes log the same losses exactly (each spelling
    of the flag once; MindSpore takes the setting once per process, so neither runs here)."""
    argv = [*RUN, *DROPOUT, "--data-path", corpus, "--train-iters", "4", "--eval-iters", "0"]
    for name, flag in (("a", "--use-deterministic-algorithms"), ("b", "--use-deterministic-comm")):
        done = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", "train", "--ai-framework", framework,
                               *argv, flag, "--metrics-file", str(tmp_path / f"{name}.jsonl")],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    a, b = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert sorted(a) == [1, 2, 3, 4] and a == b


def metrics_file(path, losses_by_step: dict, evals: dict = None, rate: float = 1000.0):
    with open(path, "a") as fh:
        for i, loss in losses_by_step.items():
            fh.write(json.dumps({"iteration": i, "loss": loss, "tokens_per_s": rate * i}) + "\n")
        for i, loss in (evals or {}).items():
            fh.write(json.dumps({"iteration": i, "eval_loss": loss}) + "\n")


@pytest.mark.framework_free
def test_plot_draws_each_runs_curves(tmp_path):
    """Two runs, one of them resumed from iteration 2 into the same file (the later records win):
    a PNG whose lines are the runs' losses, validation losses and throughput."""
    from mindspeed_core import cli, plot

    a, b = tmp_path / "pytorch.jsonl", tmp_path / "run2"
    b.mkdir()
    metrics_file(a, {1: 5.0, 2: 4.0, 3: 3.5}, {3: 3.9})
    metrics_file(b / "metrics.jsonl", {1: 5.1, 2: 4.2, 3: 9.9})
    metrics_file(b / "metrics.jsonl", {3: 3.6, 4: 3.2})  # resumed from the iteration-2 checkpoint
    out = tmp_path / "pics" / "curves.png"
    assert cli.main(["plot", str(a), str(b), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = {"pytorch": plot.read_run(str(a)), "run2": plot.read_run(str(b))}
    assert plot.labels_for([str(a), str(b)]) == ["pytorch", "run2"]
    assert runs["run2"]["loss"] == {1: 5.1, 2: 4.2, 3: 3.6, 4: 3.2}
    fig = plot.draw(runs, str(tmp_path / "again.png"))
    panels = {ax.get_title(): {line.get_label(): dict(zip(line.get_xdata(), line.get_ydata())) for line in ax.lines}
              for ax in fig.axes}
    assert panels["training loss"] == {"pytorch": {1: 5.0, 2: 4.0, 3: 3.5}, "run2": {1: 5.1, 2: 4.2, 3: 3.6, 4: 3.2}}
    assert panels["validation loss"] == {"pytorch": {3: 3.9}}
    assert panels["tokens/s"]["run2"] == {1: 1000.0, 2: 2000.0, 3: 3000.0, 4: 4000.0}


def test_pipeline_timelines_draw_a_box_per_action_where_it_ran(tmp_path):
    """benchmarks/pipeline_schedules.py's figure: each compute action of each rank a box from its
    start to its end on its rank's row, the schedules' panels on one time axis."""
    from mindspeed_core import plot
    from mindspeed_core.training.schedules import DUALPIPEV, pipeline_program, simulated_timeline

    timelines = {"1F1B": simulated_timeline(pipeline_program(2, 1, 4), 1),
                 "V": simulated_timeline(pipeline_program(2, 2, 4, schedule=DUALPIPEV), 2, DUALPIPEV, 0.5, 1.0)}
    out = tmp_path / "schedules.png"
    fig = plot.draw_timelines(timelines, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for ax, timeline in zip(fig.axes, timelines.values()):
        boxes = sorted((round(p.get_y() + p.get_height() / 2), p.get_x(), p.get_x() + p.get_width()) for p in ax.patches)
        assert boxes == sorted((r, a[3], a[4]) for r, actions in timeline.items() for a in actions)


@pytest.mark.framework_free
@pytest.mark.parametrize("args, says", [
    (["missing.jsonl"], "no such metrics file"),
    (["{tmp}/text.jsonl"], "not a JSON line"),
    (["{tmp}/empty.jsonl"], "no training losses"),
    (["{tmp}/empty.jsonl", "--labels", "a", "b"], "--labels gives 2 names for 1 runs"),
    (["{tmp}/empty.jsonl", "-o", "curves.svg"], "name it *.png"),
])
def test_plot_refuses_what_it_cannot_draw_in_one_line(capsys, tmp_path, args, says):
    from mindspeed_core import cli

    (tmp_path / "text.jsonl").write_text("iteration 1 loss 2\n")
    (tmp_path / "empty.jsonl").write_text(json.dumps({"iteration": 1, "eval_loss": 2.0}) + "\n")
    assert cli.main(["plot", *(a.format(tmp=tmp_path) for a in args)]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


@pytest.mark.multiprocess
@pytest.mark.feature("deterministic")
def test_the_deterministic_flag_sets_each_frameworks_switches_before_the_collectives(framework, corpus, tmp_path):  # noqa: F811
    """In each launched rank, when the collectives are set up and after the run: with the flag,
    torch's deterministic algorithms, cuDNN without autotuning and the cuBLAS workspace, or
    MindSpore's deterministic context, and HCCL_DETERMINISTIC; before the run (the same rank
    without the flag yet), none of them."""
    from launch import launch

    probe = os.path.join(os.path.dirname(__file__), "deterministic_probe.py")
    code, out = launch(framework, 2, probe, [str(tmp_path), "train", *RUN, "--data-path", corpus, "--train-iters", "1",
                                             "--use-deterministic-algorithms"], str(tmp_path / "logs"))
    assert code == 0, out[-3000:]
    records = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert len(records) == 2 and all(set(r) == {"before", "at_init", "end"} for r in records), records
    for when in ("before", "at_init", "end"):
        on = when != "before"
        for state in (r[when] for r in records):
            assert state["HCCL_DETERMINISTIC"] == ("true" if on else None), (when, state)
            if framework == "pytorch":
                assert (state["algorithms"], state["cudnn_deterministic"]) == (on, on), (when, state)
                if on:
                    assert state["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and not state["cudnn_benchmark"], state
            else:
                assert state["mindspore"] == ("ON" if on else "OFF"), (when, state)
