"""The golden curves (tests/golden_curves.py): this framework's six canonical runs (the first
6 steps of 20-step schedules) against tests/golden/<framework>.json, and the comparison failing where it must."""

from __future__ import annotations

import copy
import json

import pytest

import golden_curves


@pytest.mark.multiprocess
def test_the_canonical_runs_stay_on_their_golden_curves(framework, tmp_path):
    golden = json.loads((golden_curves.GOLDEN / f"{framework}.json").read_text())
    problems = golden_curves.compare(golden_curves.run_all(framework, tmp_path), golden)
    assert not problems, "\n".join(problems[:20]) + (
        f"\n(a change meant to move them: python tests/golden_curves.py --ai-framework {framework}, and review the "
        "diff of the golden file)")


@pytest.mark.framework_free
def test_the_golden_comparison_fails_on_what_it_guards():
    golden = json.loads((golden_curves.GOLDEN / "pytorch.json").read_text())
    assert sorted(golden) == sorted(golden_curves.CONFIGS) and all(
        sorted(c["steps"], key=int) == [str(i) for i in range(1, golden_curves.RUN_STEPS + 1)] for c in golden.values())
    assert golden_curves.compare(copy.deepcopy(golden), golden) == []

    def moved(change):
        got = copy.deepcopy(golden)
        change(got)
        return golden_curves.compare(got, golden)

    def scale(name, step, field, factor):
        def change(got):
            got[name]["steps"][step][field] *= factor
        return change

    assert moved(scale("sft", "5", 0, 1 + 5e-6)) == []  # within the loss tolerance
    assert moved(scale("sft", "5", 0, 1 + 3e-5)) == [f"sft step 5: loss {golden['sft']['steps']['5'][0] * (1 + 3e-5)!r}, "
                                                     f"golden {golden['sft']['steps']['5'][0]!r}"]
    assert moved(scale("cp2", "6", 1, 1 + 5e-5)) == []
    assert [p.split(":")[0] for p in moved(scale("cp2", "6", 1, 1 + 3e-4))] == ["cp2 step 6"]
    assert moved(lambda g: g["moe-ep2"]["steps"]["3"].__setitem__(2, 1))[0].startswith("moe-ep2 step 3: 1 steps "
                                                                                       "skipped")
    assert moved(lambda g: g["default"]["flags"].append("--seed")) == [
        "default: its configuration changed since the golden values were written"]
    assert moved(lambda g: g["pp2-vpp"]["steps"].pop("6"))[0].startswith("pp2-vpp: logged steps")
    assert moved(lambda g: g.pop("tp2-sp-distopt")) == ["tp2-sp-distopt: not run"]


CROSS_LOSS_TOL = 5e-6  # relative, every step: measured 3.2e-6 (moe-ep2), as test_parity's bound
CROSS_NORM_TOL = 1e-4  # relative: measured 3.8e-5 (tp2-sp-distopt; Adam amplifies ulp-sized differences)


def cross_framework_problems(a: dict, b: dict) -> list[str]:
    """Where two frameworks' golden records of the same configurations part, one line each."""
    problems = []
    for name in sorted(a):
        if a[name]["flags"] != b[name]["flags"] or sorted(a[name]["steps"]) != sorted(b[name]["steps"]):
            problems.append(f"{name}: the two files record other runs")
            continue
        for step, (loss, norm, skipped) in a[name]["steps"].items():
            loss1, norm1, skipped1 = b[name]["steps"][step]
            if abs(loss - loss1) > CROSS_LOSS_TOL * abs(loss1) or skipped != skipped1:
                problems.append(f"{name} step {step}: loss {loss!r} / {loss1!r}, skipped {skipped} / {skipped1}")
            if abs(norm - norm1) > CROSS_NORM_TOL * abs(norm1):
                problems.append(f"{name} step {step}: grad norm {norm!r} / {norm1!r}")
    return problems


@pytest.mark.framework_free
def test_the_two_frameworks_golden_curves_agree():
    """PyTorch's and MindSpore's golden runs of the same configurations, step by step: the same
    losses within 5e-6 and grad norms within 1e-4 (relative), the same skipped steps; and the
    comparison sees a loss moved by 1e-5."""
    pytorch = json.loads((golden_curves.GOLDEN / "pytorch.json").read_text())
    mindspore = json.loads((golden_curves.GOLDEN / "mindspore.json").read_text())
    assert sorted(pytorch) == sorted(mindspore) == sorted(golden_curves.CONFIGS)
    problems = cross_framework_problems(pytorch, mindspore)
    assert not problems, "\n".join(problems)
    moved = copy.deepcopy(mindspore)
    moved["cp2"]["steps"]["4"][0] *= 1 + 1e-5
    assert [p.split(":")[0] for p in cross_framework_problems(pytorch, moved)] == ["cp2 step 4"]
