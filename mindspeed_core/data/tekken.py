"""Mistral's Tekken tokenizer (``tekken.json``; Magistral's ``--tokenizer-type
MagistralTokenizer``), read here without mistral-common.

A tekken.json holds byte-level BPE ranks (``vocab``: each token's bytes, base64, by rank), the
pre-tokenizing regular expression (``config.pattern``) and the special tokens. The first
``default_num_special_tokens`` ids are the special tokens (``special_tokens``, or for files of
version v7 and older the fixed list below, padded with ``<SPECIAL_i>``); the text's tokens
follow, id = rank + that count, and only the ranks below ``default_vocab_size`` minus it are
used. Text is cut by the pattern, and each piece's bytes are merged pair by pair, the pair of
the lowest rank first, as tiktoken does. As mistral-common (and MindSpeed-LLM's
MagistralTokenizer on top of it) encodes text, special tokens are never read from it: a chat
template's ``[INST]`` is its characters. The end of document is ``</s>``.
"""

from __future__ import annotations

import base64
import json
import os

from mindspeed_core.errors import MindSpeedError

# the special tokens of files without a list of their own (v7 and older), in rank order
OLD_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]")


def tekken_file(path: str) -> str:
    """The tekken.json of a folder (or the file itself)."""
    file = os.path.join(path, "tekken.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise MindSpeedError(f"--tokenizer-type MagistralTokenizer reads a tekken.json: there is none at {path}")
    return file


class TekkenTokenizer:
    name = "MagistralTokenizer"

    def __init__(self, path: str):
        from mindspeed_core import features

        features.note_used("magistral-tokenizer")
        try:
            import regex
        except ImportError:
            raise MindSpeedError("--tokenizer-type MagistralTokenizer needs the 'regex' package (the pattern's "
                                 "Unicode classes): pip install 'mindspeed-core[hf]'") from None
        file = tekken_file(path)
        try:
            with open(file, encoding="utf-8") as f:
                data = json.load(f)
            config, vocab = data["config"], data["vocab"]
            specials = data.get("special_tokens")
            self.num_special = int(config["default_num_special_tokens"])
            self.vocab_size = int(config["default_vocab_size"])
            self._pattern = regex.compile(config["pattern"])
            inner = self.vocab_size - self.num_special
            self._ranks = {base64.b64decode(t["token_bytes"]): int(t["rank"]) for t in vocab[:inner]}
        except (OSError, ValueError, KeyError, TypeError, regex.error) as exc:
            raise MindSpeedError(f"cannot read {file} as a Tekken tokenizer: {exc!r}") from None
        if sorted(self._ranks.values()) != list(range(inner)):
            raise MindSpeedError(f"{file}: the ranks of its first {inner} tokens are not 0..{inner - 1}, each once")
        missing = [b for b in range(256) if bytes([b]) not in self._ranks]
        if missing:  # every text must be expressible: each byte is a token
            raise MindSpeedError(f"{file}: byte {missing[0]} has no token")
        names = [t["token_str"] for t in specials] if specials is not None else list(OLD_SPECIALS)
        if len(names) > self.num_special or len(set(names)) != len(names):
            raise MindSpeedError(f"{file}: {len(names)} special tokens (each once) for "
                                 f"default_num_special_tokens {self.num_special}")
        names += [f"<SPECIAL_{i}>" for i in range(len(names), self.num_special)]
        self.specials = {name: i for i, name in enumerate(names)}
        for name in ("<s>", "</s>"):
            if name not in self.specials:
                raise MindSpeedError(f"{file} has no {name} special token")
        self.bos, self.eos = self.specials["<s>"], self.specials["</s>"]
        self.eod, self.eod_source = self.eos, "'</s>', the Tekken tokenizer's end of sequence"
        self._bytes = {rank: piece for piece, rank in self._ranks.items()}
        self._cache: dict = {}

    def _merge(self, piece: bytes) -> list[int]:
        """BPE of one pre-tokenized piece: the adjacent pair whose join has the lowest rank
        joined first (the leftmost such pair on a tie), until no join is a token."""
        if piece in self._ranks:
            return [self._ranks[piece]]
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while len(parts) > 1:
            best, at = None, -1
            for i in range(len(parts) - 1):
                rank = self._ranks.get(parts[i] + parts[i + 1])
                if rank is not None and (best is None or rank < best):
                    best, at = rank, i
            if best is None:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        return [self._ranks[p] for p in parts]

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """The text's tokens (no ``<s>``: mistral-common's encode with bos=False, as
        MindSpeed-LLM's tokenizer calls it)."""
        out = []
        for piece in self._pattern.findall(text):
            ids = self._cache.get(piece)
            if ids is None:
                ids = [rank + self.num_special for rank in self._merge(piece.encode("utf-8"))]
                if len(self._cache) < 100_000:
                    self._cache[piece] = ids
            out += ids
        return out

    def decode(self, ids) -> str:
        """The text of ``ids``, special tokens left out (mistral-common's default policy)."""
        pieces = [self._bytes.get(int(i) - self.num_special, b"") for i in ids if int(i) >= self.num_special]
        return b"".join(pieces).decode("utf-8", errors="replace")
