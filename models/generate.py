"""Text generation: greedy decoding, sampling (temperature, top-k, top-p) and beam search (with
sampling too), for a batch of prompts of different lengths (padded on the left), with the
key/value cache (models/kv_cache.py) unless told otherwise: the prompts are run once
(prefill), then each step runs the new tokens only (decode).

Under tensor and pipeline parallelism every rank of the model calls these with the same
arguments: the logits are gathered whole on every rank (a pipeline's last stage sends them to
the others) and the draws come from the same seeded host generator, so all ranks pick the same
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mindspeed_core import autograd, features, ops
from mindspeed_core.models import compiled_decode, rope
from mindspeed_core.models.gpt import Tokens
from mindspeed_core.models.kv_cache import KVCache


@dataclass
class Sampling:
    """How the next token is chosen: the most likely one (greedy), or drawn from the
    distribution at ``temperature``, cut to the ``top_k`` most likely tokens (0: all) and then
    to the smallest set whose probability reaches ``top_p`` (1: all)."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"sampling needs a positive temperature, got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"top_k must be >= 0 and top_p in (0, 1], got {self.top_k} and {self.top_p}")


def choose(logits: np.ndarray, sampling: Sampling, rng) -> list[int]:
    """One token per row of ``logits`` [rows, vocab]; ``rng``: a numpy Generator, or one per row."""
    logits = np.asarray(logits, np.float64)
    if sampling.greedy:
        return [int(i) for i in np.argmax(logits, axis=-1)]
    picks = []
    for i, row in enumerate(logits):
        p = _distribution(row, sampling)
        picks.append(int((rng[i] if isinstance(rng, list) else rng).choice(p.size, p=p)))
    return picks


def _distribution(row: np.ndarray, sampling: Sampling, keep: int = 1) -> np.ndarray:
    """The probabilities a sampled draw uses: ``row`` (logits or log-probabilities) at the
    temperature, cut to top_k, then to top_p, each keeping at least ``keep`` tokens."""
    row = row / sampling.temperature
    top_k = max(sampling.top_k, keep) if sampling.top_k else 0
    if top_k and top_k < row.size:
        row = np.where(row < np.sort(row)[-top_k], -np.inf, row)
    p = np.exp(row - row.max())
    p /= p.sum()
    if sampling.top_p < 1:
        order = np.argsort(-p, kind="stable")
        # the most likely tokens until their probability reaches top_p (at least one)
        chosen = order[:max(int(np.searchsorted(np.cumsum(p[order]), sampling.top_p)) + 1, keep)]
        kept = np.zeros_like(p)
        kept[chosen] = p[chosen]
        p = kept / kept.sum()
    return p


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


