#!/usr/bin/env python
"""What one kernel costs inside a compiled graph, and what that makes the floor of a decode step.

    python benchmarks/bench_kernel_floor.py [--repeats 50]

The decode step of bench_generate.py's tiny LLaMA is a few hundred small kernels on tensors of
a few thousand numbers, so its time is set by each kernel's fixed cost, not by arithmetic. This
measures that cost on the shapes of a decode step, each framework in its own process:

  - a chain of N element-wise operations on a [4, 256] tensor (a decode step's hidden states),
    run as one compiled graph (facade ``autograd.compiled``: trace capture on MindSpore,
    torch.compile on PyTorch) and eagerly, for two lengths N; the difference over the
    difference in N is the cost of one kernel, with the launch's fixed cost taken out;
  - the number of operators one eager decode step dispatches (PyTorch's dispatcher, counted
    with a TorchDispatchMode over models/generate.py's step; the model code is the same on
    both frameworks, so the count stands for both);
  - the product of the two: the step time the kernels' fixed cost alone accounts for;
  - the time of a decode step's 17 matmuls on their own shapes, compiled and eager.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHORT, LONG = 16, 256  # chain lengths
SHAPE = (4, 256)


def _time(fn, x, repeats: int) -> float:
    from mindspeed_core import ops

    ops.to_numpy(fn(x))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ops.to_numpy(fn(x))  # to the host: the work has finished
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _chain(n: int, weight=None):
    from mindspeed_core import ops

    def run(x):
        for i in range(n):  # element-wise: alternate, so no two neighbours fold into one
            x = ops.matmul(x, weight) if weight is not None else x * 1.0001 if i % 2 else x + 0.001
        return x
    return run


def _decode_operators() -> int:
    """Operators one eager decode step of bench_generate's model dispatches (PyTorch)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, os.path.dirname(__file__))
    from bench_generate import MODEL, _prompts

    from mindspeed_core import nn, random
    from mindspeed_core.models import generate as gen
    from mindspeed_core.models.config import ModelConfig
    from mindspeed_core.models.gpt import GPTModel

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    random.seed(1)
    model = GPTModel(ModelConfig(**MODEL))
    nn.set_training(model, False)
    steps = gen._Steps(model, _prompts(4, 128), 8, True, 0, None, False)
    steps.logits()  # the prefill
    steps.append([1, 2, 3, 4])
    with torch.no_grad(), Count():
        steps.logits()
    return Count.calls


def worker(framework: str, repeats: int) -> dict:
    from mindspeed_core import runtime

    runtime.bind(framework)
    import numpy as np

    from mindspeed_core import autograd, nn, ops

    rng = np.random.default_rng(0)
    x = ops.tensor(rng.standard_normal(SHAPE).astype(np.float32))
    # orthogonal: the chain's values neither grow nor vanish
    weight = ops.tensor(np.linalg.qr(rng.standard_normal((SHAPE[1], SHAPE[1])))[0].astype(np.float32))
    out = {}
    for kind, w in (("elementwise", None), ("matmul", weight)):
        for mode in ("compiled", "eager"):
            t = {}
            for n in (SHORT, LONG):
                fn = autograd.compiled(_chain(n, w), [], nn.ModuleList()) if mode == "compiled" else _chain(n, w)
                t[n] = _time(fn, x, repeats)
            per = out[f"{kind}_{mode}_us_per_kernel"] = 1e6 * (t[LONG] - t[SHORT]) / (LONG - SHORT)
            out[f"{kind}_{mode}_launch_us"] = 1e6 * t[SHORT] - SHORT * per
    out.update(_decode_matmuls(repeats))
    if framework == "pytorch":
        out["decode_operators"] = _decode_operators()
    return out


def _decode_matmuls(repeats: int) -> dict:
    """Milliseconds of the 17 matmuls of one decode step of bench_generate's model (per layer
    the fused qkv, the attention's output, the MLP's two; then the output layer), [4, k] by
    [k, n]: the difference between graphs holding 5 sets of them and one, over 4; eager likewise."""
    sys.path.insert(0, os.path.dirname(__file__))
    import numpy as np
    from bench_generate import MODEL

    from mindspeed_core import autograd, nn, ops

    h, f, v = MODEL["hidden_size"], MODEL["ffn_hidden_size"], MODEL["vocab_size"]
    kv = h // MODEL["num_attention_heads"] * MODEL["num_query_groups"]
    shapes = [(h, h + 2 * kv), (h, h), (h, 2 * f), (f, h)] * MODEL["num_layers"] + [(h, v)]
    rng = np.random.default_rng(0)
    # a set of weights per repetition: a graph compiler would compute a repeated product once
    sets = [[ops.tensor(rng.standard_normal(s).astype(np.float32) * 0.05) for s in shapes] for _ in range(5)]
    inputs = {k: ops.tensor(rng.standard_normal((4, k)).astype(np.float32)) for k in {s[0] for s in shapes}}

    def products(times: int):
        def run(x):
            outs = [ops.matmul(inputs[w.shape[0]] if w.shape[0] != x.shape[1] else x, w)
                    for weights in sets[:times] for w in weights]
            return ops.cat([ops.reshape(o, (-1,)) for o in outs], dim=0)
        return run

    out, x = {}, inputs[h]
    for mode in ("compiled", "eager"):
        t = {n: _time(autograd.compiled(products(n), [], nn.ModuleList()) if mode == "compiled" else products(n), x,
                      repeats) for n in (1, 5)}
        out[f"decode_matmuls_{mode}_ms"] = 1e3 * (t[5] - t[1]) / 4
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.repeats)))
        return
    results = {}
    for framework in ("pytorch", "mindspore"):
        done = subprocess.run([sys.executable, __file__, "--worker", framework, "--repeats", str(args.repeats)],
                              capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{framework} failed:\n{done.stderr[-3000:]}")
        results[framework] = json.loads(done.stdout.strip().splitlines()[-1])
    ops_per_step = results["pytorch"]["decode_operators"]
    print(f"chains of {SHORT} and {LONG} kernels on a {list(SHAPE)} float32 tensor (element-wise, or a matmul "
          f"by a {SHAPE[1]}x{SHAPE[1]} weight), median of {args.repeats} calls")
    print(f"{'framework':<12}{'kernel':<13}{'mode':<10}{'us per kernel':>15}{'launch us':>11}"
          f"{f'x {ops_per_step} ops = ms':>22}")
    for framework, r in results.items():
        for kind in ("elementwise", "matmul"):
            for mode in ("compiled", "eager"):
                per = r[f"{kind}_{mode}_us_per_kernel"]
                floor = f"{per * ops_per_step / 1e3:.2f}" if kind == "elementwise" else ""
                print(f"{framework:<12}{kind:<13}{mode:<10}{per:>15.1f}{r[f'{kind}_{mode}_launch_us']:>11.0f}{floor:>22}")
    print(f"one eager decode step of bench_generate's model dispatches {ops_per_step} operators (PyTorch)")
    print("the 17 matmuls of one decode step ([4, k] x [k, n], its shapes), ms:")
    for framework, r in results.items():
        print(f"  {framework:<12} compiled {r['decode_matmuls_compiled_ms']:.2f}   eager {r['decode_matmuls_eager_ms']:.2f}")


if __name__ == "__main__":
    main()
