"""Model, parallel, training, memory and data code reach a framework only through the facade."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FRAMEWORK_FREE = ["models", "mindspeed_core/parallel", "mindspeed_core/training", "mindspeed_core/data",
                  "mindspeed_core/memory",
                  "mindspeed_core/composite.py", "mindspeed_core/features.py", "mindspeed_core/rng_tracker.py",
                  "mindspeed_core/tensor_files.py", "mindspeed_core/usage.py", "backends/emulated_collectives.py",
                  "backends/common.py",
                  "backends/initializers.py", "backends/state.py", "compat/mcore.py", "compat/torch_pickle.py",
                  "mindspeed_core/convert.py"]
FORBIDDEN = {"torch", "mindspore", "torch_npu"}


def framework_imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            names = [str(node.args[0].value)]
        found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    return found


def test_framework_free_code_imports_no_framework():
    files = []
    for entry in FRAMEWORK_FREE:
        p = ROOT / entry
        assert p.exists(), f"{entry} is listed as framework-free but does not exist"
        files += [p] if p.is_file() else sorted(p.rglob("*.py"))
    violations = [v for f in files for v in framework_imports(f)]
    assert violations == []


def test_the_rule_catches_a_violation(tmp_path):
    bad = tmp_path / "violation.py"
    bad.write_text("import os\nfrom torch import nn\nimport mindspore.ops as P\nimportlib.import_module('torch_npu')\n")
    assert [v.split(" imports ")[1] for v in framework_imports(bad)] == ["torch", "mindspore.ops", "torch_npu"]
