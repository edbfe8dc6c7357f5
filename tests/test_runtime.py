"""Framework selection: precedence, device choice, and the errors a user can act on.

Each case runs in a fresh interpreter, since binding happens once per process. Those that set
their interpreter's framework themselves (not the suite's) prove the same in either suite, so
they are marked framework_free: the PyTorch suite runs them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mindspeed_core import runtime


def run_py(code: str, env_framework: str | None = None, extra_env: dict | None = None):
    env = {k: v for k, v in os.environ.items() if k not in (runtime.ENV_VAR, runtime.DEVICE_ENV_VAR)}
    if env_framework:
        env[runtime.ENV_VAR] = env_framework
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.framework_free
def test_default_is_pytorch_and_env_selects():
    assert runtime.resolve.__module__ == "mindspeed_core.runtime"
    out = run_py("import mindspeed_core as m; print(m.get_backend())")
    assert out.stdout.strip() == "pytorch", out.stderr
    out = run_py("import mindspeed_core as m; print(m.get_backend())", env_framework="MindSpore")
    assert out.stdout.strip() == "mindspore", out.stderr


@pytest.mark.framework_free
def test_precedence_flag_then_api_then_env():
    code = """
        from mindspeed_core import runtime
        import mindspeed_core as m
        print(runtime.resolve())
        m.set_backend("mindspore")
        print(runtime.resolve())
        print(runtime.resolve("pytorch"))
    """
    out = run_py(code, env_framework="pytorch")
    assert out.stdout.split("\n")[:3] == ["pytorch", "mindspore", "pytorch"], out.stderr


@pytest.mark.framework_free
def test_binding_is_once_per_process():
    code = """
        import mindspeed_core as m
        from mindspeed_core import ops, runtime
        from mindspeed_core.errors import BackendError
        ops.zeros((1,))
        assert runtime.bind("pytorch") is runtime.bound()
        for attempt in (lambda: runtime.bind("mindspore"), lambda: m.set_backend("mindspore")):
            try:
                attempt()
            except BackendError as e:
                print("refused:", e)
    """
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("refused:")]
    assert len(lines) == 2 and all("already bound to pytorch" in line for line in lines)


@pytest.mark.framework_free
def test_unknown_framework_lists_the_choices():
    out = run_py("import mindspeed_core as m; m.set_backend('jax')")
    assert "unknown AI framework 'jax'; choose one of: pytorch, mindspore" in out.stderr
    cli = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", "info"], capture_output=True, text=True,
                         env={**os.environ, runtime.ENV_VAR: "tensorflow"}, timeout=120)
    assert cli.returncode == 2
    assert cli.stderr.strip().count("\n") == 0 and "unknown AI framework 'tensorflow'" in cli.stderr


@pytest.mark.framework_free
def test_missing_framework_names_the_extra_to_install(tmp_path):
    # A stand-in 'mindspore' package that fails to import, as on a machine without it.
    fake = tmp_path / "mindspore"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named mindspore', name='mindspore')\n")
    out = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", "info", "--ai-framework", "mindspore"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 2
    assert "pip install 'mindspeed-core[mindspore]'" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.framework_free
def test_device_override_and_unknown_device():
    out = run_py("from mindspeed_core import runtime; b = runtime.bind(device='cpu'); print(b.device.type())")
    assert out.stdout.strip() == "cpu", out.stderr
    out = run_py("from mindspeed_core import runtime; runtime.bind(device='tpu')")
    assert "unknown device 'tpu'" in out.stderr
    cli = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", "info", "--device", "npu"],
                         capture_output=True, text=True, timeout=120)
    if "npu" not in __import__("mindspeed_core").device.available():
        assert cli.returncode == 2 and "not available" in cli.stderr


def test_info_reports_kernels_per_device(framework):
    out = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", "info", "--ai-framework", framework, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    info = json.loads(out.stdout)
    assert info["framework"] == framework
    assert set(info["implementations"]["ops"]) >= {"rms_norm", "attention", "grouped_matmul"}
    assert set(info["implementations"]["dist"]) >= {"all_reduce", "reduce_scatter", "all_to_all", "send"}


@pytest.mark.framework_free
def test_wheel_installs_everything_under_one_name(tmp_path):
    import pathlib
    import zipfile

    root = pathlib.Path(__file__).resolve().parents[1]
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(root), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("mindspeed_core-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"mindspeed_core"}, top
    for sub in ("backends/torch/ops.py", "backends/mindspore/dist.py", "compat/megatron_args.py", "models/__init__.py"):
        assert f"mindspeed_core/{sub}" in names
