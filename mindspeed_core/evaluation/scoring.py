"""What an evaluation asks of the model, in batches: which option it finds most likely, what
it writes after a prompt, and how well it predicts a text (perplexity).

Prompts longer than the model's positions lose their beginning (the shots go first), and are
counted, so the report can say so.
"""

from __future__ import annotations

import numpy as np

from mindspeed_core import autograd, features, ops
from mindspeed_core.data.tokenizer import encode_plain
from mindspeed_core.models import generate as gen


def token_nll(model, rows: list[list[int]], pad_id: int = 0) -> list[np.ndarray]:
    """For each row, the negative log-likelihood of each of its tokens after the first, given
    those before it (len(row) - 1 values). Rows are padded on the right, which causal
    attention keeps out of sight of the real tokens."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    labels = np.concatenate([ids[:, 1:], np.full((len(rows), 1), pad_id, np.int64)], axis=1)
    with autograd.no_grad():
        logits = ops.cast(model(ops.tensor(ids)), "float32")
        # the model's own cross entropy (vocabulary-parallel under tensor parallelism)
        nll = model.seams.token_losses(ops.reshape(logits, (-1, logits.shape[-1])), ops.tensor(labels.reshape(-1)))
    nll = ops.to_numpy(nll).astype(np.float64).reshape(len(rows), width)
    return [nll[i, :len(r) - 1] for i, r in enumerate(rows)]


class Scorer:
    """Scores prompts on ``model`` in batches of ``batch``; prompts are cut to ``positions``
    tokens; ``cut`` counts the prompts that were."""

    def __init__(self, model, tokenizer, batch: int, positions: int, template=None):
        self.model, self.tokenizer, self.batch, self.positions = model, tokenizer, batch, positions
        self.template, self.cut = template, 0

    def encode(self, prompt: str, room: int = 0) -> list[int]:
        """The prompt's tokens (through the chat template if there is one), leaving ``room``
        positions free."""
        if self.template is not None:
            ids = encode_plain(self.tokenizer, self.template.render([{"role": "user", "content": prompt}]))
        else:
            ids = self.tokenizer.encode(prompt)
        limit = self.positions - room
        if len(ids) > limit:
            self.cut += 1
            ids = ids[len(ids) - limit:]
        return ids

    def pick(self, items) -> list[int]:
        """The index of the option each item's prompt makes most likely (log-likelihood of the
        option's tokens; the first on a tie)."""
        scores: list[list[float] | None] = [None] * len(items)
        single, whole = [], []  # options that differ in one token after a shared part; the rest
        for n, item in enumerate(items):
            options = [encode_plain(self.tokenizer, o) for o in item.options]
            shared = 0
            while all(len(o) > shared + 1 for o in options) and len({o[shared] for o in options}) == 1:
                shared += 1
            if all(len(o) == shared + 1 for o in options):
                context = self.encode(item.prompt, room=shared) + options[0][:shared]
                single.append((n, context, [o[-1] for o in options]))
            else:
                whole.append((n, options))
        for start in range(0, len(single), self.batch):
            group = single[start:start + self.batch]
            logp = gen.log_softmax(gen.next_token_logits(self.model, [c for _, c, _ in group]))
            for row, (n, _, tokens) in enumerate(group):
                scores[n] = [float(logp[row, t]) for t in tokens]
        rows, owners = [], []
        for n, options in whole:
            context = self.encode(items[n].prompt, room=max(len(o) for o in options))
            for k, o in enumerate(options):
                rows.append(context + o)
                owners.append((n, k, len(o)))
            scores[n] = [0.0] * len(options)
        for start in range(0, len(rows), self.batch):
            for nll, (n, k, length) in zip(token_nll(self.model, rows[start:start + self.batch]),
                                           owners[start:start + self.batch]):
                scores[n][k] = -float(nll[len(nll) - length:].sum())
        return [int(np.argmax(s)) for s in scores]

    def write(self, prompts: list[str], max_new_tokens: int, stops: tuple[str, ...], use_cache: bool = True) -> list[str]:
        """Each prompt's greedy continuation, up to its first stop text or the end of document."""
        eod = getattr(self.tokenizer, "eod", None)
        out = []
        for start in range(0, len(prompts), self.batch):
            encoded = [self.encode(p, room=max_new_tokens) for p in prompts[start:start + self.batch]]
            drawn = [[] for _ in encoded]

            def every_row_stopped(tokens):
                for row, t in zip(drawn, tokens):
                    if t is not None:
                        row.append(t)
                return all(any(s in self.tokenizer.decode(row) for s in stops) for row in drawn)

            gen.generate(self.model, encoded, max_new_tokens, gen.Sampling(), () if eod is None else (eod,),
                         use_cache, every_row_stopped)
            for row in drawn:
                text = self.tokenizer.decode(row)
                out.append(text[:min([text.index(s) for s in stops if s in text], default=len(text))])
        return out


def perplexity_sums(model, tokens: list[int], window: int, batch: int, mine=None) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens predicted) of ``tokens`` read in windows of
    ``window`` tokens, each starting at the last token of the one before: every token but the
    first is predicted once, from the tokens before it in its window. ``mine``: the windows
    this copy of the model reads, of all (data-parallel evaluation)."""
    features.note_used("perplexity")
    pieces = [tokens[i:i + window] for i in range(0, max(len(tokens) - 1, 1), window - 1)]
    pieces = [p for p in pieces if len(p) > 1]
    if mine is not None:
        pieces = mine(pieces)
    total, count = 0.0, 0
    for start in range(0, len(pieces), batch):
        for nll in token_nll(model, pieces[start:start + batch]):
            total += float(nll.sum())
            count += len(nll)
    return total, count
