"""A stand-in for a language model whose answers a test writes: at a position it puts the
first byte of ``answer(text so far)`` first (logit 10, every other token 0; byte-level
tokens, 256 the end of document, which an empty answer picks), so generation and scoring can
be checked against known outputs. At the last position only, unless ``every_position``. It
reads whole sequences: generate with use_cache=False."""

from __future__ import annotations

import numpy as np

from mindspeed_core import ops
from mindspeed_core.models.gpt import SINGLE_DEVICE


class ScriptedModel:
    sequence_multiple = 1
    seams = SINGLE_DEVICE
    LOGIT = 10.0

    def __init__(self, answer, every_position: bool = False, vocab_size: int = 257):
        self.answer, self.every_position, self.vocab_size = answer, every_position, vocab_size
        self.seen: list[str] = []  # each text it was asked to continue (at the last position)

    def __call__(self, ids, tokens=None):
        ids = ops.to_numpy(ids)
        logits = np.zeros((*ids.shape, self.vocab_size), np.float32)
        for row in range(ids.shape[0]):
            for t in range(ids.shape[1]) if self.every_position else [ids.shape[1] - 1]:
                text = bytes(int(i) for i in ids[row, :t + 1] if 0 < int(i) < 256).decode("utf-8", errors="replace")
                if t == ids.shape[1] - 1:
                    self.seen.append(text)
                upcoming = self.answer(text).encode("utf-8")
                logits[row, t, upcoming[0] if upcoming else 256] = self.LOGIT
        return ops.tensor(logits)

    def gather_logits(self, logits):
        return logits
