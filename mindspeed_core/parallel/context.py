"""Context parallelism: each sequence split over the CP ranks, attention computed across them.

Layout (Megatron's causal load balance): a sequence of S tokens is cut into 2C chunks and CP
rank r holds chunks r and 2C-1-r, so under a causal mask every rank has the same work. The
data loader hands each rank those columns (``local_columns``); everything outside attention
is per token and runs unchanged on them.

Attention (``--context-parallel-algo``):

    megatron_cp_algo  ring attention: key/value blocks travel around the CP group (dist.shift,
                      point-to-point on torch); each rank attends its queries to each block as
                      it passes, and the partial results are merged exactly through their
                      log-sum-exp. Blocks a query chunk cannot see are skipped.
    ulysses_cp_algo   an all-to-all turns "my tokens, every head" into "every token, my C-th
                      of the heads"; ordinary attention over the whole sequence; all-to-all back.
    hybrid_cp_algo    Ulysses inside groups of --ulysses-degree-in-cp consecutive CP ranks,
                      the ring across those groups.

Masks come from each token's column in the whole sequence and its document (packed
sequences), known on every rank from the micro-batch, so one code path serves causal
attention, packed documents and any chunk order. Autograd differentiates through the
collectives (their backward is the reverse movement) and the merge.
"""

from __future__ import annotations

import numpy as np

from mindspeed_core import composite, dist, features, ops
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models.gpt import PLAIN, Seams
from mindspeed_core.models.layers import repeat_heads
from mindspeed_core.parallel import mappings

ALGORITHMS = ("megatron_cp_algo", "ulysses_cp_algo", "hybrid_cp_algo")
FEATURE = {"megatron_cp_algo": "ring-attention-cp", "ulysses_cp_algo": "ulysses-cp", "hybrid_cp_algo": "hybrid-cp"}


def ulysses_degree(cp: int, algo: str, degree_in_cp: int | None) -> int:
    """How many CP ranks share one sequence by all-to-all (the rest form the ring)."""
    if algo == "ulysses_cp_algo":
        return cp
    if algo == "megatron_cp_algo":
        return 1
    return degree_in_cp or 1


