"""A property-style fuzz of the preprocessing handlers' JSON records: random types, missing and
extra keys, nesting, lone surrogates, huge strings, bytes that are not UTF-8. The only allowed
outcomes are a correct sample (the handler's keys, token ids in range, labels aligned with
the input) or a one-line refusal naming the record; anything else (another exception, a
malformed sample) fails. Seeded: the same cases every run."""

from __future__ import annotations

import json
import random

import pytest

from mindspeed_core import cli
from mindspeed_core.data import handlers, preprocess
from mindspeed_core.errors import MindSpeedError


CASES_PER_HANDLER = 400
OPTIONS = {"append_eod": True, "json_keys": ["text"], "map_keys": None, "placeholder_token": "@",
           "reward_tokens": ["+", "-"]}
FIELDS = {  # the columns each handler reads, and the tags of ShareGPT messages
    "AlpacaStyleInstructionHandler": ["instruction", "input", "output", "system", "history"],
    "SharegptStyleInstructionHandler": ["conversations", "system", "tools"],
    "AlpacaStylePairwiseHandler": ["instruction", "input", "chosen", "rejected", "system", "history"],
    "SharegptStylePairwiseHandler": ["conversations", "chosen", "rejected", "system"],
    "AlpacaStyleProcessRewardHandler": ["input", "value"],
    "PPOAlpacaStyleInstructionHandler": ["instruction", "input", "output", "system", "history"],
}
ROLES = ["human", "gpt", "system", "observation", "function_call", "bogus", None, 3]


def _text(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.05:
        return "\ud800" + "x"  # a lone surrogate, as json.loads makes of "\ud800"
    if kind < 0.08:
        return "y" * rng.choice((20_000, 200_000))  # huge
    if kind < 0.15:
        return ""
    alphabet = "ab +-@\n\t{}[]\"'\\é中😀"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))


def _value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if kind < 0.45 or depth > 2:
        return _text(rng)
    if kind < 0.55:
        return rng.choice([None, True, 0, -1, 3.5, float("inf")])
    if kind < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["from", "value", "role", "content", "x"]): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _message(rng: random.Random):
    if rng.random() < 0.1:
        return _value(rng, 2)
    return {"from": rng.choice(ROLES), "value": _text(rng) if rng.random() < 0.9 else _value(rng, 2)}


def _record(rng: random.Random, name: str):
    if rng.random() < 0.05:
        return _value(rng)  # not an object at all
    record = {}
    for field in FIELDS[name]:
        if rng.random() < 0.15:
            continue  # missing
        if field == "conversations" and rng.random() < 0.5:  # turns that alternate, of random texts
            record[field] = [{"from": ("human", "gpt")[k % 2], "value": _text(rng)} for k in range(rng.randint(1, 4))]
        elif field == "conversations" and rng.random() < 0.8:
            record[field] = [_message(rng) for _ in range(rng.randint(0, 5))]
        elif field == "history" and rng.random() < 0.6:
            record[field] = [[_text(rng), _text(rng)] if rng.random() < 0.8 else _value(rng, 1)
                             for _ in range(rng.randint(0, 3))]
        elif field == "value" and rng.random() < 0.7:
            record[field] = [rng.choice(["+", "-", "?", 1]) for _ in range(rng.randint(0, 3))]
        elif field in ("chosen", "rejected") and "Sharegpt" in name and rng.random() < 0.5:
            record[field] = _message(rng)
        elif field == "input" and "ProcessReward" in name and rng.random() < 0.7:
            record[field] = " ".join(rng.choice(["step", "@", "x"]) for _ in range(rng.randint(0, 6)))
        else:
            record[field] = _text(rng) if rng.random() < 0.7 else _value(rng)
    if rng.random() < 0.1:
        record["unexpected"] = _value(rng)
    return record


def _check_sample(handler, sample: dict, vocab: int) -> None:
    assert sorted(sample) == sorted(handler.keys), sample.keys()
    for key, ids in sample.items():
        assert isinstance(ids, list) and all(isinstance(i, int) for i in ids), key
        if key.endswith("input_ids"):
            assert ids and all(0 <= i < vocab for i in ids), key
        if key.endswith("labels"):
            side = key[:-len("labels")]
            assert len(ids) == len(sample[side + "input_ids"])
            assert any(i != handlers.IGNORE for i in ids), f"{key}: nothing to train on"
        if key.endswith("attention_mask"):
            assert set(ids) <= {1}


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_random_records_give_a_sample_or_one_line(name):
    rng = random.Random(name)
    tok = preprocess.build_tokenizer("ByteLevel")
    template = None
    if name != "AlpacaStyleProcessRewardHandler":
        template = preprocess.chat_templates.choose("chatml", False, None)
    handler = handlers.HANDLERS[name](tok, template, OPTIONS)
    outcomes = {"sample": 0, "refused": 0}
    for n in range(CASES_PER_HANDLER):
        record = _record(rng, name)
        where = f"fuzz.jsonl:{n + 1}"
        try:
            sample = handler.encode(record, where)
        except MindSpeedError as exc:
            message = str(exc)
            assert "\n" not in message and message.startswith(where), (record, message)
            outcomes["refused"] += 1
            continue
        _check_sample(handler, sample, tok.vocab_size)
        outcomes["sample"] += 1
    assert outcomes["sample"] > 5 and outcomes["refused"] > 5, outcomes  # both kinds of case were reached


def test_random_bytes_files_give_output_or_one_line(tmp_path, capsys):
    """Whole files through `mindspeed preprocess` (with two workers): lines of random bytes,
    JSON with invalid escapes, truncated objects."""
    rng = random.Random(5)
    lines = [b'{"instruction": "a", "output": "b"}', b'{"instruction": "\\ud800", "output": "b"}',
             b'{"instruction": "a", "output": "b"', b"\xff\xfe\x00", b'{"instruction": "\\x41"}', b"[]", b"{}"]
    for trial in range(12):
        chosen = [rng.choice(lines) if rng.random() < 0.7 else bytes(rng.getrandbits(8) for _ in range(12))
                  for _ in range(rng.randint(1, 6))]
        source = tmp_path / f"in{trial}.jsonl"
        source.write_bytes(b"\n".join(chosen) + b"\n")
        out = tmp_path / f"out{trial}"
        code = cli.main(["preprocess", "--input", str(source), "--output-prefix", str(out / "ds"),
                         "--handler-name", "AlpacaStyleInstructionHandler", "--workers", "2"])
        said = capsys.readouterr()
        assert code in (0, 2), said.err
        if code == 2:
            assert said.err.count("\n") == 1 and "Traceback" not in said.err, said.err
            assert not out.exists() or not list(out.iterdir()), list(out.iterdir())
        else:
            records = [json.loads(x) for x in chosen]  # it took every line: each was a good record
            assert all(isinstance(r, dict) for r in records)
