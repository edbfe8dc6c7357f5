"""The README's Python example runs as written on the selected framework."""

from __future__ import annotations

import pathlib
import re


def test_readme_python_example_runs():
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "the README lost its Python example"
    # set_backend must not fight the framework this test run is bound to
    code = blocks[0].replace('mindspeed_core.set_backend("mindspore")', "mindspeed_core.get_backend()")
    scope: dict = {"__name__": "readme_example"}  # MindSpore keys compiled graphs by module name
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own documentation
    loss, grads = scope["loss"], scope["grads"]
    from mindspeed_core import ops

    assert ops.to_numpy(loss).shape == () and len(grads) == 1 and tuple(grads[0].shape) == (8, 4)
