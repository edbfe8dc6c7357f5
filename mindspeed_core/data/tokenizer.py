"""Tokenizers, by Megatron's ``--tokenizer-type``:

- ``ByteLevel``: UTF-8 bytes, needs no files;
- ``PretrainedFromHF`` / ``HuggingFaceTokenizer`` with ``--tokenizer-name-or-path DIR`` (or
  Megatron's ``--tokenizer-model DIR``: a folder with tokenizer.json and usually
  tokenizer_config.json, or the tokenizer.json itself);
- ``GPT2BPETokenizer`` with ``--vocab-file vocab.json --merge-file merges.txt`` (GPT-2's
  byte-level BPE, end of document ``<|endoftext|>``);
- ``NullTokenizer`` with ``--vocab-size N``: text is space-separated ids, N is the end of
  document (benchmarks and data tokenized elsewhere);
- ``MagistralTokenizer`` with ``--tokenizer-model`` (a folder with tekken.json, or the file):
  Mistral's Tekken BPE (data/tekken.py).

Each has ``eod`` (the end-of-document id), ``eod_source`` (where that choice came from, for
messages) and ``bos`` (the beginning-of-sequence id, or None).
"""

from __future__ import annotations

import json
import os

from mindspeed_core.errors import MindSpeedError


class ByteTokenizer:
    """UTF-8 bytes are the tokens 0..255; 256 is the end-of-document token."""

    name = "ByteLevel"

    def __init__(self):
        self.eod = 256
        self.vocab_size = 257
        self.eod_source, self.bos = "256, after the 256 byte values", None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json through the ``tokenizers`` library (no transformers needed), read as
    Megatron's HuggingFaceTokenizer reads the folder:

    - text is encoded with the tokenizer's post-processor (a Llama tokenizer puts ``<s>``
      before every document) unless ``include_special_tokens`` is off
      (``--tokenizer-hf-no-include-special-tokens``);
    - the end of document is the ``eos_token`` that tokenizer_config.json names (its
      ``sep_token`` when it names no eos_token).
    """

    name = "PretrainedFromHF"
    # when tokenizer_config.json names no end of document: the usual names, in this order
    EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")

    def __init__(self, path: str, include_special_tokens: bool = True):
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
        self.include_special_tokens = include_special_tokens
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        config_file = os.path.join(os.path.dirname(os.path.abspath(file)), "tokenizer_config.json")
        config = _read_config(config_file)
        eos = _token_text(config.get("eos_token")) or _token_text(config.get("sep_token"))
        if eos is not None:
            if eos not in vocab:
                raise MindSpeedError(f"{config_file} names {eos!r} as the end of document, but {file} has no such "
                                     "token")
            self.eod, self.eod_source = vocab[eos], f"{eos!r}, the eos_token of tokenizer_config.json"
        else:
            found = next((t for t in self.EOD_NAMES if t in vocab), None)
            if found is None:
                raise MindSpeedError(f"tokenizer {file} has no end-of-document token: name one as eos_token in "
                                     f"{config_file}")
            self.eod, self.eod_source = vocab[found], f"{found!r} (no eos_token in tokenizer_config.json)"
        bos = _token_text(config.get("bos_token"))
        self.bos = vocab.get(bos) if bos is not None else None

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """``add_special_tokens`` False: the text alone (a chat template writes them itself)."""
        special = self.include_special_tokens if add_special_tokens is None else add_special_tokens
        return self._tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def _read_config(file: str) -> dict:
    """tokenizer_config.json as a dict ({} when the folder has none)."""
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError) as exc:
        raise MindSpeedError(f"cannot read {file}: {exc}") from None
    if not isinstance(config, dict):
        raise MindSpeedError(f"{file} holds a JSON {type(config).__name__}, not an object")
    return config


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class NullTokenizer:
    """Megatron's NullTokenizer: "12 7 3" is the ids [12, 7, 3]; ``vocab_size`` ids plus the
    end-of-document id ``vocab_size``."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        self.eod = int(vocab_size)
        self.vocab_size = self.eod + 1
        self.eod_source, self.bos = f"{self.eod} (--vocab-size)", None

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split(" ")]
        except ValueError:
            raise MindSpeedError(f"NullTokenizer reads space-separated token ids; got {text[:40]!r}") from None
        bad = [i for i in ids if not 0 <= i < self.eod]
        if bad:
            raise MindSpeedError(f"NullTokenizer: id {bad[0]} is outside [0, --vocab-size {self.eod})")
        return ids

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class GPT2BPETokenizer(HFTokenizer):
    """GPT-2's byte-level BPE from vocab.json and merges.txt (Megatron's GPT2BPETokenizer)."""

    name = "GPT2BPETokenizer"
    EOD = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str):
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        except ImportError:
            raise MindSpeedError("--tokenizer-type GPT2BPETokenizer needs the 'tokenizers' package: "
                                 "pip install 'mindspeed-core[hf]'") from None
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise MindSpeedError(f"--tokenizer-type GPT2BPETokenizer needs {flag} (got {path!r})")
        try:
            self._tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception as exc:  # noqa: BLE001 - the library's own parse errors vary
            raise MindSpeedError(f"cannot read GPT-2 BPE files {vocab_file}, {merge_file}: {exc}") from None
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        vocab = self._tok.get_vocab()
        if self.EOD not in vocab:
            raise MindSpeedError(f"{vocab_file} has no {self.EOD} token, GPT-2's end of document")
        # as in Megatron (transformers' GPT2Tokenizer underneath): the literal string in a
        # text is the end-of-document token, not five byte-level pieces
        self._tok.add_special_tokens([self.EOD])
        self.vocab_size, self.eod = len(vocab), vocab[self.EOD]
        self.eod_source, self.bos, self.include_special_tokens = repr(self.EOD), None, True


