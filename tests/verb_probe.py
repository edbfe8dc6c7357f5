"""Run one command as a user would, then record which frameworks the process imported.

    python verb_probe.py REPORT -m mindspeed_core.cli train ...
    python verb_probe.py REPORT tools/pretrain_gpt.py ...

At exit, REPORT receives the sorted list of frameworks (torch, mindspore) in sys.modules as
JSON: test_verbs.py checks that a verb run with --ai-framework X imported X and nothing else.
"""

import atexit
import json
import runpy
import sys


def _report(path: str) -> None:
    with open(path, "w") as fh:
        json.dump(sorted(name for name in ("torch", "mindspore") if name in sys.modules), fh)


if __name__ == "__main__":
    report, target, *rest = sys.argv[1:]
    atexit.register(_report, report)
    if target == "-m":
        module, *rest = rest
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *rest]
        runpy.run_path(target, run_name="__main__")
