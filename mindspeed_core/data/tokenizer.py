"""Tokenizers: a byte-level one that needs no files, and Hugging Face tokenizer.json files.

Megatron spelling: ``--tokenizer-type ByteLevel`` or ``--tokenizer-type PretrainedFromHF
--tokenizer-name-or-path DIR`` (a folder with tokenizer.json, or the file itself).
"""

from __future__ import annotations

import os

from mindspeed_core.errors import MindSpeedError


class ByteTokenizer:
    """UTF-8 bytes are the tokens 0..255; 256 is the end-of-document token."""

    name = "ByteLevel"

    def __init__(self):
        self.eod = 256
        self.vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json through the ``tokenizers`` library (no transformers needed)."""

    name = "PretrainedFromHF"

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise MindSpeedError("--tokenizer-type PretrainedFromHF needs the 'tokenizers' package: "
                                 "pip install 'mindspeed-core[hf]'") from None
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise MindSpeedError(f"no tokenizer.json at {path}")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as exc:  # noqa: BLE001 - the library's own parse errors vary
            raise MindSpeedError(f"cannot read tokenizer {file}: {exc}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eod = next((vocab[t] for t in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>") if t in vocab),
                   None)
        if eod is None:
            raise MindSpeedError(f"tokenizer {file} has no end-of-document token (</s>, <|endoftext|>, ...)")
        self.eod = eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def build_tokenizer(tokenizer_type: str | None, name_or_path: str | None):
    kind = tokenizer_type or ("PretrainedFromHF" if name_or_path else "ByteLevel")
    if kind == "ByteLevel":
        return ByteTokenizer()
    if kind in ("PretrainedFromHF", "HuggingFaceTokenizer"):
        if not name_or_path:
            raise MindSpeedError(f"--tokenizer-type {kind} needs --tokenizer-name-or-path")
        return HFTokenizer(name_or_path)
    raise MindSpeedError(f"unknown --tokenizer-type {kind!r}; choose ByteLevel or PretrainedFromHF")


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron pads the embedding table so each tensor-parallel shard is a round size."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple
