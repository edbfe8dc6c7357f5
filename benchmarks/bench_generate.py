#!/usr/bin/env python
"""Generation speed, both frameworks, against transformers' generate, in one run.

    python benchmarks/bench_generate.py [--rounds 3] [--batch 4] [--prompt 128] [--new 64]
                                        [--only ours-pytorch,ours-mindspore,transformers]

Contenders (each in its own process, every round, in alternating order), on the same tiny
LLaMA (random weights, greedy, no stop token so every row draws --new tokens):
  ours-pytorch, ours-mindspore   models/generate.py with the key/value cache
  ours-pytorch-flash             the same with the fused attention kernel (--use-flash-attn: torch's
                                 scaled_dot_product_attention, which transformers' LLaMA uses by default)
  ours-pytorch-no-cache          the same, every step rerunning the whole sequence
  ours-mindspore-eager-decode    MindSpore without the compiled decode step (models/compiled_decode.py)
  transformers                   LlamaForCausalLM.generate (its dynamic cache), torch eager

Time to first token is the prefill (the prompts' forward pass and the first draw); prefill
tokens/s counts the prompt tokens over it; decode tokens/s counts the tokens drawn after the
first over the rest. Each contender first runs the same generation once (warm-up: kernels, the
allocator, and MindSpore's decode step for this batch and cache capacity, compiled and checked
against eager once); the warm-up's seconds are shown. The table gives the median over rounds,
then ratios to transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=704,
             vocab_size=512, max_position_embeddings=512)
CONTENDERS = ("ours-pytorch", "ours-pytorch-flash", "ours-pytorch-no-cache", "ours-mindspore", "ours-mindspore-eager-decode",
              "transformers")


def _prompts(batch: int, length: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(1, MODEL["vocab_size"], length)] for _ in range(batch)]


def _ours(framework: str, prompts, new: int, use_cache: bool, compiled: bool,
          flash: bool = False) -> tuple[float, float, float]:
    from mindspeed_core import runtime

    runtime.bind(framework)
    from mindspeed_core import nn, random
    from mindspeed_core.models import generate as gen
    from mindspeed_core.models.config import ModelConfig
    from mindspeed_core.models.gpt import GPTModel

    random.seed(1)
    model = GPTModel(ModelConfig(**MODEL, fused=("attention",) if flash else ()))
    nn.set_training(model, False)
    start = time.perf_counter()
    # MindSpore: compiled=True compiles the decode step at once (by default a bucket compiles after
    # compiled_decode.MIN_STEPS eager steps); on PyTorch it changes nothing (the matrix: planned)
    gen.generate(model, prompts, new, use_cache=use_cache, compiled=compiled)  # warm-up (see the docstring)
    warm = time.perf_counter() - start
    first = []
    start = time.perf_counter()
    out = gen.generate(model, prompts, new, use_cache=use_cache, compiled=compiled,
                       on_step=lambda tokens: first.append(time.perf_counter()) if not first else None)
    end = time.perf_counter()
    assert all(len(o) == new for o in out)
    return warm, first[0] - start, end - first[0]


def _transformers(prompts, new: int) -> tuple[float, float]:
    import torch
    import transformers

    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=MODEL["vocab_size"], hidden_size=MODEL["hidden_size"],
                                   intermediate_size=MODEL["ffn_hidden_size"], num_hidden_layers=MODEL["num_layers"],
                                   num_attention_heads=MODEL["num_attention_heads"],
                                   num_key_value_heads=MODEL["num_query_groups"],
                                   max_position_embeddings=MODEL["max_position_embeddings"])
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.tensor(prompts)

    class Clock(transformers.generation.streamers.BaseStreamer):
        def __init__(self):
            self.calls = []

        def put(self, value):  # first the prompts, then each step's tokens
            self.calls.append(time.perf_counter())

        def end(self):
            pass

    options = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **options)
        warm = time.perf_counter() - start
        clock = Clock()
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, streamer=clock, **options)
        end = time.perf_counter()
    assert out.shape[1] == ids.shape[1] + new
    return warm, clock.calls[1] - start, end - clock.calls[1]


def worker(name: str, batch: int, length: int, new: int) -> dict:
    prompts = _prompts(batch, length)
    if name == "transformers":
        warm, prefill, decode = _transformers(prompts, new)
    else:
        warm, prefill, decode = _ours(name.split("-")[1], prompts, new, not name.endswith("no-cache"),
                                      not name.endswith("eager-decode"), name.endswith("-flash"))
    return {"warm_s": warm, "ttft_ms": 1e3 * prefill, "prefill_tok_s": batch * length / prefill,
            "decode_tok_s": batch * (new - 1) / decode}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--only", default=",".join(CONTENDERS))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.batch, args.prompt, args.new)))
        return
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(CONTENDERS)
    if unknown:
        sys.exit(f"unknown contenders {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            done = subprocess.run([sys.executable, __file__, "--worker", name, "--batch", str(args.batch), "--prompt",
                                   str(args.prompt), "--new", str(args.new)], capture_output=True, text=True, env=env)
            if done.returncode:
                sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"tiny LLaMA ({MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, vocab {MODEL['vocab_size']}), "
          f"batch {args.batch}, prompts of {args.prompt} tokens, {args.new} new tokens, greedy; median of "
          f"{args.rounds} rounds")
    table = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    print(f"{'contender':<30}{'warm-up s':>10}{'first token ms':>16}{'prefill tok/s':>16}{'decode tok/s':>15}")
    for n, t in table.items():
        print(f"{n:<30}{t['warm_s']:>10.2f}{t['ttft_ms']:>16.1f}{t['prefill_tok_s']:>16.0f}{t['decode_tok_s']:>15.1f}")
    if "transformers" in table:
        ref = table["transformers"]
        print("ratios to transformers (prefill tok/s, decode tok/s; above 1 is faster):")
        for n, t in table.items():
            if n != "transformers":
                print(f"  {n:<28} prefill {t['prefill_tok_s'] / ref['prefill_tok_s']:.2f}x   "
                      f"decode {t['decode_tok_s'] / ref['decode_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
