#!/usr/bin/env python
"""Gated DeltaNet's training cost: our layer (models/gated_deltanet.py, the chunked rule) against
transformers' Qwen3-Next layer (its PyTorch chunked rule, the same weights), and against full
attention of the same width, at growing sequence lengths, in one run.

    python benchmarks/bench_linear_attention.py [--ai-framework pytorch|mindspore] [--lengths 1024,2048,4096]
                                                [--repeats 3]

One layer at a scaled Qwen3-Next shape (hidden 1024; 8 key heads and 16 value heads of 64; a
4-wide convolution; chunks of 64), batch 1, float32; the time of a forward and a backward (the
gradient of the sum of the outputs), best of ``--repeats`` after one warm-up. transformers' row
runs only on PyTorch (its layer is torch). The chunked rule's time grows linearly with the
length; full attention's (8 heads of 128, GQA 2) quadratically.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

HIDDEN = 1024
LINEAR = dict(key_heads=8, value_heads=16, key_dim=64, value_dim=64, conv_kernel=4, chunk_size=64)


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up: allocations, first-call work
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ai-framework", default=os.environ.get("MINDSPEED_AI_FRAMEWORK", "pytorch"))
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ["MINDSPEED_AI_FRAMEWORK"] = args.ai_framework
    from mindspeed_core import autograd, nn, ops, runtime

    runtime.bind()
    from mindspeed_core.models.config import ModelConfig
    from mindspeed_core.models.gated_deltanet import GatedDeltaNet
    from mindspeed_core.models.gpt import SelfAttention

    lengths = [int(n) for n in args.lengths.split(",")]
    cfg = ModelConfig(hidden_size=HIDDEN, num_layers=1, num_attention_heads=8, num_query_groups=2, kv_channels=128,
                      max_position_embeddings=max(lengths), linear_attention=LINEAR, init_method_std=0.02,
                      norm_epsilon=1e-6)  # transformers' rms_norm_eps
    ours, attention = GatedDeltaNet(cfg), SelfAttention(cfg)
    theirs = _transformers_layer(ours) if args.ai_framework == "pytorch" else None

    def ours_step(layer, x, *extra):
        params = nn.parameters(layer)
        return lambda: ops.to_numpy(autograd.value_and_grad(lambda: ops.sum(layer(x, *extra)), params)()[0])

    if theirs is not None:  # the same layer: the same outputs, before anything is timed
        import torch

        x = np.random.default_rng(1).normal(size=(1, lengths[0], HIDDEN)).astype(np.float32)
        with torch.no_grad():
            want = theirs(torch.as_tensor(x)).numpy()
        got = ops.to_numpy(ours(ops.tensor(x)))
        print(f"ours vs transformers on {lengths[0]} tokens: max difference {np.abs(got - want).max():.2e} "
              f"(outputs up to {np.abs(want).max():.2e})")
    print(f"{args.ai_framework}: one layer, hidden {HIDDEN}, batch 1, float32; forward + backward, best of "
          f"{args.repeats} (seconds; tokens/s)")
    header = f"{'tokens':>8}{'ours (chunked)':>22}{'transformers':>22}{'ours / theirs':>15}{'full attention':>22}"
    print(header)
    for n in lengths:
        x = ops.tensor(np.random.default_rng(0).normal(size=(1, n, HIDDEN)).astype(np.float32))
        mine = best_time(ours_step(ours, x), args.repeats)
        cos, sin = (ops.tensor(t) for t in _rope(n, cfg.rotary_dim))
        full = best_time(ours_step(attention, x, cos, sin), args.repeats)
        cell = lambda s: f"{s:8.3f} ({n / s:8,.0f})"  # noqa: E731
        if theirs is not None:
            other = best_time(_theirs_step(theirs, ops.to_numpy(x)), args.repeats)
            print(f"{n:>8}{cell(mine):>22}{cell(other):>22}{other / mine:>14.2f}x{cell(full):>22}")
        else:
            print(f"{n:>8}{cell(mine):>22}{'(torch only)':>22}{'':>15}{cell(full):>22}")


def _rope(n: int, dim: int):
    inv = 1.0 / (10000.0 ** (np.arange(0, dim, 2) / dim))
    angles = np.arange(n)[:, None] * inv[None]
    emb = np.concatenate([angles, angles], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def _transformers_layer(ours):
    """transformers' Qwen3NextGatedDeltaNet holding our layer's weights (in its grouped layout)."""
    import torch
    import transformers as T

    from mindspeed_core import ops as fops
    from mindspeed_core.models.families.qwen3_next import _hf_in_proj

    la = ours.la
    config = T.Qwen3NextConfig(hidden_size=HIDDEN, linear_num_key_heads=la.key_heads,
                               linear_num_value_heads=la.value_heads, linear_key_head_dim=la.key_dim,
                               linear_value_head_dim=la.value_dim, linear_conv_kernel_dim=la.conv_kernel,
                               num_hidden_layers=1, layer_types=["linear_attention"])
    layer = T.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet(config, 0).float()
    qkvz, ba = _hf_in_proj(ours.cfg, fops.to_numpy(ours.in_proj.weight))
    with torch.no_grad():
        for name, value in (("in_proj_qkvz.weight", qkvz), ("in_proj_ba.weight", ba),
                            ("conv1d.weight", fops.to_numpy(ours.conv1d.weight)), ("dt_bias", fops.to_numpy(ours.dt_bias)),
                            ("A_log", fops.to_numpy(ours.A_log)), ("norm.weight", fops.to_numpy(ours.out_norm.weight)),
                            ("out_proj.weight", fops.to_numpy(ours.out_proj.weight))):
            layer.get_parameter(name).copy_(torch.as_tensor(value))
    return layer


def _theirs_step(layer, x: np.ndarray):
    import torch

    inputs = torch.as_tensor(x)

    def step():
        layer.zero_grad()
        layer(inputs).sum().backward()

    return step


if __name__ == "__main__":
    main()
