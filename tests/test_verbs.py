"""Every verb binds the framework its --ai-framework flag names, once, before anything else.

Each command runs as a user runs it: in a fresh process, with MINDSPEED_AI_FRAMEWORK unset
(so the default, pytorch, is what a wrong binding would pick), through `python -m
mindspeed_core.cli` or the MindSpeed-LLM-shaped scripts in tools/. The process must have
imported the named framework and no other (tests/verb_probe.py reports sys.modules at exit),
and what it printed must name the framework. `preprocess` and `convert` accept the flag and
import no framework at all (they run none: a machine with only one framework, or neither,
converts and preprocesses). The suite of each framework runs its own flag:
the MindSpore suite is the one where binding at import would have picked pytorch.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from mindspeed_core import cli, runtime
from launch import free_port
from test_plan import MACHINE, MODEL
from test_training import SMALL, corpus  # noqa: F401  (corpus is a fixture)

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROBE = str(pathlib.Path(__file__).with_name("verb_probe.py"))


def run_as_user(framework: str, cwd, target: list[str], stdin: str | None = None, timeout: int = 600):
    """Run ``target`` (["-m", module, ...] or [script, ...]) in a fresh process without the
    framework variable; returns (completed process, frameworks the process imported)."""
    report = pathlib.Path(cwd) / f"imported-{free_port()}.json"
    env = {k: v for k, v in os.environ.items() if k not in (runtime.ENV_VAR, runtime.DEVICE_ENV_VAR)}
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # msrun's workers' python
    done = subprocess.run([sys.executable, PROBE, str(report), *target], capture_output=True, text=True, env=env,
                          cwd=str(cwd), input=stdin, timeout=timeout)
    imported = json.loads(report.read_text()) if report.exists() else None
    return done, imported


@pytest.fixture(scope="module")
def made(corpus, tmp_path_factory):  # noqa: F811
    """A small checkpoint (trained here, on this suite's framework), a text file and a jsonl."""
    root = tmp_path_factory.mktemp("verbs")
    assert cli.main(["train", *SMALL, "--data-path", corpus, "--train-iters", "2", "--save", str(root / "ckpt")]) == 0
    (root / "sample.py").write_text("def add(a, b):\n    return a + b\n\n\nclass Point:\n    x = 0\n" * 4)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i}: " + "x = 1\n" * i}) + "\n"
                                             for i in range(1, 9)))
    return root


def _tool(name: str) -> str:
    return str(ROOT / "tools" / name)


# verb -> the command after the probe, given (framework, made folder, a fresh output folder, the corpus)
VERBS = {
    "features": lambda fw, m, out, c: ["-m", "mindspeed_core.cli", "features", "--ai-framework", fw],
    "check-args": lambda fw, m, out, c: ["-m", "mindspeed_core.cli", "check-args", "--ai-framework", fw, *SMALL,
                                         "--data-path", c, "--tensor-model-parallel-size", "1"],
    "info": lambda fw, m, out, c: ["-m", "mindspeed_core.cli", "info", "--ai-framework", fw],
    "train": lambda fw, m, out, c: [_tool("pretrain_gpt.py"), "--ai-framework", fw, *SMALL, "--data-path", c,
                                    "--train-iters", "1", "--save", str(out / "ckpt")],
    "posttrain": lambda fw, m, out, c: [_tool("posttrain_gpt.py"), "--ai-framework", fw, "--stage", "sft",
                                        "--dry-run"],
    "generate": lambda fw, m, out, c: [_tool("inference.py"), "--ai-framework", fw, "--load", str(m / "ckpt"),
                                       "--prompt", "def ", "--max-new-tokens", "4"],
    "chat": lambda fw, m, out, c: ["-m", "mindspeed_core.cli", "generate", "--ai-framework", fw, "--load",
                                   str(m / "ckpt"), "--task", "chat", "--prompt-type", "empty", "--max-new-tokens", "4"],
    "evaluate": lambda fw, m, out, c: [_tool("evaluation.py"), "--ai-framework", fw, "--load", str(m / "ckpt"),
                                       "--task", "perplexity", "--task-data-path", str(m / "sample.py"),
                                       "--results-file", str(out / "results.json")],
    "preprocess": lambda fw, m, out, c: [_tool("preprocess_data.py"), "--ai-framework", fw, "--input",
                                         str(m / "docs.jsonl"), "--output-prefix", str(out / "docs"), "--append-eod"],
    "convert": lambda fw, m, out, c: [_tool("convert_ckpt.py"), "--ai-framework", fw, "--load-model-type", "mg",
                                      "--save-model-type", "hf", "--load-dir", str(m / "ckpt"), "--save-dir",
                                      str(out / "hf")],
    "plan": lambda fw, m, out, c: ["-m", "mindspeed_core.cli", "plan", "--ai-framework", fw, *MODEL, "--devices", "2",
                                   "--memory-per-device", "4", *MACHINE, "--top", "1"],
    "launch-train": lambda fw, m, out, c: ["-m", "mindspeed_core.cli", "launch", "--nproc-per-node", "1",
                                           "--master-port", str(free_port()), "--log-dir", str(out / "logs"), "--",
                                           "--ai-framework", fw, *SMALL, "--data-path", c, "--train-iters", "1"],
    "launch-generate": lambda fw, m, out, c: ["-m", "mindspeed_core.cli", "launch", "--ai-framework", fw,
                                              "--nproc-per-node", "1", "--master-port", str(free_port()), "--log-dir",
                                              str(out / "logs"), "--", "generate", "--load", str(m / "ckpt"),
                                              "--prompt", "def ", "--max-new-tokens", "2"],
}