def build_tokenizer(tokenizer_type: str | None, name_or_path: str | None = None, vocab_file: str | None = None,
                    merge_file: str | None = None, vocab_size: int | None = None, include_special_tokens: bool = True):
    kind = tokenizer_type or ("PretrainedFromHF" if name_or_path else "ByteLevel")
    if kind == "ByteLevel":
        return ByteTokenizer()
    if kind in ("PretrainedFromHF", "HuggingFaceTokenizer"):
        if not name_or_path:
            raise MindSpeedError(f"--tokenizer-type {kind} needs --tokenizer-name-or-path")
        return HFTokenizer(name_or_path, include_special_tokens)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if kind == "NullTokenizer":
        if vocab_size is None:
            raise MindSpeedError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    if kind == "MagistralTokenizer":
        from mindspeed_core.data.tekken import TekkenTokenizer

        if not name_or_path:
            raise MindSpeedError("--tokenizer-type MagistralTokenizer needs --tokenizer-model (the folder's tekken.json)")
        return TekkenTokenizer(name_or_path)
    raise MindSpeedError(f"unknown --tokenizer-type {kind!r}; choose ByteLevel, PretrainedFromHF, "
                         "GPT2BPETokenizer, NullTokenizer or MagistralTokenizer")


def encode_plain(tokenizer, text: str) -> list[int]:
    """``text`` as tokens, without the special tokens a tokenizer adds on its own."""
    return tokenizer.encode(text, add_special_tokens=False) if isinstance(tokenizer, HFTokenizer) else \
        tokenizer.encode(text)


def check_fits(tokenizer, vocab_size: int) -> None:
    """A tokenizer with more ids than the model's vocabulary would index past its embedding."""
    if tokenizer.vocab_size > vocab_size:
        raise MindSpeedError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary "
                             f"has {vocab_size}: use the tokenizer the model was trained with")


def tokenizer_args(args) -> tuple:
    """The tokenizer flags of parsed arguments, as build_tokenizer's positional arguments."""
    return (args.tokenizer_type, args.tokenizer_name_or_path, getattr(args, "vocab_file", None),
            getattr(args, "merge_file", None), getattr(args, "vocab_size", None),
            getattr(args, "tokenizer_hf_include_special_tokens", True))


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron pads the embedding table so each tensor-parallel shard is a round size."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple
