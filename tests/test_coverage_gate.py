"""The gate itself (tests/coverage_check.py and conftest.py's use of it): each check reports
what it exists to catch, passes what it should, and a pytest run with the gate on fails on it."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import coverage_check

HERE = pathlib.Path(__file__).parent


@pytest.mark.framework_free
def test_feature_problems_name_a_marker_never_run_and_a_cell_no_test_ran():
    required = {"lora", "sft"}
    marked = {"t::a": {"lora"}, "t::b": {"sft"}, "t::c": {"sft"}}
    # both cells proved: a passing marked test ran each (t::c's sft was proved by t::b, but t::c
    # carries a marker it never honoured)
    assert coverage_check.feature_problems(required, {"t::a": {"lora"}, "t::b": {"sft"}}, {"t::a", "t::b"},
                                           {"t::a": {"lora"}, "t::b": {"sft", "lora"}}) == []
    problems = coverage_check.feature_problems(required, marked, {"t::a", "t::b", "t::c"},
                                               {"t::a": {"lora"}, "t::b": {"sft"}, "t::c": set()})
    assert problems == ["t::c is marked 'sft' but never ran it"]
    # a cell whose only marked test failed (not in passed), and one no test carries
    problems = coverage_check.feature_problems(required | {"dpo"}, marked, {"t::b"}, {"t::a": {"lora"},
                                                                                      "t::b": {"sft"}})
    assert problems == ["no passing marked test ran: dpo, lora"]
    # a marker of a feature this framework does not support is not the gate's business
    assert coverage_check.feature_problems({"sft"}, {"t::b": {"sft", "mc2"}}, {"t::b"}, {"t::b": {"sft"}}) == []


@pytest.mark.framework_free
def test_facade_and_skip_problems():
    spec = {"ops": ("add", "matmul"), "dist": ("all_reduce",)}
    assert coverage_check.facade_problems(spec, {"ops.add", "ops.matmul", "dist.all_reduce"}) == []
    assert coverage_check.facade_problems(spec, {"ops.add"}) == ["facade names no test used: dist.all_reduce, "
                                                                 "ops.matmul"]
    allowed = "no native kernel is bound for swiglu on this device"
    assert coverage_check.skip_problems([allowed, "bfloat16 math is not available on this device"]) == []
    assert coverage_check.skip_problems([allowed, "could not import 'peft': No module named 'peft'"]) == [
        "could not import 'peft': No module named 'peft'"]


CRAFTED = '''
import pytest

@pytest.mark.feature("deterministic")
def test_marked_but_runs_nothing():
    pass

def test_skips_for_a_missing_dependency():
    pytest.skip("could not import 'peft': No module named 'peft'")

def test_skips_for_an_allowed_reason():
    pytest.skip("bfloat16 math is not available on this device")

@pytest.mark.feature("sft")
def test_marked_and_runs_it():
    from mindspeed_core import features, ops
    features.note_used("sft")
    ops.add(ops.tensor([1.0]), ops.tensor([2.0]))
'''


def _run(tmp_path, *args, ci: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "MINDSPEED_CI", "PYTEST_ADDOPTS")}
    if ci:
        env["MINDSPEED_CI"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.framework_free
def test_a_run_with_the_gate_on_fails_on_each_problem(tmp_path):
    """conftest.py and coverage_check.py beside crafted tests, in a pytest of their own:
    --feature-coverage fails on a marker never honoured, on cells no test ran and on facade names
    never used; under CI a skip outside the allow-list fails; the allowed skip alone passes."""
    for name in ("conftest.py", "coverage_check.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "test_crafted.py").write_text(CRAFTED)
    done = _run(tmp_path, "test_crafted.py::test_marked_but_runs_nothing", "--feature-coverage", ci=False)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "test_crafted.py::test_marked_but_runs_nothing is marked 'deterministic' but never ran it" in done.stdout
    assert "no passing marked test ran: " in done.stdout and "facade names no test used: " in done.stdout
    done = _run(tmp_path, "test_crafted.py", "-k", "skips", ci=True)
    assert done.returncode == 1 and "SKIPS OUTSIDE THE ALLOW-LIST" in done.stdout, done.stdout[-2000:]
    assert "No module named 'peft'" in done.stdout and "bfloat16 math" not in done.stdout.split("ALLOW-LIST")[1]
    done = _run(tmp_path, "test_crafted.py::test_skips_for_an_allowed_reason", ci=True)
    assert done.returncode == 0 and "skips on " in done.stdout, done.stdout[-2000:]
    done = _run(tmp_path, "test_crafted.py", "-k", "skips", ci=False)  # outside CI a skip is reported, not failed
    assert done.returncode == 0, done.stdout[-2000:]


@pytest.mark.framework_free
def test_the_gate_sees_what_xdist_workers_ran(tmp_path):
    """The README's command runs the suite on two pytest-xdist workers: the controller checks what
    the workers' tests marked and ran (a feature and facade names run on a worker count, a marker
    never honoured there still fails) and counts their skips under CI."""
    pytest.importorskip("xdist")
    for name in ("conftest.py", "coverage_check.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "test_crafted.py").write_text(CRAFTED)
    done = _run(tmp_path, "test_crafted.py::test_marked_but_runs_nothing", "test_crafted.py::test_marked_and_runs_it",
                "--feature-coverage", "-n", "2", "--dist", "load", ci=False)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "test_crafted.py::test_marked_but_runs_nothing is marked 'deterministic' but never ran it" in done.stdout
    assert "test_marked_and_runs_it is marked" not in done.stdout, done.stdout[-2000:]
    missing = done.stdout.split("no passing marked test ran: ")[1].split("\n")[0].split(", ")
    assert "deterministic" in missing and "sft" not in missing, missing
    unused = done.stdout.split("facade names no test used: ")[1].split("\n")[0].split(", ")
    assert "ops.tensor" not in unused and "ops.add" not in unused and "ops.matmul" in unused, unused
    done = _run(tmp_path, "test_crafted.py", "-k", "skips", "-n", "2", ci=True)
    assert done.returncode == 1 and "SKIPS OUTSIDE THE ALLOW-LIST" in done.stdout, done.stdout[-2000:]
    assert "skips on " in done.stdout and "No module named 'peft'" in done.stdout.split("ALLOW-LIST")[1]
