#!/usr/bin/env python
"""MindSpeed-LLM entry point: fine-tune a GPT model (same flags as `mindspeed train`; --stage sft).

    python tools/posttrain_gpt.py --stage sft --data-path finetune/alpaca --load ckpt --finetune ...
"""

import sys

from mindspeed_core.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
