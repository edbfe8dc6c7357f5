#!/usr/bin/env python
"""What generation's key/value cache holds per token: multi-latent attention against grouped-query
and multi-head attention of the same width, measured on the cache after a prefill.

    python benchmarks/bench_kv_cache.py [--ai-framework pytorch|mindspore] [--prompt 32]

One layer of each, at DeepSeek-V2-Lite's attention shape (hidden 2048, 16 heads; MLA: a
512-wide latent and a 64-wide rotated key, heads of 128 + 64 for queries and keys, values of
128), against the same 16 heads of 192 with 4 key/value groups (GQA) and with 16 (MHA). The
cache is read after the prompt's forward pass (models/kv_cache.py: the numbers it keeps per
position), so the figures are what the run allocated, not a formula.
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
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ai-framework", default=os.environ.get("MINDSPEED_AI_FRAMEWORK", "pytorch"))
    p.add_argument("--prompt", type=int, default=32)
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
    print(f"{'attention':<26}{'numbers / token / layer':>26}{'bytes (bf16)':>14}{'vs MHA':>9}")
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
        rows[name] = cache.values_per_token() // cfg.num_layers
    for name, numbers in rows.items():
        print(f"{name:<26}{numbers:>26,}{2 * numbers:>14,}{numbers / rows['MHA']:>9.3f}")


if __name__ == "__main__":
    main()