FRAMEWORK_FREE = {"preprocess", "convert"}


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_the_flag_binds_the_framework_in_a_fresh_process(framework, made, corpus, tmp_path, verb):  # noqa: F811
    done, imported = run_as_user(framework, tmp_path, VERBS[verb](framework, made, tmp_path, corpus),
                                 stdin="def f(\n/exit\n" if verb == "chat" else None)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    if verb in FRAMEWORK_FREE:
        assert imported == [], imported
        return
    assert imported == [{"pytorch": "torch", "mindspore": "mindspore"}[framework]], imported
    assert framework in said.lower(), said[-2000:]


def test_the_documented_commands_after_the_default_run_with_the_flag(framework, tmp_path, capsys, monkeypatch):
    """The generate / chat / evaluate commands after the embedded default (docs/generation.md),
    each with --ai-framework as the page tells MindSpore users to add, in the order written, from the
    folder the default run saved in. They run in this process (a fresh process per line: 100 s
    in the PyTorch suite; in this process 14 s, measured alone): that every verb binds its flag in a fresh
    process is test_the_flag_binds_the_framework_in_a_fresh_process above."""
    import io
    import shlex

    monkeypatch.chdir(tmp_path)
    fast = ["--sample-tokens", "0", "--eval-iters", "0", "--no-progress"]
    assert cli.main(["train", "--ai-framework", framework, "--train-iters", "2", *fast]) == 0
    page = (ROOT / "docs" / "generation.md").read_text()
    assert "add `--ai-framework mindspore` for MindSpore" in page
    block = page[page.index("<!-- after-the-default -->"):]
    block = block[block.index("```bash\n") + 8:block.index("```\n", block.index("```bash\n") + 8)]
    lines = [line for line in block.replace("\\\n", " ").splitlines() if line and not line.startswith("#")]
    verbs = [line.split()[1] for line in lines if line.startswith("mindspeed ")]
    assert {"generate", "evaluate", "train"} <= set(verbs)
    folder = os.path.join("checkpoints", "tiny-llama")
    for line in lines:
        if not line.startswith("mindspeed "):  # writing a file for the evaluation
            assert subprocess.run(line, shell=True, cwd=str(tmp_path)).returncode == 0, line
            continue
        argv = shlex.split(line.split("  #")[0])
        argv = [argv[1], "--ai-framework", framework, *argv[2:]]
        if argv[0] == "train":
            argv += ["--train-iters", "2", *fast]
        monkeypatch.setattr("sys.stdin", io.StringIO("def f(\n/exit\n"))
        capsys.readouterr()
        code = cli.main(argv)
        out, err = capsys.readouterr()
        assert code == 0, (line, err[-3000:])
        if argv[0] == "train" and "--stage" in argv:
            assert f"fine-tuning from the weights of {folder}" in out, out[-2000:]
        if argv[0] == "generate" and "chat" in argv:  # the chat read its line and answered
            assert out.strip(), line
