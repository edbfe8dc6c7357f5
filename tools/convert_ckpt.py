#!/usr/bin/env python
"""MindSpeed-LLM entry point: Hugging Face <-> Megatron-core checkpoints (same flags as `mindspeed convert`).

    python tools/convert_ckpt.py --load-model-type hf --save-model-type mg --model-type-hf llama2 \
        --load-dir llama-hf/ --save-dir llama-mg/ --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
"""

import sys

from mindspeed_core import runtime
from mindspeed_core.cli import main

if __name__ == "__main__":
    runtime.exit_process(main(["convert", *sys.argv[1:]]))