def check_layout(cfg, cp: int, algo: str, degree_in_cp: int | None, tp: int, seq_length: int,
                 sequence_parallel: bool) -> None:
    """Refuse a context-parallel layout the model or sequence cannot be cut by, before any
    rank starts."""
    if cp == 1:
        return
    if cfg.linear_attention is not None:
        raise MindSpeedError(f"context parallel size {cp}: the gated DeltaNet layers of this model carry their state "
                             "along the whole sequence and are not split by context parallelism yet (the matrix's "
                             "linear-attention-context-parallel (planned) row)")
    if cfg.dsa is not None:
        raise MindSpeedError(f"context parallel size {cp}: sparse attention's indexer scores every earlier key of the "
                             "whole sequence and is not split by context parallelism yet (the matrix's "
                             "dsa-context-parallel (planned) row); use --sequence-parallel with tensor parallelism")
    if algo not in ALGORITHMS:
        raise MindSpeedError(f"--context-parallel-algo {algo!r}: choose one of {', '.join(ALGORITHMS)}")
    u = ulysses_degree(cp, algo, degree_in_cp)
    if algo == "hybrid_cp_algo" and (degree_in_cp is None or degree_in_cp < 1 or cp % degree_in_cp):
        raise MindSpeedError(f"--context-parallel-algo hybrid_cp_algo needs --ulysses-degree-in-cp dividing "
                             f"--context-parallel-size {cp} (got {degree_in_cp})")
    if u > 1:
        groups = max(cfg.num_query_groups // tp, 1)
        heads = cfg.num_attention_heads // tp
        if heads % u or (groups % u and u % groups):
            raise MindSpeedError(f"Ulysses over {u} ranks splits the attention heads: it must divide the query heads "
                                 f"({heads}) and divide, or be a multiple of, the key/value heads ({groups}) each "
                                 f"tensor-parallel rank holds; choose a smaller --ulysses-degree-in-cp or hybrid_cp_algo")
    multiple = 2 * cp * (tp if sequence_parallel else 1)
    if seq_length % multiple:
        raise MindSpeedError(f"--seq-length {seq_length} must be a multiple of {multiple}: context parallelism cuts "
                             f"it into 2 x {cp} chunks" + (f", each split again over {tp} sequence-parallel ranks"
                                                         if sequence_parallel and tp > 1 else ""))


def local_columns(seq_len: int, cp: int, cp_rank: int) -> np.ndarray:
    """The columns of the whole sequence that CP rank ``cp_rank`` holds: chunks r and 2C-1-r."""
    chunk = seq_len // (2 * cp)
    first, second = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return np.concatenate([np.arange(first, first + chunk), np.arange(second, second + chunk)])


def _runs(columns: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) index ranges of ``columns`` (sorted) over which the columns are consecutive."""
    breaks = np.flatnonzero(np.diff(columns) != 1) + 1
    edges = [0, *breaks.tolist(), len(columns)]
    return list(zip(edges[:-1], edges[1:]))


def _merge(out, lse, o, l):
    """Two partial attentions of the same queries over disjoint keys -> their union's."""
    if out is None:
        return ops.cast(o, "float32"), l
    total = ops.logsumexp(ops.stack([lse, l]), dim=0)
    w1, w2 = ops.exp(lse - total), ops.exp(l - total)
    return out * ops.unsqueeze(w1, -1) + ops.cast(o, "float32") * ops.unsqueeze(w2, -1), total


def _block_mask(q_cols, k_cols, q_docs, k_docs, window=None):
    """(skip, causal, mask) for queries at ``q_cols`` against keys at ``k_cols`` (each a run of
    consecutive columns); documents [b, n] or None; a sliding window or None."""
    if q_docs is None and window is None:
        if k_cols[0] > q_cols[-1]:
            return True, False, None  # every key is after every query
        if k_cols[-1] <= q_cols[0]:
            return False, False, None  # every key is visible
        if k_cols[0] == q_cols[0] and len(k_cols) == len(q_cols):
            return False, True, None
    keep = (k_cols[None, :] <= q_cols[:, None])[None]
    if window is not None:  # the columns are the positions: the window counts them
        keep = keep & (k_cols[None, :] > q_cols[:, None] - window)[None]
    if q_docs is not None:
        keep = keep & (q_docs[:, :, None] == k_docs[:, None, :])
    if not keep.any():
        return True, False, None
    return False, False, ops.tensor(keep[:, None])


def ring_attention(q, k, v, q_cols, kv_cols, documents, group, attention, dropout_p: float = 0.0,
                   gather: bool = False, scores=PLAIN, overlap: bool = False):
    """Queries [b, sq, h, d] at whole-sequence columns ``q_cols`` (sorted) against every ring
    member's keys/values; ``kv_cols[j]``: the columns ring rank j holds (sorted, this rank's
    k, v among them). ``documents`` [b, S] or None. ``attention``: the facade's attention.
    ``scores``: the layer's scale, soft-capping (per score, so blocks merge exactly) and window.
    ``gather``: take every member's block by one all-gather instead of n - 1 ring steps (what
    emulated point-to-point makes cheaper; same blocks, same merge, same result).
    ``overlap`` (--use-cp-send-recv-overlap): each exchange starts before the attention of the
    block at hand and is waited for after it (the gather before this rank's own block), so the
    transfer travels while the block computes; the same blocks in the same order, the same bits.
    Backward's exchanges run as without it."""
    n = len(kv_cols)
    me = dist.rank(group)
    kv = mine = ops.cat([k, v], dim=-1)  # one message per step
    d = k.shape[-1]
    q_runs = _runs(q_cols)
    acc = [(None, None) for _ in q_runs]
    # Every rank must take part in every step's backward (a collective), also where it skipped
    # all of a block: a zero-weighted use of each received block keeps it in the graph.
    anchor = None
    arriving = everyone = None
    if gather and overlap:
        arriving = mappings.start_gather_ring(mine, group, dim=1)
    elif gather:
        everyone = mappings.gather_ring(mine, group, dim=1)  # [b, n x s, h, 2d], ring-rank order
        anchor = ops.sum(everyone) * 0.0
    for step in range(n):
        src = (me - step) % n
        if step and gather:
            if everyone is None:
                everyone = arriving.wait()
                anchor = ops.sum(everyone) * 0.0
            kv = everyone[:, src * mine.shape[1] : (src + 1) * mine.shape[1]]
        elif step:
            kv = arriving.wait() if overlap else mappings.shift_ring(kv, group)
            touch = ops.sum(kv) * 0.0
            anchor = touch if anchor is None else anchor + touch
        if overlap and not gather and step + 1 < n:
            arriving = mappings.start_shift_ring(kv, group)
        cols = kv_cols[src]
        kb, vb = ops.split(kv, [d, kv.shape[-1] - d], dim=-1)
        for i, (qa, qb) in enumerate(q_runs):
            for ka, kb_end in _runs(cols):
                qc, kc = q_cols[qa:qb], cols[ka:kb_end]
                docs = (None, None) if documents is None else (documents[:, qc], documents[:, kc])
                skip, causal, mask = _block_mask(qc, kc, *docs, scores.window)
                if skip:
                    continue
                o, l = attention(q[:, qa:qb], kb[:, ka:kb_end], vb[:, ka:kb_end], causal=causal, mask=mask,
                                 dropout_p=dropout_p, return_lse=True, scale=scores.scale, softcap=scores.softcap)
                acc[i] = _merge(*acc[i], o, l)
    out = ops.cat([ops.cast(o, ops.dtype_of(q)) for o, _ in acc], dim=1)
    return out if anchor is None else out + ops.cast(anchor, ops.dtype_of(out))


def _copied_heads(x, u: int):
    """Key/value heads x [b, s, G, d] for Ulysses over ``u`` ranks: as they are when G divides
    among them, else each head copied u / G times side by side (MindSpeed-LLM's copies), so that
    rank j's one head is the one its query heads share; the copies' gradients sum back."""
    g = x.shape[2]
    if g % u == 0:
        return x
    features.note_used("ulysses-kv-copies")
    return repeat_heads(x, u // g)


class ContextParallelSeams(Seams):
    """The model's seams under context parallelism, around those of tensor (and sequence)
    parallelism (``inner``): attention across the CP ranks, and the columns each holds."""

    def __init__(self, inner: Seams, ps, algo: str, degree_in_cp: int | None, overlap: bool = False):
        self.inner, self.algo, self.overlap = inner, algo, overlap
        self.cp, self.cp_rank = ps.cp, ps.local_rank("cp")
        self.context_shards = ps.cp
        self.sequence_shards = inner.sequence_shards
        self.u = ulysses_degree(ps.cp, algo, degree_in_cp)
        self.ring_size = ps.cp // self.u
        self.ulysses_group = (ps.group("cp") if self.u == ps.cp else ps.subgroup("cp", self.u)) if self.u > 1 else None
        self.ring_group = (ps.group("cp") if self.u == 1 else ps.subgroup("cp", self.u, strided=True)
                           if self.ring_size > 1 else None)
        # where the ring step is emulated (MindSpore's CPU runtime) one all-gather of the
        # key/value blocks moves n times fewer bytes in one call instead of n - 1
        self.ring_by_gather = dist.implementations().get("shift") == "emulated"

    # what tensor/sequence parallelism decides stays theirs
    def heads(self, cfg):
        return self.inner.heads(cfg)

    def sum_over_heads(self, x):
        return self.inner.sum_over_heads(x)

    def attention_rng(self):
        return self.inner.attention_rng()

    def hidden_rng(self):
        return self.inner.hidden_rng()

    def decoder_input(self, x):
        return self.inner.decoder_input(x)

    def output_input(self, x):
        return self.inner.output_input(x)

    def gather_logits(self, logits):
        return self.inner.gather_logits(logits)

    def token_losses(self, logits, labels):
        return self.inner.token_losses(logits, labels)

    # context parallelism's own
    def local_tokens(self, whole):
        return whole[:, local_columns(whole.shape[1], self.cp, self.cp_rank)]

    def _columns(self, seq_len: int, cp_ranks) -> np.ndarray:
        return np.sort(np.concatenate([local_columns(seq_len, self.cp, r) for r in cp_ranks]))

    def attention(self, q, k, v, dropout_p, fused, tokens, scores=PLAIN, return_lse=False, keep=None):
        if return_lse or keep is not None:  # the matrix refuses these combinations before a model is built
            raise MindSpeedError("attention sinks and sparse attention under context parallelism are not built")
        features.note_used(FEATURE[self.algo])
        attention = ops.attention if fused else composite.attention
        u, seq_len = self.u, q.shape[1] * self.cp
        first = self.cp_rank // u * u  # the first CP rank of this rank's Ulysses group
        mine = local_columns(seq_len, self.cp, self.cp_rank)
        if u > 1:  # every token of the Ulysses group, this rank's u-th of the heads
            k, v = (_copied_heads(t, u) for t in (k, v))
            q, k, v = (mappings.sequence_to_heads(t, self.ulysses_group) for t in (q, k, v))
            mine = np.concatenate([local_columns(seq_len, self.cp, r) for r in range(first, first + u)])
        order = np.argsort(mine, kind="stable")  # sorted columns: chunks become consecutive runs
        if u > 1 or not np.array_equal(order, np.arange(len(order))):
            index = ops.tensor(order.astype(np.int64))
            q, k, v = (ops.index_select(t, 1, index) for t in (q, k, v))
        documents = None if tokens is None else tokens.documents
        if self.ring_size == 1:  # Ulysses alone: the whole sequence, in order
            segments = None if documents is None else tokens.document_tensor()
            out = attention(q, k, v, causal=True, dropout_p=dropout_p, segment_ids=segments, **scores.arguments())
        else:  # ring rank j holds the columns of Ulysses group j
            kv_cols = [self._columns(seq_len, range(j * u, j * u + u)) for j in range(self.ring_size)]
            out = ring_attention(q, k, v, kv_cols[first // u], kv_cols, documents, self.ring_group, attention,
                                 dropout_p, gather=self.ring_by_gather, scores=scores, overlap=self.overlap)
        if u > 1 or not np.array_equal(order, np.arange(len(order))):
            out = ops.index_select(out, 1, ops.tensor(np.argsort(order, kind="stable").astype(np.int64)))
        if u > 1:
            out = mappings.heads_to_sequence(out, self.ulysses_group)
        return out