class _Steps:
    """The forward passes of one generation: the prompts first, then each step's new tokens
    (with the cache) or the whole sequences again (without it: only their last ``window``
    tokens if given, counted from position 0, so a sample may run past the model's
    positions); last-position logits."""

    def __init__(self, model, prompts: list[list[int]], room: int, use_cache: bool, pad_id: int = 0,
                 window: int | None = None, compiled: bool | None = None):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("an empty prompt: give each prompt at least one token")
        self.multiple = getattr(model, "sequence_multiple", 1)  # sequence parallelism cuts equal slices
        if use_cache and self.multiple != 1:
            raise ValueError("the key/value cache needs whole sequences: generate without sequence parallelism")
        width = max(len(p) for p in prompts)
        self.ids = np.full((len(prompts), width), pad_id, np.int64)
        self.documents = np.zeros((len(prompts), width), np.int64)  # 1 a token, 0 padding
        for i, p in enumerate(prompts):
            self.ids[i, width - len(p):] = p
            self.documents[i, width - len(p):] = 1
        self.positions = np.maximum(np.cumsum(self.documents, axis=1) - 1, 0)
        self.model, self.pad_id, self.window = model, pad_id, window
        # compiled: None lets a bucket compile once it has been used enough (compiled_decode.MIN_STEPS)
        self.compiled = use_cache and compiled is not False and compiled_decode.eligible(model)
        self.compile_now = compiled is True
        if self.compiled:  # a capacity shared by prompts of similar lengths, so they share a graph
            room = compiled_decode.capacity(width + room) - width
        self.cache = KVCache(len(prompts), width + room) if use_cache else None
        self.fresh = width  # positions not yet run through the model

    def logits(self) -> np.ndarray:
        """[rows, vocab] float64 logits of each row's next token."""
        pad = 0
        if self.cache is not None:
            features.note_used("kv-cache")
            window = slice(self.ids.shape[1] - self.fresh, None)
            self.cache.begin(self.documents[:, window])
            ids, tokens = self.ids[:, window], Tokens(positions=self.positions[:, window],
                                                      documents=self.documents[:, window], cache=self.cache)
        else:
            ids, documents, positions = self.ids, self.documents, self.positions
            if self.window and ids.shape[1] > self.window:
                ids, documents = ids[:, -self.window:], documents[:, -self.window:]
                positions = np.maximum(np.cumsum(documents, axis=1) - 1, 0)
            pad = -ids.shape[1] % self.multiple  # on the right: causal attention keeps it out of sight
            ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=self.pad_id)
            padded = not documents.all()
            documents = np.pad(documents, ((0, 0), (0, pad)))
            positions = np.pad(positions, ((0, 0), (0, pad)), mode="edge")
            tokens = Tokens(positions=positions, documents=documents) if padded else None

        def eager():
            with autograd.no_grad():
                out = self.model.gather_logits(self.model(ops.tensor(ids), tokens))
                return ops.to_numpy(ops.cast(out[:, ids.shape[1] - 1 - pad], "float32"))

        if self.compiled and self.cache.length and self.fresh == 1:  # a decode step (after the prefill)
            last = compiled_decode.step(self.model, self.cache, ids, tokens, eager, self.compile_now)
        else:
            last = eager()
        if self.cache is not None:
            self.cache.end()
        self.fresh = 0
        return last.astype(np.float64)

    def append(self, tokens: list[int]) -> None:
        rows = len(tokens)
        self.ids = np.concatenate([self.ids, np.asarray(tokens, np.int64).reshape(rows, 1)], axis=1)
        self.documents = np.concatenate([self.documents, np.ones((rows, 1), np.int64)], axis=1)
        self.positions = np.concatenate([self.positions, self.positions[:, -1:] + 1], axis=1)
        self.fresh = 1
        cfg = getattr(self.model, "cfg", None)
        switch = rope.switch_length(cfg.rope_scaling) if cfg is not None else None
        if self.cache is not None and switch is not None and self.ids.shape[1] == switch + 1:
            # LongRoPE: from here on every position takes the long factors, so the keys cached
            # with the short ones are computed again, all positions at once (as transformers
            # does for Phi-3: dropping its cache at the switch)
            self.cache = KVCache(self.cache.batch, self.cache.capacity)
            self.fresh = self.ids.shape[1]

    def keep(self, rows: list[int]) -> None:
        """Continue with these rows (beam search: each beam from its parent)."""
        self.ids, self.documents, self.positions = self.ids[rows], self.documents[rows], self.positions[rows]
        if self.cache is not None:
            self.cache.reorder(rows)


def next_token_logits(model, prompts: list[list[int]], pad_id: int = 0) -> np.ndarray:
    """[rows, vocab] float64 logits of the token after each prompt (one batched pass, the
    prompts padded on the left)."""
    return _Steps(model, prompts, 0, False, pad_id).logits()


def generate(model, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling | None = None,
             stop_ids=(), use_cache: bool = True, on_step=None, pad_id: int = 0,
             window: int | None = None, compiled: bool | None = None, row_seeds=None,
             on_logits=None) -> list[list[int]]:
    """Each prompt's continuation (ids, without the prompt): up to ``max_new_tokens``, ending
    before the first of ``stop_ids``. ``on_step(tokens)`` is called after each step with each
    row's new token, None for a row that has ended (streaming); when it returns True the
    generation ends there (a chat's stop text). ``window`` (without the cache): the model sees
    the last ``window`` tokens only (the training run's text sample). ``compiled``: decode
    steps as one graph (models/compiled_decode.py) at once (True), never (False), or once the
    batch and cache size have been used enough (None), where the matrix has compiled-decode.
    ``row_seeds``: each row's draws from a generator of its own (seeded by that entry, which
    may be a list of ints), so a row draws the same tokens in whatever batch it runs.
    ``on_logits(logits)``: each step's last-position logits [rows, vocab] (host), before the draw."""
    sampling = sampling or Sampling()
    features.note_used("greedy-generation" if sampling.greedy else "sampling-generation")
    rng = np.random.default_rng(sampling.seed) if row_seeds is None else [np.random.default_rng(s) for s in row_seeds]
    steps = _Steps(model, prompts, max_new_tokens, use_cache, pad_id, window, compiled)
    out, done = [[] for _ in prompts], [False] * len(prompts)
    for _ in range(max_new_tokens):
        logits = steps.logits()
        if on_logits is not None:
            on_logits(logits)
        picks = choose(logits, sampling, rng)
        new = []
        for i, token in enumerate(picks):
            if not done[i] and token in stop_ids:
                done[i] = True
            new.append(None if done[i] else token)
            if not done[i]:
                out[i].append(token)
        if on_step is not None and on_step(new):
            break
        if all(done):
            break
        steps.append([pad_id if t is None else t for t in new])  # an ended row runs on, unread
    return out


def beam_search(model, prompt: list[int], max_new_tokens: int, num_beams: int, stop_ids=(),
                length_penalty: float = 1.0, use_cache: bool = True, pad_id: int = 0,
                sampling: Sampling | None = None) -> list[int]:
    """The continuation with the best score, log-probability / (tokens drawn) ** length_penalty,
    over ``num_beams`` beams. A beam that draws a stop token ends there (the stop token counts
    as drawn, and is not returned); the search ends when no open beam can beat the worst of
    ``num_beams`` ended ones, or after max_new_tokens.

    With a ``sampling`` that is not greedy (beam search with sampling, as transformers'
    ``generate(num_beams=..., do_sample=True)`` draws): each beam's log-probabilities are taken
    to the temperature and cut to top_k / top_p (keeping, with several beams, at least one token
    more than there are stop tokens, and at least 2, as transformers does), its score added, and
    the 2 x num_beams candidates are drawn without replacement from the softmax over every
    beam's tokens at once (seeded by sampling.seed), then ranked by score as the search's are.
    The scores are the sums of those tempered log-probabilities."""
    if num_beams < 1:
        raise ValueError(f"num_beams must be positive, got {num_beams}")
    sampled = sampling is not None and not sampling.greedy
    features.note_used("beam-search")
    rng = np.random.default_rng(sampling.seed) if sampled else None
    steps = _Steps(model, [list(prompt)], max_new_tokens, use_cache, pad_id)
    scores = np.zeros(1)  # the open beams' log-probabilities
    sequences: list[list[int]] = [[]]
    ended: list[tuple[float, list[int]]] = []

    def score(logp: float, drawn: int) -> float:
        return float(logp) / drawn ** length_penalty

    for step in range(max_new_tokens):
        logp = log_softmax(steps.logits())  # [beams, vocab]
        if sampled:
            # each beam's own cut; the tokens it drops cannot be drawn
            keep = max(2, len(stop_ids) + 1) if num_beams > 1 else 1
            allowed = np.stack([_distribution(row, sampling, keep) > 0 for row in logp])
            logp = np.where(allowed, logp / sampling.temperature, -np.inf) + scores[:, None]
            q = np.exp(logp.ravel() - logp.max())
            q /= q.sum()
            drawn = rng.choice(q.size, min(2 * num_beams, int(np.count_nonzero(q))), replace=False, p=q)
            order = drawn[np.argsort(-logp.ravel()[drawn], kind="stable")]
        else:
            logp = logp + scores[:, None]
            order = np.argsort(-logp, axis=None, kind="stable")[:2 * num_beams]
        parents, chosen, kept = [], [], []
        for rank, flat in enumerate(order):
            beam, token = divmod(int(flat), logp.shape[1])
            if token in stop_ids:
                if rank < num_beams:  # only a candidate among the best num_beams may end
                    ended.append((score(logp[beam, token], step + 1), sequences[beam]))
                continue
            parents.append(beam)
            chosen.append(token)
            kept.append(logp[beam, token])
            if len(parents) == num_beams:
                break
        ended = sorted(ended, key=lambda e: -e[0])[:num_beams]
        if not parents:  # every candidate ended
            return max(ended, key=lambda e: e[0])[1]
        sequences = [sequences[b] + [t] for b, t in zip(parents, chosen)]
        scores = np.asarray(kept)
        best_open = score(scores.max(), step + 1)
        if len(ended) == num_beams and ended[-1][0] >= best_open:
            break
        if step + 1 < max_new_tokens:
            steps.keep(parents)
            steps.append(chosen)
    for logp, seq in zip(scores, sequences):
        ended.append((score(logp, len(seq)), seq))
    return max(ended, key=lambda e: e[0])[1]


def fits(max_positions: int, prompt_tokens: int, max_new_tokens: int, scaling: dict | None) -> str | None:
    """Why a generation would run past the model's positions, or None."""
    if prompt_tokens + max_new_tokens <= max_positions or rope.extends_positions(scaling):
        return None
    return (f"a prompt of {prompt_tokens} tokens plus {max_new_tokens} new ones passes the model's "
            f"{max_positions} positions (max_position_embeddings; a dynamic rope_scaling goes beyond it)")

