#!/usr/bin/env python
"""MindSpeed-LLM entry point: fine-tune or align a GPT model (same flags as `mindspeed train`;
--stage sft, dpo, simpo, orm / rm or prm).

    python tools/posttrain_gpt.py --stage sft --data-path finetune/alpaca --load ckpt --finetune ...
    python tools/posttrain_gpt.py --stage dpo --data-path prefs/pairs --load sft-ckpt --finetune --dpo-beta 0.1 ...
"""

import sys

from mindspeed_core import runtime
from mindspeed_core.cli import main

if __name__ == "__main__":
    runtime.exit_process(main(["train", *sys.argv[1:]]))
