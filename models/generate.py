"""Text generation from a trained model (sampling, no KV cache yet: each step reruns the
window; inference with a cache arrives with the inference issue)."""

from __future__ import annotations

import numpy as np

from mindspeed_core import autograd, ops


def generate(model, prompt_ids, max_new_tokens: int, window: int, temperature: float = 0.8, top_k: int = 20,
             seed: int = 0) -> list[int]:
    """Sample max_new_tokens continuation ids (top-k, temperature; greedy at temperature 0)."""
    rng = np.random.default_rng(seed)
    ids = list(prompt_ids) or [0]
    out = []
    with autograd.no_grad():
        for _ in range(max_new_tokens):
            context = ops.tensor(np.asarray([ids[-window:]], np.int64))
            logits = ops.to_numpy(model(context))[0, -1].astype(np.float64)
            if temperature <= 0:
                nxt = int(np.argmax(logits))
            else:
                top = np.argsort(-logits)[:top_k]
                p = np.exp((logits[top] - logits[top].max()) / temperature)
                nxt = int(rng.choice(top, p=p / p.sum()))
            ids.append(nxt)
            out.append(nxt)
    return out
