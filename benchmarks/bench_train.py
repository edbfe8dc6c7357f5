#!/usr/bin/env python
"""Training throughput: our trainer on PyTorch and on MindSpore, against Hugging Face
transformers' LlamaForCausalLM with torch's AdamW, on one bench configuration.

Each contender runs in its own process; all figures come from this one run:

    python benchmarks/bench_train.py [--steps 20] [--warmup 5] [--only pytorch,mindspore,transformers]

Prints tokens/s, TFLOP/s, and MFU against each framework's own measured float32 matmul
rate (n=1024), then the ratio ours / transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BENCH = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=704,
             seq_length=256, micro_batch_size=8, vocab_size=512)


def _cfg():
    from mindspeed_core.models.config import ModelConfig

    b = BENCH
    return ModelConfig(vocab_size=b["vocab_size"], hidden_size=b["hidden_size"], num_layers=b["num_layers"],
                       num_attention_heads=b["num_attention_heads"], num_query_groups=b["num_query_groups"],
                       ffn_hidden_size=b["ffn_hidden_size"], max_position_embeddings=b["seq_length"])


def worker_ours(framework: str, steps: int, warmup: int) -> dict:
    import numpy as np

    from mindspeed_core import runtime

    runtime.bind(framework)
    from mindspeed_core import cli, device
    from mindspeed_core.data import indexed

    b = BENCH
    tmp = tempfile.mkdtemp()
    prefix = os.path.join(tmp, "random")
    w = indexed.IndexedDatasetWriter(prefix, np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(64):
        w.add_document(rng.integers(0, 256, 4096))
    w.finalize()
    metrics = os.path.join(tmp, "m.jsonl")
    argv = ["train", "--ai-framework", framework, "--data-path", prefix, "--split", "100,0,0", "--eval-iters", "0",
            "--num-layers", str(b["num_layers"]), "--hidden-size", str(b["hidden_size"]),
            "--num-attention-heads", str(b["num_attention_heads"]), "--num-query-groups", str(b["num_query_groups"]),
            "--ffn-hidden-size", str(b["ffn_hidden_size"]), "--seq-length", str(b["seq_length"]),
            "--micro-batch-size", str(b["micro_batch_size"]), "--train-iters", str(warmup + steps),
            "--log-interval", str(warmup), "--make-vocab-size-divisible-by", str(b["vocab_size"]),
            "--lr", "1e-4", "--no-progress", "--metrics-file", metrics,
            # every fused kernel the device has, as MindSpeed-LLM's scripts do
            "--use-flash-attn", "--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"]
    if steps % warmup:
        raise SystemExit("--steps must be a multiple of --warmup (the log windows)")
    with open(os.devnull, "w") as null:
        stdout, sys.stdout = sys.stdout, null
        try:
            code = cli.main(argv)
        finally:
            sys.stdout = stdout
    if code:
        raise SystemExit(f"training failed with exit code {code}")
    windows = [json.loads(line) for line in open(metrics)][1:]  # the first window is warm-up
    tps = sum(r["tokens_per_s"] for r in windows) / len(windows)
    return {"tokens_per_s": tps, "peak_flops": device.matmul_rate(n=1024, min_seconds=1.0)}


def worker_transformers(steps: int, warmup: int) -> dict:
    import torch
    import transformers as T

    from mindspeed_core import runtime

    runtime.bind("pytorch")
    from mindspeed_core import device

    b = BENCH
    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=b["vocab_size"], hidden_size=b["hidden_size"], intermediate_size=b["ffn_hidden_size"],
                           num_hidden_layers=b["num_layers"], num_attention_heads=b["num_attention_heads"],
                           num_key_value_heads=b["num_query_groups"], max_position_embeddings=b["seq_length"])
    model = T.LlamaForCausalLM(config).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    ids = torch.randint(0, 256, (b["micro_batch_size"], b["seq_length"] + 1))

    def step():
        logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, b["vocab_size"]), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": steps * b["micro_batch_size"] * b["seq_length"] / elapsed,
            "peak_flops": device.matmul_rate(n=1024, min_seconds=1.0)}


def run(name: str, steps: int, warmup: int) -> dict:
    env = dict(os.environ)
    env.pop("MINDSPEED_AI_FRAMEWORK", None)
    out = subprocess.run([sys.executable, __file__, "--worker", name, "--steps", str(steps), "--warmup", str(warmup)],
                         capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--only", default="pytorch,mindspore,transformers")
    parser.add_argument("--worker", default=None)
    args = parser.parse_args()
    if args.worker:
        result = (worker_transformers(args.steps, args.warmup) if args.worker == "transformers"
                  else worker_ours(args.worker, args.steps, args.warmup))
        print(json.dumps(result))
        return 0
    flops_per_token = _cfg().flops_per_token(BENCH["seq_length"])
    print(f"bench model: {json.dumps(BENCH)}; {_cfg().num_parameters() / 1e6:.2f}M parameters; "
          f"{flops_per_token / 1e6:.1f} MFLOP per token (fwd+bwd); {args.steps} timed steps after {args.warmup} warm-up")
    results = {}
    for name in args.only.split(","):
        r = run(name, args.steps, args.warmup)
        r["tflops"] = r["tokens_per_s"] * flops_per_token / 1e12
        r["mfu"] = r["tokens_per_s"] * flops_per_token / r["peak_flops"]
        results[name] = r
        label = {"pytorch": "ours, pytorch", "mindspore": "ours, mindspore", "transformers": "transformers + torch AdamW"}[name]
        print(f"{label:28s} tokens/s {r['tokens_per_s']:9.0f} | TFLOP/s {r['tflops']:.3f} | "
              f"peak {r['peak_flops'] / 1e9:6.1f} GFLOP/s | MFU {100 * r['mfu']:5.1f}%")
    if "transformers" in results:
        for name in ("pytorch", "mindspore"):
            if name in results:
                print(f"ratio ours ({name}) / transformers tokens/s: "
                      f"{results[name]['tokens_per_s'] / results['transformers']['tokens_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
