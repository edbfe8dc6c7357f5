#!/usr/bin/env python
"""MindSpeed-LLM entry point: text -> Megatron indexed dataset (same flags as `mindspeed preprocess`)."""

import sys

from mindspeed_core import runtime
from mindspeed_core.cli import main

if __name__ == "__main__":
    runtime.exit_process(main(["preprocess", *sys.argv[1:]]))
