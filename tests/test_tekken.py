"""Mistral's Tekken tokenizer (mindspeed_core/data/tekken.py; Magistral's --tokenizer-type
MagistralTokenizer) against mistral-common's own Tekkenizer: the tekken.json files mistral-common
ships (131,072 tokens, a thousand special ones) and a file of the newer kind with its own special
tokens give the same ids and the same text back."""

from __future__ import annotations

import base64
import json

import pytest

from mindspeed_core.data import tokenizer
from mindspeed_core.data.tekken import TekkenTokenizer
from mindspeed_core.errors import MindSpeedError

tekken = pytest.importorskip("mistral_common.tokens.tokenizers.tekken")

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 12:45, isn't it?",
    "def f(x):\n\treturn x ** 2  # squared\n\n\nclass A:\n    pass\r\n",
    "Ça coûte 3 450,99 € — naïve café; straße; ÀÉÎÕÜ",
    "你好，世界！今日は良い天気ですね。안녕하세요 مرحبا بالعالم",
    "emoji 🙂🚀👩‍💻 and symbols ∑∫√ ≠ ≤ «quotes» „low“",
    "[INST]not a special token[/INST]</s><s>   many   spaces\n\n\n  ",
    "1234567890 0.000001 -42e10 0x1F",
    # repeated pairs: which equal-rank pair joins first (the leftmost) decides the tokens
    "aaaaaaaaa bbbbbbb ......... ======= ------- ~~~~~ eeeeeeeee",
]


def _shipped(name: str) -> str:
    import importlib.resources

    return str(importlib.resources.files("mistral_common") / "data" / name)


@pytest.mark.feature("magistral-tokenizer")
@pytest.mark.parametrize("name", ["tekken_240911.json", "tekken_240718.json"])
def test_a_shipped_tekken_file_encodes_as_mistral_common(name):
    file = _shipped(name)
    ours, theirs = TekkenTokenizer(file), tekken.Tekkenizer.from_file(file)
    assert (ours.vocab_size, ours.num_special) == (theirs.n_words, theirs.num_special_tokens)
    assert (ours.bos, ours.eos) == (theirs.bos_id, theirs.eos_id) and ours.eod == theirs.eos_id
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, bos=False, eos=False), text
        assert len(ids) < len(text.encode("utf-8"))  # merged, not bytes
        assert ours.decode(ids) == text == theirs.decode(ids)
    assert ours.decode([ours.bos, *ours.encode(TEXTS[0]), ours.eos]) == TEXTS[0]  # special tokens left out


def _small_file(path, version: str = "v11") -> dict:
    """A tekken.json of the newer kind: its own special tokens, byte tokens and a few merges
    (ranks by merge order), the vocabulary cut below its last entries."""
    merges = [b"th", b"the", b" the", b"in", b"ing", b" a", b"an", b"and", b" and", b"er", b"re", b"ow"]
    vocab = [bytes([b]) for b in range(256)] + merges + [b"unused1", b"unused2"]
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
    data = {
        "config": {"pattern": r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
                   "num_vocab_tokens": len(vocab), "default_vocab_size": 256 + len(merges) + 10,
                   "default_num_special_tokens": 10, "version": version},
        "vocab": [{"rank": i, "token_bytes": base64.b64encode(v).decode(), "token_str": None}
                  for i, v in enumerate(vocab)],
        "special_tokens": [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(specials)],
    }
    path.write_text(json.dumps(data))
    return data


@pytest.mark.feature("magistral-tokenizer")
def test_a_file_with_its_own_special_tokens_encodes_as_mistral_common(tmp_path):
    _small_file(tmp_path / "tekken.json")
    ours = tokenizer.build_tokenizer("MagistralTokenizer", str(tmp_path))  # the folder, as --tokenizer-model
    theirs = tekken.Tekkenizer.from_file(str(tmp_path / "tekken.json"))
    assert ours.vocab_size == theirs.n_words == 278 and (ours.bos, ours.eos) == (1, 2)
    for text in ["the band and the ring rower", "Then THE theater: 42 and 7!\n\n x", *TEXTS]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, bos=False, eos=False), text
        assert ours.decode(ids) == text
    assert ours.encode(" the") == [10 + 258]  # one token: the merges applied, offset by the special ones


def test_a_bad_tekken_file_is_one_clear_line(tmp_path):
    with pytest.raises(MindSpeedError, match="reads a tekken.json: there is none"):
        TekkenTokenizer(str(tmp_path))
    data = _small_file(tmp_path / "tekken.json")
    data["vocab"] = data["vocab"][1:]  # byte 0 gone, the ranks shifted
    (tmp_path / "tekken.json").write_text(json.dumps(data))
    with pytest.raises(MindSpeedError, match="ranks of its first"):
        TekkenTokenizer(str(tmp_path))
    (tmp_path / "tekken.json").write_text("{not json")
    with pytest.raises(MindSpeedError, match="cannot read .* as a Tekken tokenizer"):
        TekkenTokenizer(str(tmp_path))
