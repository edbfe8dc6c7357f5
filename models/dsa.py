"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): a lightning indexer chooses, for each query,
the ``topk`` earlier keys the latent attention (models/mla.py) may attend to. Written only
against the facade; the parameter names are MindSpeed-LLM's (``self_attention.dsa_indexer.*``).

The indexer has its own small heads. Its queries come from the attention's normed query latent
(wq_b), its single key from the hidden state (wk, then a LayerNorm), both rotated on their first
qk_rope_head_dim features (halves, DeepSeek-V3.2; pairs, GLM-5); a per-head weight from the
hidden state (weights_proj) mixes the heads:

    I[t, j] = sum_h  w[t, h] / sqrt(heads) * relu(q[t, h] . k[j]) / sqrt(head_dim)

Each query keeps the keys of its ``topk`` highest scores among those it may see (causal, inside
its document; where it may see fewer, those); the attention then masks the others out. On CPU that is a mask on the dense
scores: the memory of ordinary attention (batch x heads x queries x keys scores) plus one
boolean per query and key; the kernels that gather only the chosen keys (MindSpeed's sparse
flash attention and lightning indexer) are matrix rows for the accelerators.

The indexer learns only from its own loss (its inputs are detached, and the choice of keys
carries no gradient): over the chosen keys, KL(p || softmax(I)), p the main attention's
probabilities summed over its heads and normalised, averaged over the queries, times
--indexer-loss-coeff (MindSpeed-LLM's and DeepSeek-V3.2's sparse stage).
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed_core import autograd, composite, features, nn, ops
from mindspeed_core.models.layers import LayerNorm, Linear

TINY = 1e-30  # a probability's floor inside the log: zero where a key is not chosen, never -inf


@dataclass
class Choice:
    """One layer's choice of keys for a forward pass: ``keep`` bool [b or 1, 1, queries, keys],
    what the attention may see."""

    keep: object


def is_indexer(name: str) -> bool:
    """A parameter of an indexer (what the dense warm-up trains alone)."""
    return ".dsa_indexer." in name


class Indexer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dsa, mla, h, std = cfg.dsa, cfg.mla, cfg.hidden_size, cfg.init_method_std
        self.dsa, self.rope_dim = dsa, mla.qk_rope_head_dim
        self.wq_b = Linear(mla.q_lora_rank, dsa.n_heads * dsa.head_dim, False, std)
        self.wk = Linear(h, dsa.head_dim, False, std)
        self.k_norm = LayerNorm(dsa.head_dim, 1e-6)
        self.weights_proj = Linear(h, dsa.n_heads, False, std)

    def _rotate(self, x, cos, sin):
        """RoPE on the first rope_dim features of [b, s, heads, head_dim]."""
        rot, rest = ops.split(x, [self.rope_dim, x.shape[-1] - self.rope_dim], dim=-1)
        if self.dsa.rope_interleave:
            from mindspeed_core.models.mla import deinterleave  # mla builds on this module

            rot = deinterleave(rot)
        return ops.cat([composite.apply_rotary(rot, cos, sin), rest], dim=-1)

    def forward(self, x, q_latent, cos, sin, cache=None, number=None):
        """Index scores [b, s, keys] float32 of the queries ``q_latent`` (the attention's normed
        query latent [b, s, q_lora_rank]) against every key so far; ``x``: the layer's input,
        whole sequences (under tensor parallelism wk and weights_proj gather it)."""
        dsa = self.dsa
        x, q_latent = autograd.detach(x), autograd.detach(q_latent)
        b, s = q_latent.shape[0], q_latent.shape[1]
        q = self._rotate(ops.reshape(self.wq_b(q_latent), (b, s, dsa.n_heads, dsa.head_dim)), cos, sin)
        k = self.k_norm(self.wk(x))
        k = self._rotate(ops.reshape(k, (b, s, 1, dsa.head_dim)), cos, sin)
        if cache is not None:  # the indexer's keys of every token so far
            k = cache.extend_keys(("indexer", number), k)
        sk = k.shape[1]
        dots = ops.matmul(ops.cast(ops.reshape(q, (b, s * dsa.n_heads, dsa.head_dim)), "float32"),
                          ops.cast(ops.transpose(ops.reshape(k, (b, sk, dsa.head_dim)), 1, 2), "float32"))
        dots = ops.relu(ops.reshape(dots, (b, s, dsa.n_heads, sk)) * (dsa.head_dim ** -0.5))
        weights = ops.cast(self.weights_proj(x), "float32") * (dsa.n_heads ** -0.5)
        return ops.sum(dots * ops.unsqueeze(weights, -1), dim=2)


def allowed_keys(sq: int, sk: int, tokens):
    """Bool [1 or b, 1, sq, sk]: the keys each query may see, as the attention's own mask has them
    (causal, bottom-right aligned; inside its document when packed; no left padding)."""
    segments = None
    if tokens is not None and tokens.documents is not None:
        segments = tokens.document_tensor()
        if tokens.cache is not None:
            segments = (segments, tokens.cache.key_documents())
    keep = composite.attention_keep(sq, sk, True, None, segments)
    return keep if len(keep.shape) == 4 else ops.reshape(keep, (1, 1, sq, sk))


def choose(scores, allowed, topk: int):
    """Bool [b, 1, s, keys]: each query's ``topk`` best-scored keys among the allowed ones (all of
    them where it may see fewer), exactly ``topk`` as upstream's indices are: where scores tie at
    the k-th place (a key whose every head's ReLU is zero scores exactly 0), the framework's
    top-k breaks the tie."""
    features.note_used("dsa-indexer")
    shape = (scores.shape[0], 1) + tuple(scores.shape[1:])
    allowed = ops.expand(allowed, shape)
    masked = ops.where(allowed, ops.unsqueeze(scores, 1), float("-inf"))
    k = min(topk, scores.shape[-1])
    picked = ops.topk(masked, k, dim=-1)[1]
    chosen = ops.scatter_add(ops.zeros(shape), -1, picked, ops.ones(tuple(picked.shape)))
    return ops.logical_and(allowed, ops.gt(chosen, 0.0))


def indexer_loss(q, k, scale: float, scores, keep, sum_over_heads):
    """KL(p || softmax(scores)) over the kept keys, averaged over the b x s queries. ``q`` [b, s,
    heads, d] and ``k`` [b, keys, heads, d]: the main attention's (rotated, detached here), scaled
    by ``scale``; p their softmax over the kept keys, summed over the heads (``sum_over_heads``
    completes the sum across tensor-parallel ranks) and normalised; ``scores`` [b, s, keys] the
    indexer's, the only input with a gradient."""
    features.note_used("dsa-indexer-loss")
    q, k = autograd.detach(q), autograd.detach(k)
    b, s, heads, d = q.shape
    logits = ops.matmul(ops.cast(ops.transpose(q, 1, 2), "float32"),
                        ops.cast(ops.transpose(ops.transpose(k, 1, 2), -2, -1), "float32")) * scale
    hidden = composite.MASKED_SCORE
    probs = ops.softmax(ops.where(keep, logits, hidden), dim=-1)  # [b, heads, s, keys]
    p = sum_over_heads(ops.sum(probs, dim=1))  # [b, s, keys]
    kept = ops.squeeze(keep, 1)
    p = ops.where(kept, p, 0.0)
    p = autograd.detach(p / ops.sum(p, dim=-1, keepdim=True))
    log_q = ops.log_softmax(ops.where(kept, scores, hidden), dim=-1)
    terms = p * (ops.log(ops.clamp(p, min=TINY)) - log_q)
    return ops.sum(terms) * (1.0 / (b * s))
