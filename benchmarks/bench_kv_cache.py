#!/usr/bin/env python
"""What generation's key/value cache holds per token: multi-latent attention against grouped-query
and multi-head attention of the same width, measured on the cache after a prefill.

    python benchmarks/bench_kv_cache.py [--ai-framework pytorch|mindspore] [--prompt 32]

One layer of each, at DeepSeek-V2-Lite's attention shape (hidden 2048, 16 heads; MLA: a
512-wide latent and a 64-wide rotated key, heads of 128 + 64 for queries and keys, values of
128), against the same 16 heads of 192 with 4 key/value groups (GQA) and with 16 (MHA), and a
gated DeltaNet layer at Qwen3-Next's shape (16 key heads and 32 value heads of 128, a 4-wide
convolution), whose state does not grow with the sequence: its convolution history and its
delta-rule state, the same after any prompt. The cache is read after the prompt's forward pass
(models/kv_cache.py), so the figures are what the run allocated, not a formula.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

SHAPE = dict(vocab_size=256, hidden_size=2048, num_layers=1, num_attention_heads=16, ffn_hidden_size=256,
             max_position_embeddings=256)
CONTENDERS = {
    "MLA (DeepSeek-V2-Lite)": dict(mla=dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                            v_head_dim=128), qk_layernorm=True),
    "GQA, 4 groups": dict(num_query_groups=4, kv_channels=192),
    "MHA": dict(num_query_groups=16, kv_channels=192),
    "gated DeltaNet (Qwen3-Next)": dict(linear_attention=dict(key_heads=16, value_heads=32, key_dim=128,
                                                              value_dim=128)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ai-framework", default=os.environ.get("MINDSPEED_AI_FRAMEWORK", "pytorch"))
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--long", type=int, default=4096, help="the length of the last column (from the measured numbers)")
    args = p.parse_args()
    os.environ["MINDSPEED_AI_FRAMEWORK"] = args.ai_framework
    from mindspeed_core import autograd, ops, runtime

    runtime.bind()
    from mindspeed_core.models import registry
    from mindspeed_core.models.config import ModelConfig
    from mindspeed_core.models.gpt import Tokens
    from mindspeed_core.models.kv_cache import KVCache

    print(f"{args.ai_framework}: one layer, hidden {SHAPE['hidden_size']}, {SHAPE['num_attention_heads']} heads; "
          f"cache after a {args.prompt}-token prefill; bytes as bfloat16 would hold them")
    print(f"{'attention':<28}{'numbers / token / layer':>25}{'fixed numbers / layer':>23}{'bytes at the prompt (bf16)':>28}"
          f"{'vs MHA':>8}{f'bytes at {args.long:,} tokens':>24}{'vs MHA':>8}")
    rows = {}
    for name, extra in CONTENDERS.items():
        cfg = ModelConfig(**SHAPE, **extra)
        model = registry.for_config(cfg).build(cfg)
        cache = KVCache(1, args.prompt)
        documents = np.ones((1, args.prompt), np.int64)
        cache.begin(documents)
        ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (1, args.prompt))
        with autograd.no_grad():
            model(ops.tensor(ids), Tokens(positions=np.arange(args.prompt)[None], documents=documents, cache=cache))
        cache.end()
        rows[name] = (cache.values_per_token() // cfg.num_layers, cache.fixed_values() // cfg.num_layers)
    for name, (per_token, fixed) in rows.items():
        at = [per_token * n + fixed for n in (args.prompt, args.long)]
        mha = [rows["MHA"][0] * n for n in (args.prompt, args.long)]
        print(f"{name:<28}{per_token:>25,}{fixed:>23,}{2 * at[0]:>28,}{at[0] / mha[0]:>8.3f}{2 * at[1]:>24,}"
              f"{at[1] / mha[1]:>8.3f}")


if __name__ == "__main__":
    main()
