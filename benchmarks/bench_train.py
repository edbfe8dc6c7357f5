#!/usr/bin/env python
"""Training throughput, both frameworks, eager and compiled, against peers, in one run.

    python benchmarks/bench_train.py [--models tiny,medium] [--rounds 3] [--steps 5] [--warmup 2]
                                     [--only ours-pytorch,ours-pytorch-compile,...]

Contenders (each run in its own process, every round, in alternating order):
  cmd-pytorch, cmd-pytorch-compile        `mindspeed train` itself, the command users run, as a
  cmd-mindspore, cmd-mindspore-compile    subprocess on an indexed dataset with --metrics-file and
                                          a log line every step: its own tokens/s of each step
  cmd-pytorch-tp2, cmd-mindspore-tp2,     the same through `mindspeed launch` on two ranks with
  cmd-pytorch-compile-tp2, ...            --tensor-model-parallel-size 2 --sequence-parallel
  ours-pytorch, ours-pytorch-compile      our trainer's step called in-process on PyTorch, eager /
  ours-mindspore, ours-mindspore-compile  --compile (no data loading, logging or metrics); MindSpore
  raw-torch                               the same LLaMA written in plain torch (facade overhead)
  transformers, transformers-compile      LlamaForCausalLM + torch fused AdamW, eager / torch.compile
                                          (--models hybrid: Qwen3NextForCausalLM, the linear-attention
                                          hybrid of the same sizes)

With --baseline DIR, ours-pytorch and ours-mindspore also run from an older version installed
in DIR (`pip install --no-deps --target DIR <checkout>`), as ours-pytorch@baseline and
ours-mindspore@baseline: a before/after in the same run.

A step is forward, backward, gradient clipping and AdamW on one micro-batch. Each process
times its first step (compilation included) apart from the rest, then measures its own
framework's float32 matmul peak (n = 1024) after the timed steps. The table gives the median
over rounds of tokens/s, of MFU (model FLOP/s over that process's own peak), and of the time
to the first step; then the ratios the performance targets are stated in.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = {
    "tiny": dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=704,
                 seq_length=256, micro_batch_size=8, vocab_size=512),
    "medium": dict(num_layers=6, hidden_size=512, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1408,
                   seq_length=256, micro_batch_size=8, vocab_size=8192),
    # Qwen3-Next's layers with a dense MLP: three gated DeltaNet layers (4 key, 8 value heads of 32;
    # chunks of 64) and one gated attention layer (a quarter of each head rotated); transformers'
    # contender is its Qwen3NextForCausalLM of the same sizes (mlp_only_layers: every layer)
    "hybrid": dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=704,
                   seq_length=1024, micro_batch_size=2, vocab_size=512, hybrid=True),
}
HYBRID_FLAGS = ["--spec", "mindspeed_llm.tasks.models.spec.qwen3_next_spec", "layer_spec", "--qk-layernorm",
                "--add-rmsnorm-offset", "--full-attention-interval", "4", "--linear-num-key-heads", "4",
                "--linear-num-value-heads", "8", "--linear-key-head-dim", "32", "--linear-value-head-dim", "32",
                "--mamba-chunk-size", "64", "--partial-rotary-factor", "0.25", "--kv-channels", "32",
                "--max-position-embeddings", "1024"]
CONTENDERS = ("cmd-pytorch", "cmd-pytorch-compile", "cmd-mindspore", "cmd-mindspore-compile", "cmd-pytorch-tp2",
              "cmd-mindspore-compile-tp2", "ours-pytorch",
              "ours-pytorch-compile", "ours-mindspore", "ours-mindspore-compile", "raw-torch", "transformers",
              "transformers-compile")
LR = 1e-4


def model_config(b):
    from mindspeed_core.models.config import ModelConfig

    if b.get("hybrid"):  # the model the flags build (its linear layers' FLOPs differ from attention's)
        from mindspeed_core.compat import megatron_args
        from mindspeed_core.training import configuration

        return configuration.model_only(megatron_args.training_parser().parse_args(_train_flags("-", b, False)))
    return ModelConfig(vocab_size=b["vocab_size"], hidden_size=b["hidden_size"], num_layers=b["num_layers"],
                       num_attention_heads=b["num_attention_heads"], num_query_groups=b["num_query_groups"],
                       ffn_hidden_size=b["ffn_hidden_size"], max_position_embeddings=b["seq_length"],
                       untie_embeddings_and_output_weights=True)


def _timed(step, steps: int, warmup: int) -> dict:
    """First step (compilation included), then warm-up, then the timed steps."""
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return {"seconds_per_step": (time.perf_counter() - start) / steps, "first_step_seconds": first}


# ---- contenders ----------------------------------------------------------------------------

def _dataset(b: dict) -> str:
    """An indexed dataset of random tokens (64 documents of 4096); returns its prefix."""
    import numpy as np

    from mindspeed_core.data import indexed

    prefix = os.path.join(tempfile.mkdtemp(), "random")
    w = indexed.IndexedDatasetWriter(prefix, np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(64):
        w.add_document(rng.integers(0, b["vocab_size"], 4096))
    w.finalize()
    return prefix


def _train_flags(prefix: str, b: dict, compiled: bool) -> list:
    argv = ["--data-path", prefix, "--split", "100,0,0", "--eval-iters", "0", "--num-layers", str(b["num_layers"]),
            "--hidden-size", str(b["hidden_size"]), "--num-attention-heads", str(b["num_attention_heads"]),
            "--num-query-groups", str(b["num_query_groups"]), "--ffn-hidden-size", str(b["ffn_hidden_size"]),
            "--seq-length", str(b["seq_length"]), "--micro-batch-size", str(b["micro_batch_size"]),
            "--train-iters", "1000", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(b["vocab_size"] - 1),
            "--make-vocab-size-divisible-by", "1", "--untie-embeddings-and-output-weights", "--lr", str(LR), "--no-progress", "--weight-decay", "0.01",
            # every fused kernel the device has, as MindSpeed-LLM's scripts do
            "--use-flash-attn", "--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"]
    return argv + (HYBRID_FLAGS if b.get("hybrid") else []) + (["--compile"] if compiled else [])


def worker_ours(framework: str, compiled: bool, b: dict, steps: int, warmup: int) -> dict:
    from mindspeed_core import runtime

    runtime.bind(framework)
    from mindspeed_core import device
    from mindspeed_core.compat import megatron_args
    from mindspeed_core.training.trainer import Trainer

    args = megatron_args.training_parser().parse_args(_train_flags(_dataset(b), b, compiled))
    with open(os.devnull, "w") as null:
        trainer = Trainer(args, out=null)
        trainer.build()
        it = iter(range(10 ** 6))
        result = _timed(lambda: trainer.train_step(next(it)), steps, warmup)
    return result | {"peak_flops": device.matmul_rate(n=1024, min_seconds=1.0)}


def worker_command(framework: str, compiled: bool, b: dict, steps: int, warmup: int, tp: int = 1) -> dict:
    """`mindspeed train` as users run it (its output to a file, as a terminal or a job log would
    take it); a step's time from its own record's tokens/s (the wall time since the previous
    log line: data, step, metrics and logging), over the timed steps after the first and the
    warm-up."""
    from mindspeed_core import runtime

    folder = tempfile.mkdtemp()
    prefix, metrics = _dataset(b), os.path.join(folder, "metrics.jsonl")
    total = 1 + warmup + steps
    argv = [*_train_flags(prefix, b, compiled), "--train-iters", str(total), "--log-interval", "1",
            "--metrics-file", metrics, "--sample-tokens", "0"]
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_AI_FRAMEWORK"}
    verb = ["train"]
    if tp > 1:  # one micro-batch a step as on one rank (data-parallel size 1)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        verb = ["launch", "--nproc-per-node", str(tp), "--master-port", str(port), "--log-dir",
                os.path.join(folder, "logs"), "--"]
        argv += ["--tensor-model-parallel-size", str(tp), "--sequence-parallel"]
    started = time.perf_counter()
    with open(os.path.join(folder, "out.txt"), "w") as out:
        done = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", *verb, "--ai-framework", framework, *argv],
                              stdout=out, stderr=subprocess.STDOUT, env=env, timeout=3600, cwd=folder)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"mindspeed train failed: see {folder}/out.txt")
    records = [r for r in map(json.loads, open(metrics)) if "tokens_per_s" in r]
    tokens = b["micro_batch_size"] * b["seq_length"]
    timed = [tokens / r["tokens_per_s"] for r in records[1 + warmup:]]
    runtime.bind(framework)
    from mindspeed_core import device

    return {"seconds_per_step": statistics.mean(timed), "first_step_seconds": tokens / records[0]["tokens_per_s"],
            "command_seconds": wall, "peak_flops": device.matmul_rate(n=1024, min_seconds=1.0)}


def _torch_peak() -> float:
    from mindspeed_core import runtime

    runtime.bind("pytorch")
    from mindspeed_core import device

    return device.matmul_rate(n=1024, min_seconds=1.0)


def _torch_step(model, params, ids, vocab):
    import torch

    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True)

    def step():
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step


def worker_transformers(compiled: bool, b: dict, steps: int, warmup: int) -> dict:
    import torch
    import transformers as T

    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    sizes = dict(vocab_size=b["vocab_size"], hidden_size=b["hidden_size"], intermediate_size=b["ffn_hidden_size"],
                 num_hidden_layers=b["num_layers"], num_attention_heads=b["num_attention_heads"],
                 num_key_value_heads=b["num_query_groups"], max_position_embeddings=b["seq_length"],
                 tie_word_embeddings=False)
    if b.get("hybrid"):  # torch's chunked gated delta rule (no flash-linear-attention kernels on CPU)
        config = T.Qwen3NextConfig(**sizes, head_dim=b["hidden_size"] // b["num_attention_heads"],
                                   linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
                                   linear_value_head_dim=32, partial_rotary_factor=0.25,
                                   mlp_only_layers=list(range(b["num_layers"])))
        hf = T.Qwen3NextForCausalLM(config).float().train()
    else:
        hf = T.LlamaForCausalLM(T.LlamaConfig(**sizes)).float().train()

    def forward(x):
        return hf(input_ids=x).logits

    model = torch.compile(forward) if compiled else forward
    ids = torch.randint(0, b["vocab_size"], (b["micro_batch_size"], b["seq_length"] + 1))
    result = _timed(_torch_step(model, list(hf.parameters()), ids, b["vocab_size"]), steps, warmup)
    return result | {"peak_flops": _torch_peak()}


def worker_raw_torch(b: dict, steps: int, warmup: int) -> dict:
    """The model our GPTModel builds (fused qkv in Megatron's per-group layout, RoPE, GQA,
    RMSNorm, SwiGLU, untied output), written directly in torch: what the facade costs."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    h, heads, groups, ffn = b["hidden_size"], b["num_attention_heads"], b["num_query_groups"], b["ffn_hidden_size"]
    d, per = h // heads, heads // groups

    def lin(n_out, n_in):
        return torch.nn.Parameter(torch.randn(n_out, n_in) * 0.02)

    layers = [dict(n1=torch.nn.Parameter(torch.ones(h)), qkv=lin(groups * (per + 2) * d, h), proj=lin(h, h),
                   n2=torch.nn.Parameter(torch.ones(h)), fc1=lin(2 * ffn, h), fc2=lin(h, ffn))
              for _ in range(b["num_layers"])]
    emb, final, out = lin(b["vocab_size"], h), torch.nn.Parameter(torch.ones(h)), lin(b["vocab_size"], h)
    s = b["seq_length"]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.outer(torch.arange(s).float(), inv)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[None, :, None], torch.cat([angles.sin()] * 2, -1)[None, :, None]

    def rope(x):
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def model(ids):
        x = F.embedding(ids, emb)
        bsz = ids.shape[0]
        for p in layers:
            y = F.rms_norm(x, (h,), p["n1"], 1e-5)
            q, k, v = F.linear(y, p["qkv"]).view(bsz, s, groups, per + 2, d).split([per, 1, 1], dim=3)
            q, k, v = rope(q.reshape(bsz, s, heads, d)), rope(k.squeeze(3)), v.squeeze(3)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).reshape(bsz, s, h), p["proj"])
            gate, up = F.linear(F.rms_norm(x, (h,), p["n2"], 1e-5), p["fc1"]).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, p["fc2"])
        return F.linear(F.rms_norm(x, (h,), final, 1e-5), out)

    params = [emb, final, out] + [t for p in layers for t in p.values()]
    ids = torch.randint(0, b["vocab_size"], (b["micro_batch_size"], s + 1))
    result = _timed(_torch_step(model, params, ids, b["vocab_size"]), steps, warmup)
    return result | {"peak_flops": _torch_peak()}


