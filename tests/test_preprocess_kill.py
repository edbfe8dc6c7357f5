"""A preprocessing run into an existing output prefix, killed anywhere, leaves the old run's
outputs or the new run's, never a mix of keys (new input_ids beside old labels would train on
wrong targets without a sign). Each kill is a real SIGKILL of a separate process: at every
rename the run makes (the publish step included), and at random moments."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mindspeed_core.data.indexed import IndexedDataset

pytestmark = pytest.mark.framework_free  # preprocessing: no framework's code


KEYS = ("input_ids", "attention_mask", "labels")
FLAGS = ["--handler-name", "AlpacaStyleInstructionHandler", "--pack", "--seq-length", "64"]
# the child runs `mindspeed preprocess` and SIGKILLs itself at its KILL_AT-th os.replace
CHILD = textwrap.dedent("""
    import os, signal, sys
    kill_at, argv = int(sys.argv[1]), sys.argv[2:]
    real, calls = os.replace, [0]
    def replace(a, b):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        real(a, b)
    os.replace = replace
    from mindspeed_core import cli
    sys.exit(cli.main(argv))
""")


def _records(answer_base: int) -> list:
    # the same lengths in both runs: a mix of keys would pass every shape check
    return [{"instruction": f"What is {answer_base}+{i}?", "input": "", "output": str(answer_base + i)}
            for i in range(40)]


def _run(folder, data, kill_at=0, wait=True):
    argv = ["preprocess", "--input", str(data), "--output-prefix", str(folder / "sft"), *FLAGS]
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_AI_FRAMEWORK"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(kill_at), *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if wait:
        proc.wait(timeout=300)
    return proc


def _outputs(folder) -> dict:
    """{key: (idx bytes, bin bytes)} as a reader sees them (opening one rolls a journal forward)."""
    out = {}
    for key in KEYS:
        prefix = str(folder / f"sft_packed_{key}_document")
        IndexedDataset(prefix)
        out[key] = tuple(open(prefix + ext, "rb").read() for ext in (".idx", ".bin"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    for name, base in (("old", 100000), ("new", 200000)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(base)))
        (root / name).mkdir()
        assert _run(root / name, root / f"{name}.jsonl").returncode == 0
    return root, _outputs(root / "old"), _outputs(root / "new")


def _rerun_killed(root, tmp_path, **kill):
    """The old run's prefix, re-run with the new data (killed as ``kill`` says)."""
    folder = tmp_path / "prefix"
    shutil.copytree(root / "old", folder)
    proc = _run(folder, root / "new.jsonl", **kill)
    return folder, proc


def _assert_one_run(folder, old, new):
    got = _outputs(folder)
    assert got in (old, new), {k: (got[k] == old[k], got[k] == new[k]) for k in KEYS}
    leftovers = [n for n in os.listdir(folder) if ".tmp-" in n or "unpacked" in n or n.endswith(".json")]
    return got == new, leftovers


def test_a_rerun_killed_at_every_rename_leaves_one_run(runs, tmp_path):
    root, old, new = runs
    outcomes = []
    for kill_at in range(1, 12):  # the journal, then each of the 6 files, and past the end
        case = tmp_path / f"at{kill_at}"
        folder, proc = _rerun_killed(root, case, kill_at=kill_at)
        killed = proc.returncode == -signal.SIGKILL
        is_new, leftovers = _assert_one_run(folder, old, new)
        outcomes.append((kill_at, killed, is_new))
        if not killed:
            assert proc.returncode == 0 and is_new and not leftovers, (proc.stderr, leftovers)
    # both outcomes happen: killed before the journal is written (old), and after it (rolled forward)
    assert {o[2] for o in outcomes if o[1]} == {False, True}, outcomes
    # the next run into the prefix starts clean, finishes, and leaves no temporaries of the killed ones
    assert _run(folder, root / "new.jsonl").returncode == 0 and _outputs(folder) == new
    assert [n for n in os.listdir(folder) if ".tmp-" in n or "unpacked" in n or n.endswith(".json")] == []


def test_a_rerun_killed_at_random_moments_leaves_one_run(runs, tmp_path):
    root, old, new = runs
    (tmp_path / "timing").mkdir()
    start = time.perf_counter()
    assert _run(tmp_path / "timing", root / "new.jsonl").returncode == 0
    whole = time.perf_counter() - start
    rng = random.Random(7)
    for trial in range(4):
        folder, proc = _rerun_killed(root, tmp_path / f"r{trial}", wait=False)
        time.sleep(rng.uniform(0.3, 1.0) * whole)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        _assert_one_run(folder, old, new)
