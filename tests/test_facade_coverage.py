"""Both backends provide the whole facade. (That the suite uses every name of it is checked
at run time: conftest.py records facade calls and --feature-coverage fails on an unused one.)"""

from __future__ import annotations

import importlib
import pytest

from mindspeed_core import facade, runtime

BACKEND_MODULES = ["mindspeed_core.backends.torch", "mindspeed_core.backends.mindspore"]


@pytest.mark.parametrize("namespace", sorted(facade.SPEC))
def test_bound_backend_provides_every_name(namespace):
    module = getattr(runtime.bound(), namespace)
    missing = [name for name in facade.names(namespace) if not hasattr(module, name)]
    assert missing == []


def test_backends_have_the_same_module_layout():
    for name in BACKEND_MODULES:
        for sub in facade.NAMESPACES:
            assert importlib.util.find_spec(f"{name}.{sub}") is not None, f"{name}.{sub}"
