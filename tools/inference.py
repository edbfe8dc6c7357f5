#!/usr/bin/env python
"""MindSpeed-LLM entry point: generate with a trained model (same flags as `mindspeed generate`).

    python tools/inference.py --load ckpt --prompt "def " --task greedy --max-new-tokens 64
"""

import sys

from mindspeed_core import runtime
from mindspeed_core.cli import main

if __name__ == "__main__":
    runtime.exit_process(main(["generate", *sys.argv[1:]]))
