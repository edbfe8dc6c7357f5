"""One suite for both frameworks: the backend comes from MINDSPEED_AI_FRAMEWORK.

With ``--feature-coverage`` (the README's test command passes it) the run also fails when

* a feature the matrix calls supported or emulated on this framework/device was not *run*
  by a passing test marked ``@pytest.mark.feature(id)``: the code where a feature takes
  effect records it (mindspeed_core.features.note_used), in this process or in the ranks
  and subprocesses a test launches, through the file MINDSPEED_USAGE_FILE names;
* a passing test carries a feature marker whose feature it never ran;
* a name of the facade (mindspeed_core.facade.SPEC) was never used during the run.

``--facade-coverage`` checks the last point alone: .ci/run's subset on the lowest supported
torch must still call every facade name.

Under CI (``CI`` or ``MINDSPEED_CI`` set) a skip outside coverage_check.ALLOWED_SKIPS fails
the run, and the skip count is printed for .ci/run to report.

Under pytest-xdist (``-n 2``) each worker records what its tests marked, ran and called, and
hands it to the controller when it stops (``workeroutput``); the controller, which sees every
report, checks the union.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest

from mindspeed_core import usage

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the cores (README: -n 2): one thread each for torch's and MindSpore's
    # pools, as torchrun gives each of several ranks, in this process and in those its tests start.
    # Measured once each way on one machine: the MindSpore suite took 1461 s so, 1579 s with the
    # pools as the frameworks size them.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Before binding: the bound facade then records its use, and every process the tests start
# inherits the file to report to.
_usage_dir = tempfile.mkdtemp(prefix="mindspeed-usage-")
USAGE_FILE = os.environ[usage.ENV_VAR] = os.path.join(_usage_dir, "used.txt")
open(USAGE_FILE, "w").close()

from mindspeed_core import facade, features, runtime  # noqa: E402

import coverage_check  # noqa: E402

BACKEND = runtime.bind()
FRAMEWORK = BACKEND.NAME
DEVICE = BACKEND.device.type()
IN_CI = bool(os.environ.get("CI") or os.environ.get("MINDSPEED_CI"))

_marked: dict[str, set] = {}  # test id -> feature ids of its markers
_passed: set = set()
_used: dict[str, set] = {}  # test id -> feature ids recorded while it and its fixtures ran
_start: dict[str, int] = {}  # test id -> usage file offset when its setup began
_fixture_used: dict[int, set] = {}  # id(fixturedef) -> features recorded while it was set up
_skips: list[tuple[str, str]] = []
_workers_called: set = set()  # facade names the xdist workers' tests called


def pytest_addoption(parser):
    parser.addoption("--feature-coverage", action="store_true",
                     help="fail unless every supported/emulated matrix cell of this framework was run by a passing "
                          "marked test, every marker was honoured, and every facade name was used")
    parser.addoption("--facade-coverage", action="store_true",
                     help="fail unless every facade name was used (a run of a subset of the suite: the "
                          "lowest supported torch's)")


def pytest_report_header(config):
    return f"mindspeed-core facade bound to {FRAMEWORK} {BACKEND.FRAMEWORK_VERSION} on {DEVICE}"


def pytest_collection_modifyitems(config, items):
    # a test of no framework's code (marked framework_free) proves the same on either suite: it
    # runs in the PyTorch one (megatron-core, which such tests compare with, needs torch anyway),
    # and so does a test that runs both frameworks itself with the same result either way round
    # (marked both_frameworks); a test of MindSpore in a process of its own, whatever the suite
    # binds (marked mindspore_process), runs in the MindSpore one
    def elsewhere(item):
        if item.get_closest_marker("mindspore_process"):
            return FRAMEWORK != "mindspore"
        return FRAMEWORK != "pytorch" and bool(item.get_closest_marker("framework_free")
                                               or item.get_closest_marker("both_frameworks"))
    left = [item for item in items if elsewhere(item)]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if not elsewhere(item)]
    for item in items:
        ids = {m.args[0] for m in item.iter_markers("feature")}
        for fid in ids:
            features.get(fid)  # an unknown id is a typo: fail collection loudly
        if ids:
            _marked[item.nodeid] = ids


def _size() -> int:
    return os.path.getsize(USAGE_FILE)


def _features(names: set) -> set:
    return {n.split(":", 1)[1] for n in names if n.startswith("feature:")}


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    usage.reset()  # this test's uses are written again, within its window of the file
    _start[item.nodeid] = _size()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = _size()
    yield
    _fixture_used.setdefault(id(fixturedef), set()).update(_features(usage.read(USAGE_FILE, before)[0]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    used = _features(usage.read(USAGE_FILE, _start.get(item.nodeid, 0))[0])
    # a module-scoped fixture set up for an earlier test (one shared launch) counts for
    # every test that uses it
    for name in item.fixturenames:
        for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
            used |= _fixture_used.get(id(fixturedef), set())
    _used[item.nodeid] = used


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        _passed.add(report.nodeid)
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skips.append((report.nodeid, reason))


def required_features() -> set:
    return {f.id for f in features.FEATURES
            if f.status(FRAMEWORK, DEVICE, BACKEND.FRAMEWORK_VERSION).kind in ("supported", "emulated")}


def _facade_called() -> set:
    names, _ = usage.read(USAGE_FILE)
    return {n.split(":", 1)[1] for n in names if n.startswith("facade:")} | _workers_called


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller gathers a stopped worker's records (see the module's docstring)."""
    record = json.loads(getattr(node, "workeroutput", {}).get("mindspeed", "{}"))
    for nodeid, ids in record.get("marked", {}).items():
        _marked.setdefault(nodeid, set()).update(ids)
    for nodeid, ids in record.get("used", {}).items():
        _used.setdefault(nodeid, set()).update(ids)
    _workers_called.update(record.get("called", []))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if _is_xdist_worker(session.config):  # the controller checks; it has every worker's part
        session.config.workeroutput["mindspeed"] = json.dumps(
            {"marked": {k: sorted(v) for k, v in _marked.items()}, "used": {k: sorted(v) for k, v in _used.items()},
             "called": sorted(_facade_called())})
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def fail(title, problems):
        if reporter:
            reporter.write_line(f"{title}:", red=True)
            for p in problems:
                reporter.write_line(f"  {p}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

    if session.config.getoption("--feature-coverage"):
        if reporter:
            reporter.write_sep("-", "feature coverage")
        problems = coverage_check.feature_problems(required_features(), _marked, _passed, _used)
        problems += coverage_check.facade_problems(facade.SPEC, _facade_called())
        if problems:
            fail(f"FEATURE COVERAGE on {FRAMEWORK}/{DEVICE}", problems)
        elif reporter:
            reporter.write_line(f"feature coverage: each of the {len(required_features())} supported/emulated features "
                                f"of {FRAMEWORK}/{DEVICE} ran in a passing marked test; every marker was honoured; "
                                f"all {sum(len(v) for v in facade.SPEC.values())} facade names were used")
    elif session.config.getoption("--facade-coverage"):
        problems = coverage_check.facade_problems(facade.SPEC, _facade_called())
        if problems:
            fail(f"FACADE COVERAGE on {FRAMEWORK}/{DEVICE}", problems)
        elif reporter:
            reporter.write_line(f"facade coverage: all {sum(len(v) for v in facade.SPEC.values())} facade names "
                                "were used")
    if reporter:
        reporter.write_line(f"skips on {FRAMEWORK}: {len(_skips)}")
    if IN_CI:
        bad = [f"{t}: {r}" for t, r in _skips if coverage_check.skip_problems([r])]
        if bad:
            fail("SKIPS OUTSIDE THE ALLOW-LIST (tests/coverage_check.py) fail CI", bad)


def pytest_unconfigure(config):
    try:
        os.remove(USAGE_FILE)
        os.rmdir(_usage_dir)
    except OSError:
        pass


@pytest.fixture
def framework():
    return FRAMEWORK


def hf_reference_process(*args) -> None:
    """hf_reference.py in a process of its own (it imports torch and transformers)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_AI_FRAMEWORK"}
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "hf_reference.py"), *args],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.fixture(scope="session")
def hf_references(tmp_path_factory):
    """transformers' tiny random models and their logits (hf_reference.py), built once per run."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    hf_reference_process(str(root))
    return root

