"""Both backends provide the whole facade, and the suite exercises every name of it."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

from mindspeed_core import facade, runtime

HERE = pathlib.Path(__file__).resolve().parent
BACKEND_MODULES = ["mindspeed_core.backends.torch", "mindspeed_core.backends.mindspore"]


@pytest.mark.parametrize("namespace", sorted(facade.SPEC))
def test_bound_backend_provides_every_name(namespace):
    module = getattr(runtime.bound(), namespace)
    missing = [name for name in facade.names(namespace) if not hasattr(module, name)]
    assert missing == []


def test_backends_have_the_same_module_layout():
    from mindspeed_core import backends

    for name in BACKEND_MODULES:
        for sub in backends.MODULES:
            assert importlib.util.find_spec(f"{name}.{sub}") is not None, f"{name}.{sub}"


def test_every_facade_name_is_exercised_by_a_test():
    import test_fused
    import test_ops

    # the multi-process checks run in dist_worker.py under the launchers
    sources = "\n".join(p.read_text() for p in [*HERE.glob("test_*.py"), HERE / "dist_worker.py"])
    table_ops = {op for _, op, *_ in test_fused.CASES.values()}
    unexercised = []
    for namespace, names in facade.SPEC.items():
        for name in names:
            if re.search(rf"\b{namespace}\.{re.escape(name)}\b", sources) or (namespace == "ops" and name in table_ops):
                continue
            unexercised.append(f"{namespace}.{name}")
    assert unexercised == [], "facade names no test calls"
    assert set(test_ops.CASES)  # the table-driven op checks exist
