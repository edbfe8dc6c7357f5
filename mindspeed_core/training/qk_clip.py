"""--qk-clip (MuonClip, as Kimi-K2 describes it and megatron-core builds it) and
--log-max-attention-logit.

Each training forward of an attention layer notes the largest scaled logit q.k of every query
head over the causal pairs (models/gpt.py SelfAttention._note_max_logits); after the step's
update the maximum over the step's micro-batches and the data-parallel ranks is taken per query
group. Where a group's maximum S passed --qk-clip-threshold t, its query rows of linear_qkv are
scaled by eta^alpha and its key rows by eta^(1 - alpha), eta = t / S (--qk-clip-alpha, default
0.5): their products, the logits, shrink by eta, so that the group's largest logit on the same
tokens would be t. The scaling goes through the optimizer, into the fp32 master where there is
one. The step's largest logit (before clipping) and the heads clipped are logged.
"""

from __future__ import annotations

import numpy as np

from mindspeed_core import dist, features, ops
from mindspeed_core.models.gpt import SelfAttention


def attentions(chunks) -> list:
    """The softmax attention layers of this rank's model chunks (MTP's too)."""
    return [attention for chunk in chunks for _, layer in chunk.transformer_layers()
            for _, attention in layer.attentions() if isinstance(attention, SelfAttention)]


def track(chunks) -> None:
    for attention in attentions(chunks):
        attention.track_logits = True


def row_factors(cfg, eta: np.ndarray, per_group: int, alpha: float) -> np.ndarray:
    """linear_qkv's row factors for each local query group's eta (``per_group`` query heads each):
    its query rows eta^alpha, its key rows eta^(1 - alpha), its value (and output gate) rows 1."""
    d = cfg.kv_channels
    q, gate = per_group * d, per_group * d if cfg.attention_output_gate else 0
    rows = []
    for e in eta:
        rows += [np.full(q, e ** alpha), np.ones(gate), np.full(d, e ** (1.0 - alpha)), np.ones(d)]
    return np.concatenate(rows).astype(np.float32)


class QKClip:
    """``threshold`` and ``alpha``: --qk-clip's; ``clip`` False: --log-max-attention-logit only."""

    def __init__(self, threshold: float, alpha: float, clip: bool):
        self.threshold, self.alpha, self.clip = threshold, alpha, clip

    def after_step(self, chunks, optimizer, ps) -> dict:
        """Clip (with ``clip``) after the optimizer's update; {"max_attention_logit": the step's largest
        logit on this pipeline stage's layers, "qk_clipped_heads": query heads whose weights shrank}."""
        largest, clipped = float("-inf"), 0
        group = ps.group("dp_cp") if ps is not None and ps.size("dp_cp") > 1 else None
        for attention in attentions(chunks):
            if attention.max_logits is None:  # it ran no training forward this step
                continue
            found = ops.to_numpy(dist.all_reduce(ops.tensor(attention.max_logits.astype(np.float32)), op="max",
                                                 group=group))
            attention.max_logits = None
            largest = max(largest, float(found.max()))
            per_group = attention.cfg.num_attention_heads // attention.cfg.num_query_groups
            by_group = found.reshape(-1, per_group).max(axis=1)  # this rank's query groups
            if not self.clip or not (by_group > self.threshold).any():
                continue
            features.note_used("qk-clip")
            eta = np.minimum(1.0, self.threshold / by_group)
            optimizer.scale_rows(attention.linear_qkv.weight, row_factors(attention.cfg, eta, per_group, self.alpha))
            clipped += int((by_group > self.threshold).sum()) * per_group
        return {"max_attention_logit": largest, "qk_clipped_heads": clipped}
