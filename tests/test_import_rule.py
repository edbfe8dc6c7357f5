"""Model, parallel, training, memory and data code reach a framework only through the facade."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FRAMEWORK_FREE = ["models", "mindspeed_core/parallel", "mindspeed_core/training", "mindspeed_core/data",
                  "mindspeed_core/memory",
                  "mindspeed_core/composite.py", "mindspeed_core/features.py", "mindspeed_core/rng_tracker.py",
                  "mindspeed_core/tensor_files.py", "mindspeed_core/usage.py", "backends/emulated_collectives.py",
                  "backends/common.py", "backends/torch/__init__.py", "backends/mindspore/__init__.py",
                  "mindspeed_core/launcher.py", "mindspeed_core/runtime.py",
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


# The layers, lowest first: a module imports only from its own layer, lower layers and the
# foundation (binding, the facade, the matrix, errors, files), never from a higher layer, so
# that each concept can be read without the ones built on it. Checked on every import
# statement, function-local ones included.
LAYERS = [
    ("backends", ["mindspeed_core.backends"]),
    ("memory", ["mindspeed_core.memory"]),  # recompute, swap: mechanisms the models call
    ("models", ["mindspeed_core.models"]),
    ("parallel", ["mindspeed_core.parallel"]),
    ("compat", ["mindspeed_core.compat"]),  # Megatron and Hugging Face conventions over models and layouts
    ("data", ["mindspeed_core.data"]),
    ("training", ["mindspeed_core.training"]),
    ("commands", ["mindspeed_core.cli", "mindspeed_core.launcher", "mindspeed_core.planner", "mindspeed_core.inference",
                  "mindspeed_core.chat", "mindspeed_core.streaming", "mindspeed_core.convert",
                  "mindspeed_core.evaluation", "mindspeed_core.measure", "mindspeed_core.plot"]),
]
# where each package's source sits in the checkout (the package metadata maps them)
SOURCE_ROOTS = {"mindspeed_core": "mindspeed_core", "backends": "mindspeed_core.backends",
                "compat": "mindspeed_core.compat", "models": "mindspeed_core.models"}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    parts = SOURCE_ROOTS[rel.parts[0]].split(".") + list(rel.parts[1:])
    parts[-1] = parts[-1][:-3]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    """{module: {project modules it imports anywhere in its source}}."""
    files = {_module_name(f): f for top in SOURCE_ROOTS for f in (ROOT / top).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = {m for m in found if m.split(".")[0] == "mindspeed_core"}
    return graph


def layer_of(module: str):
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None  # the foundation


def layer_violations(graph: dict) -> list[str]:
    found = []
    for module, imported in sorted(graph.items()):
        mine = layer_of(module)
        for other in sorted(imported):
            theirs = layer_of(other)
            if theirs is None:
                continue
            if mine is None or theirs > mine:
                where = "the foundation" if mine is None else LAYERS[mine][0]
                found.append(f"{module} ({where}) imports {other} ({LAYERS[theirs][0]})")
    return found


def test_layers_import_only_downwards():
    graph = import_graph()
    assert len(graph) > 80 and "mindspeed_core.training.trainer" in graph
    assert layer_violations(graph) == []


def test_the_layer_rule_catches_an_upward_import():
    graph = {"mindspeed_core.models.gpt": {"mindspeed_core.parallel.layers", "mindspeed_core.errors"},
             "mindspeed_core.features": {"mindspeed_core.training.trainer"},
             "mindspeed_core.cli": {"mindspeed_core.training.trainer"}}
    assert layer_violations(graph) == [
        "mindspeed_core.features (the foundation) imports mindspeed_core.training.trainer (training)",
        "mindspeed_core.models.gpt (models) imports mindspeed_core.parallel.layers (parallel)"]


def _packages_in(pyproject: str) -> list[str]:
    import tomllib

    return tomllib.loads(pyproject)["tool"]["setuptools"]["packages"]


def _source_packages() -> set[str]:
    """Every package of the source tree (a folder with an __init__.py), by its installed name."""
    return {_module_name(init) for top in SOURCE_ROOTS for init in (ROOT / top).rglob("__init__.py")}


def test_every_package_of_the_source_is_installed():
    """pyproject.toml lists the packages (backends/, compat/, models/ map under mindspeed_core):
    a package missing there is absent from every install, and the editable one used while
    developing hides it."""
    missing = sorted(_source_packages() - set(_packages_in((ROOT / "pyproject.toml").read_text())))
    assert missing == [], f"add to pyproject.toml's packages: {missing}"


def test_the_package_check_sees_a_missing_package():
    pyproject = (ROOT / "pyproject.toml").read_text().replace('    "mindspeed_core.models.families",\n', "")
    assert sorted(_source_packages() - set(_packages_in(pyproject))) == ["mindspeed_core.models.families"]
