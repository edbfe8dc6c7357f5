"""Text generation from a trained model (sampling, no KV cache yet: each step reruns the
window; inference with a cache arrives with the inference issue)."""

from __future__ import annotations

import numpy as np

from mindspeed_core import autograd, ops


def generate(model, prompt_ids, max_new_tokens: int, window: int, temperature: float = 0.8, top_k: int = 20,
             seed: int = 0, stop_ids=()) -> list[int]:
    """Sample up to max_new_tokens continuation ids (top-k, temperature; greedy at temperature
    0), ending before the first of ``stop_ids`` drawn (the end of document).

    Under tensor parallelism every rank of the group must call it (the logits are gathered);
    all ranks draw the same tokens from the same seed."""
    rng = np.random.default_rng(seed)
    ids = list(prompt_ids) or [0]
    out = []
    with autograd.no_grad():
        for _ in range(max_new_tokens):
            tokens = ids[-window:]
            # sequence parallelism cuts the sequence into equal slices: pad on the right
            # (causal attention keeps the real positions unaffected) and read the last real one
            multiple = getattr(model, "sequence_multiple", 1)
            padded = tokens + [0] * (-len(tokens) % multiple)
            context = ops.tensor(np.asarray([padded], np.int64))
            logits = ops.to_numpy(model.gather_logits(model(context)))[0, len(tokens) - 1].astype(np.float64)
            if temperature <= 0:
                nxt = int(np.argmax(logits))
            else:
                top = np.argsort(-logits)[:top_k]
                p = np.exp((logits[top] - logits[top].max()) / temperature)
                nxt = int(rng.choice(top, p=p / p.sum()))
            if nxt in stop_ids:
                break
            ids.append(nxt)
            out.append(nxt)
    return out
