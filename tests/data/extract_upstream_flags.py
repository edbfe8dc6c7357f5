"""Make upstream_scripts.json from MindSpeed-LLM's example scripts (a checkout's
examples/mcore/<family>/*.sh): for each script, the entry point its python line runs and the
flags it passes, shell variables expanded. Paths become placeholders. Facts only: flag names
and values, no upstream code.

    python tests/data/extract_upstream_flags.py /path/to/MindSpeed-LLM > tests/data/upstream_scripts.json
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import sys

FAMILIES = ("llama2", "qwen25", "qwen3", "qwen3_moe", "phi35", "gemma2", "deepseek3", "deepseek2_lite", "glm45",
            "glm45-air", "qwen3_next", "qwen3_coder_next", "gated_deltanet", "kimi2", "seed_oss", "magistral",
            "minimax27", "plm", "deepseek32", "glm5", "glm52", "longcat", "hunyuan3", "ling_v2")
ENTRY_POINTS = ("pretrain_gpt.py", "posttrain_gpt.py", "preprocess_data.py", "convert_ckpt.py", "convert_ckpt_v2.py",
                "inference.py", "evaluation.py")
PATHISH = re.compile(r"(path|dir|your|\.json|\.model|/)", re.I)


def _assignments(text: str) -> dict:
    env = {}
    # a value is quoted and bare pieces side by side, as the shell joins them ("a "b" c": a b c)
    for m in re.finditer(r'^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=((?:"(?:[^"\\]|\\.)*"|\'[^\']*\'|[^\s#"\'])*)',
                         text, re.M):
        value = re.sub(r'"((?:[^"\\]|\\.)*)"|\'([^\']*)\'', lambda q: q.group(1) if q.group(1) is not None
                       else q.group(2), m.group(2))
        env[m.group(1)] = value.replace("\\\n", " ")
    return env


def _expand(text: str, env: dict, depth: int = 0) -> str:
    if depth > 5:
        return text
    # an unset variable is empty, as in the shell
    out = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:\[@\])?\}|\$([A-Za-z_][A-Za-z0-9_]*)",  # ${A}, ${A[@]}, $A
                 lambda m: env.get(m.group(1) or m.group(2), ""), text)
    return out if out == text else _expand(out, env, depth + 1)


def script_calls(path: pathlib.Path) -> list[dict]:
    text = path.read_text(errors="replace").replace("\\\r\n", " ").replace("\\\n", " ")
    env = _assignments(text)
    calls = []
    for line in text.splitlines():
        entry = next((e for e in ENTRY_POINTS if re.search(r"(^|[\s/])" + re.escape(e) + r"(\s|$)", line)), None)
        if entry is None or line.lstrip().startswith("#"):
            continue
        # the command ends at a pipe or a redirection (2>&1 included)
        command = _expand(re.split(r"\|\s*|\d?>", line)[0], env).rstrip().rstrip("\\")  # a last line's dangling backslash
        words = shlex.split(command, comments=True)  # a line the shell cannot read is an error here too
        at = next(i for i, w in enumerate(words) if w.endswith(entry))
        flags = [w for w in words[at + 1:]]
        launcher = "torchrun" if any(w in ("torchrun", "torch.distributed.launch") or w.endswith("torchrun")
                                     for w in words[:at]) else "python"
        calls.append({"script": f"{path.parent.name}/{path.name}", "entry": entry, "launcher": launcher,
                      "flags": flags})
    return calls


def main(root: str) -> None:
    out = []
    for family in FAMILIES:
        for path in sorted(pathlib.Path(root, "examples", "mcore", family).glob("*.sh")):
            out += script_calls(path)
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
