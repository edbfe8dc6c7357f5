"""One suite for both frameworks: the backend comes from MINDSPEED_AI_FRAMEWORK.

Also enforces the feature matrix's promise: with ``--feature-coverage`` (the README's test
command passes it), the run fails when a feature the matrix calls supported or emulated on
the selected framework/device has no passing test marked ``@pytest.mark.feature(id)``.
"""

from __future__ import annotations

import pytest

from mindspeed_core import features, runtime

BACKEND = runtime.bind()
FRAMEWORK = BACKEND.NAME
DEVICE = BACKEND.device.type()

_features_of: dict[str, set] = {}
_proved: set = set()


def pytest_addoption(parser):
    parser.addoption("--feature-coverage", action="store_true",
                     help="fail unless every supported/emulated matrix cell of this framework has a passing marked test")


def pytest_report_header(config):
    return f"mindspeed-core facade bound to {FRAMEWORK} {BACKEND.FRAMEWORK_VERSION} on {DEVICE}"


def pytest_collection_modifyitems(config, items):
    for item in items:
        ids = {m.args[0] for m in item.iter_markers("feature")}
        for fid in ids:
            features.get(fid)  # an unknown id is a typo: fail collection loudly
        if ids:
            _features_of[item.nodeid] = ids


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        _proved.update(_features_of.get(report.nodeid, ()))


def required_features() -> set:
    return {f.id for f in features.FEATURES if f.status(FRAMEWORK, DEVICE).kind in ("supported", "emulated")}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if not session.config.getoption("--feature-coverage"):
        return
    missing = sorted(required_features() - _proved)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter:
        reporter.write_sep("-", "feature coverage")
    if missing:
        if reporter:
            reporter.write_line(
                f"FEATURE COVERAGE: the matrix calls these supported/emulated on {FRAMEWORK}/{DEVICE} but no "
                f"marked test passed: {', '.join(missing)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif reporter:
        reporter.write_line(f"feature coverage: {len(required_features())} supported/emulated features of "
                            f"{FRAMEWORK}/{DEVICE} each have a passing marked test")


@pytest.fixture
def framework():
    return FRAMEWORK
