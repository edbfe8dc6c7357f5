#!/usr/bin/env python
"""MindSpeed-LLM entry point: evaluate a trained model (same flags as `mindspeed evaluate`).

    python tools/evaluation.py --load ckpt --task mmlu --task-data-path mmlu/data --shot 5
"""

import sys

from mindspeed_core import runtime
from mindspeed_core.cli import main

if __name__ == "__main__":
    runtime.exit_process(main(["evaluate", *sys.argv[1:]]))
