#!/usr/bin/env python
"""Megatron / MindSpeed-LLM entry point: pre-train a GPT model (same flags as `mindspeed train`).

    python tools/pretrain_gpt.py --ai-framework mindspore --data-path corpus_text_document ...
"""

import sys

from mindspeed_core import runtime
from mindspeed_core.cli import main

if __name__ == "__main__":
    runtime.exit_process(main(["train", *sys.argv[1:]]))
