"""What ``--feature-coverage`` and the CI skip rule check, as pure functions: conftest.py
feeds them what the run recorded, and test_coverage_gate.py proves that each check can fail."""

from __future__ import annotations

import re

# Skips CI accepts, each with the reason it is not a gap. Anything else that skips in CI
# (a missing test dependency above all) fails the run.
ALLOWED_SKIPS = (
    (r"no native kernel is bound for \w+ on this device",
     "native-vs-composite needs a native kernel; where the device has none the composite runs, "
     "which test_fused_matches_reference checks against float64"),
    (r"(bfloat16|float16) math is not available on this device",
     "MindSpore's CPU kernels have no bf16/fp16 matmul; the matrix calls those cells unsupported"),
    (r"network namespaces are not available here",
     "the two-node test builds two network namespaces joined by a veth pair, which needs root and iproute2"),
)


def feature_problems(required: set, marked: dict, passed: set, used: dict) -> list[str]:
    """``marked``: test id -> feature ids it carries; ``passed``: ids of passing tests;
    ``used``: test id -> feature ids recorded while it ran (with its fixtures).

    A cell is proved by a passing test marked with it that ran it; a passing marked test
    that never ran a required feature it names is itself a problem (the marker is wrong).
    (A marked test of a cell that is unsupported here checks the refusal instead.)"""
    problems, proved = [], set()
    for test in sorted(passed):
        for fid in sorted(set(marked.get(test, ())) & required):
            if fid in used.get(test, ()):
                proved.add(fid)
            else:
                problems.append(f"{test} is marked {fid!r} but never ran it")
    missing = sorted(required - proved)
    if missing:
        problems.append("no passing marked test ran: " + ", ".join(missing))
    return problems


def facade_problems(spec: dict, called: set) -> list[str]:
    """``spec``: namespace -> names (mindspeed_core.facade.SPEC); ``called``: "ns.name" used."""
    unused = sorted(f"{ns}.{name}" for ns, names in spec.items() for name in names if f"{ns}.{name}" not in called)
    return ["facade names no test used: " + ", ".join(unused)] if unused else []


def skip_problems(reasons: list[str]) -> list[str]:
    """Skip reasons outside ALLOWED_SKIPS."""
    return [r for r in reasons if not any(re.search(pattern, r) for pattern, _ in ALLOWED_SKIPS)]