def worker(name: str, b: dict, steps: int, warmup: int) -> dict:
    if name.startswith("cmd-"):
        tp = 2 if name.endswith("-tp2") else 1
        return worker_command(name.split("-")[1], "-compile" in name, b, steps, warmup, tp)
    if name.startswith("ours-"):
        return worker_ours(name.split("-")[1], name.endswith("-compile"), b, steps, warmup)
    if name.startswith("transformers"):
        return worker_transformers(name.endswith("-compile"), b, steps, warmup)
    return worker_raw_torch(b, steps, warmup)


# ---- the run -------------------------------------------------------------------------------

def run(name: str, model: str, steps: int, warmup: int, baseline: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop("MINDSPEED_AI_FRAMEWORK", None)
    if name.endswith("@baseline"):
        env["PYTHONPATH"] = baseline
        name = name[: -len("@baseline")]
    out = subprocess.run([sys.executable, __file__, "--worker", name, "--models", model, "--steps", str(steps),
                          "--warmup", str(warmup)], capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode:
        raise SystemExit(f"{name} on {model} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,medium")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", default=",".join(CONTENDERS))
    parser.add_argument("--baseline", default=None, metavar="DIR")
    parser.add_argument("--worker", default=None)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, MODELS[args.models], args.steps, args.warmup)))
        return 0
    names = args.only.split(",")
    if args.baseline:
        names += [f"{n}@baseline" for n in ("ours-pytorch", "ours-mindspore") if n in names]
    for model in args.models.split(","):
        b = MODELS[model]
        cfg = model_config(b)
        tokens = b["micro_batch_size"] * b["seq_length"]
        flops_per_token = cfg.flops_per_token(b["seq_length"])
        print(f"\n{model} model: {json.dumps(b)}; {cfg.num_parameters() / 1e6:.1f}M parameters; "
              f"{flops_per_token / 1e6:.1f} MFLOP per token (fwd+bwd); median of {args.rounds} rounds, "
              f"{args.steps} timed steps after {args.warmup} warm-up", flush=True)
        runs = {n: [] for n in names}
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]  # alternate, so drift hits every contender
            for name in order:
                runs[name].append(run(name, model, args.steps, args.warmup, args.baseline))
        print("| contender | tokens/s | MFU (own peak) | own matmul peak GFLOP/s | first step s |")
        print("|---|---|---|---|---|")
        table = {}
        for name in names:
            tps = [tokens / x["seconds_per_step"] for x in runs[name]]
            mfu = [t * flops_per_token / x["peak_flops"] for t, x in zip(tps, runs[name])]
            row = {"tokens_per_s": statistics.median(tps), "mfu": statistics.median(mfu),
                   "peak": statistics.median(x["peak_flops"] for x in runs[name]),
                   "first": statistics.median(x["first_step_seconds"] for x in runs[name])}
            table[name] = row
            label = f"{name} (in-process)" if name.startswith("ours-") else name
            print(f"| {label} | {row['tokens_per_s']:,.0f} | {100 * row['mfu']:.1f}% | {row['peak'] / 1e9:.0f} | "
                  f"{row['first']:.1f} |", flush=True)
        ratios = [("cmd-pytorch", "ours-pytorch"), ("cmd-pytorch-compile", "ours-pytorch-compile"),
                  ("cmd-mindspore", "ours-mindspore"), ("cmd-mindspore-compile", "ours-mindspore-compile"),
                  ("cmd-mindspore", "cmd-pytorch"), ("cmd-mindspore-compile", "cmd-pytorch"),
                  ("cmd-pytorch-compile", "transformers-compile"), ("cmd-mindspore-compile-tp2", "cmd-pytorch-tp2"),
                  ("cmd-mindspore-tp2", "cmd-pytorch-tp2"), ("cmd-pytorch-compile-tp2", "cmd-pytorch-tp2"),
                  ("ours-pytorch-compile", "ours-pytorch"), ("ours-pytorch", "transformers"),
                  ("ours-pytorch-compile", "transformers-compile"), ("ours-pytorch", "raw-torch"),
                  ("ours-mindspore-compile", "ours-mindspore"), ("ours-mindspore", "ours-pytorch"),
                  ("ours-mindspore", "ours-mindspore@baseline"), ("ours-pytorch", "ours-pytorch@baseline")]
        for a, c in ratios:
            if a in table and c in table:
                print(f"{a} / {c}: {table[a]['tokens_per_s'] / table[c]['tokens_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
