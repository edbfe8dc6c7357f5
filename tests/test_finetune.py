"""Instruction and preference data (mindspeed preprocess --handler-name ..., data/handlers.py)
and instruction fine-tuning (mindspeed train --stage sft).

The byte-level tokenizer makes every expected layout readable: a text's tokens are its UTF-8
bytes, the end of document is 256. Each layout below is written out by hand from the
template's text, not derived from our code.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mindspeed_core import cli
from mindspeed_core.data import chat_templates
from mindspeed_core.data.indexed import IndexedDataset
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.training import checkpoint

import numeric

IGNORE, EOD = -100, 256


def layout(*pieces) -> tuple[list[int], list[int]]:
    """(ids, labels) of (text or token id, trained) pieces, byte-level."""
    ids, labels = [], []
    for piece, trained in pieces:
        tokens = [piece] if isinstance(piece, int) else list(piece.encode())
        ids += tokens
        labels += tokens if trained else [IGNORE] * len(tokens)
    return ids, labels


def preprocess(capsys, tmp_path, records, *flags, name="data", as_array=False, fails=False):
    """Write ``records`` (.json array or .jsonl), run `mindspeed preprocess` on them; returns
    (output prefix, stdout), or with ``fails`` the one-line error (exit status 2)."""
    source = tmp_path / (f"{name}.json" if as_array else f"{name}.jsonl")
    with open(source, "w", encoding="utf-8") as fh:
        if as_array:
            json.dump(records, fh)
        else:
            fh.writelines(json.dumps(r) + "\n" for r in records)
    prefix = str(tmp_path / "out" / name)
    code = cli.main(["preprocess", "--input", str(source), "--output-prefix", prefix, *flags])
    out = capsys.readouterr()
    if fails:
        assert code == 2 and len(out.err.strip().splitlines()) == 1, out.err
        return out.err
    assert code == 0, out.err
    return prefix, out.out


def documents(prefix: str, key: str) -> list[list[list[int]]]:
    """Each document's sequences of the key's file."""
    ds = IndexedDataset(f"{prefix}_packed_{key}_document")
    return [[ds[s].tolist() for s in range(int(ds.document_indices[d]), int(ds.document_indices[d + 1]))]
            for d in range(ds.document_count)]


def samples(prefix: str, keys=("input_ids", "labels")) -> list[tuple]:
    """One tuple of sequences per unpacked sample."""
    parts = [documents(prefix, k) for k in keys]
    assert all(len(doc) == 1 for doc in parts[0]), "one sequence per document"
    return [tuple(p[i][0] for p in parts) for i in range(len(parts[0]))]


CHATML = "<|im_start|>{}\n{}<|im_end|>\n"
ALPACA = [{"instruction": "Add", "input": "1 2", "output": "3"},
          {"instruction": "Hi", "input": "", "output": "Hello", "system": "Be brief.", "history": [["Q1", "A1"]]}]


@pytest.mark.feature("handler-alpaca")
def test_alpaca_records_train_every_reply_and_nothing_else(capsys, tmp_path):
    prefix, out = preprocess(capsys, tmp_path, ALPACA, "--handler-name", "AlpacaStyleInstructionHandler",
                             "--prompt-type", "chatml", as_array=True)
    assert "wrote 2 documents" in out and "template: chatml" in out
    first = layout((CHATML.format("user", "Add\n1 2") + "<|im_start|>assistant\n", False), ("3<|im_end|>\n", True))
    second = layout((CHATML.format("system", "Be brief.") + CHATML.format("user", "Q1") + "<|im_start|>assistant\n",
                     False), ("A1<|im_end|>\n", True),
                    (CHATML.format("user", "Hi") + "<|im_start|>assistant\n", False), ("Hello<|im_end|>\n", True))
    got = samples(prefix, ("input_ids", "labels", "attention_mask"))
    assert [g[:2] for g in got] == [first, second]
    assert all(mask == [1] * len(ids) for ids, _, mask in got)
    assert IndexedDataset(f"{prefix}_packed_labels_document").dtype == np.int32  # -100 fits

    # a template without a stop text ends each reply with the end of document, trained
    prefix, _ = preprocess(capsys, tmp_path, ALPACA[:1], "--handler-name", "AlpacaStyleInstructionHandler",
                           "--prompt-type", "empty", "--append-eod", name="empty")
    assert samples(prefix) == [layout(("Add\n1 2", False), ("3", True), (EOD, True))]

    # other column names
    renamed = [{"question": "Add", "answer": "3"}]
    prefix, _ = preprocess(capsys, tmp_path, renamed, "--handler-name", "AlpacaStyleInstructionHandler",
                           "--prompt-type", "empty", "--map-keys", '{"prompt": "question", "response": "answer"}',
                           name="renamed")
    assert samples(prefix) == [layout(("Add", False), ("3", True), (EOD, True))]


SHAREGPT = [{"conversations": [
    {"from": "system", "value": "S"}, {"from": "human", "value": "u1"}, {"from": "function_call", "value": "f()"},
    {"from": "observation", "value": "42"}, {"from": "gpt", "value": "a2"}]}]
LLAMA3 = "<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>"
ASK = "<|start_header_id|>assistant<|end_header_id|>\n\n"


@pytest.mark.feature("handler-sharegpt")
def test_sharegpt_multi_turn_trains_every_assistant_turn_tool_calls_included(capsys, tmp_path):
    prefix, _ = preprocess(capsys, tmp_path, SHAREGPT, "--handler-name", "SharegptStyleInstructionHandler",
                           "--prompt-type", "llama3")
    assert samples(prefix) == [layout(
        ("<|begin_of_text|>" + LLAMA3.format("system", "S") + LLAMA3.format("user", "u1") + ASK, False),
        ("f()<|eot_id|>", True), (LLAMA3.format("user", "42") + ASK, False), ("a2<|eot_id|>", True))]

    openai = [{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}]
    tags = {"messages": "messages", "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                             "assistant_tag": "assistant", "system_tag": "system"}}
    prefix, _ = preprocess(capsys, tmp_path, openai, "--handler-name", "SharegptStyleInstructionHandler",
                           "--prompt-type", "chatml", "--map-keys", json.dumps(tags), name="openai")
    assert samples(prefix) == [layout((CHATML.format("user", "x") + "<|im_start|>assistant\n", False),
                                      ("y<|im_end|>\n", True))]


@pytest.mark.feature("handler-alpaca-pairwise")
@pytest.mark.feature("handler-sharegpt-pairwise")
def test_pairwise_records_share_the_prompt_and_train_each_reply(capsys, tmp_path):
    keys = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
    prompt = (CHATML.format("user", "Q") + "<|im_start|>assistant\n", False)
    want = (*layout(prompt, ("good<|im_end|>\n", True)), *layout(prompt, ("bad<|im_end|>\n", True)))
    alpaca = [{"instruction": "Q", "chosen": "good", "rejected": "bad"}]
    prefix, _ = preprocess(capsys, tmp_path, alpaca, "--handler-name", "AlpacaStylePairwiseHandler",
                           "--prompt-type", "chatml", name="alpaca")
    assert samples(prefix, keys) == [want]
    sharegpt = [{"conversations": [{"from": "human", "value": "Q"}], "chosen": {"from": "gpt", "value": "good"},
                 "rejected": {"from": "gpt", "value": "bad"}}]
    prefix, _ = preprocess(capsys, tmp_path, sharegpt, "--handler-name", "SharegptStylePairwiseHandler",
                           "--prompt-type", "chatml", name="sharegpt")
    assert samples(prefix, keys) == [want]


@pytest.mark.feature("handler-alpaca-prm")
def test_process_reward_labels_sit_on_each_step_end(capsys, tmp_path):
    records = [{"input": "a=1 # b=2 #", "value": ["+", "-"]}]
    prefix, _ = preprocess(capsys, tmp_path, records, "--handler-name", "AlpacaStyleProcessRewardHandler",
                           "--placeholder-token", "#", "--reward-tokens", "+", "-")
    ids, labels = samples(prefix)[0]
    assert ids == list(b"a=1 # b=2 #")
    assert labels == [IGNORE] * 4 + [ord("+")] + [IGNORE] * 5 + [ord("-")]
    prm = ["--handler-name", "AlpacaStyleProcessRewardHandler", "--placeholder-token", "#"]
    err = preprocess(capsys, tmp_path, [{"input": "a # b #", "value": ["+"]}], *prm, name="short", fails=True)
    assert "short.jsonl:1: 2 steps end with the placeholder token but 1 labels" in err
    err = preprocess(capsys, tmp_path, [{"input": "a #", "value": ["?"]}], *prm, "--reward-tokens", "+", "-",
                     name="unknown", fails=True)
    assert "label '?' is not one of --reward-tokens + -" in err


LLAMA2 = "<s>[INST] {} [/INST]"


@pytest.mark.feature("handler-alpaca-ppo")
def test_ppo_records_are_the_prompt_up_to_the_assistants_turn(capsys, tmp_path):
    """MindSpeed-LLM's llama2 PPO script's handler and template: each record the prompt alone
    (system inside the first [INST], the history with its replies), no labels written; the
    trainer names the data for what it is."""
    records = [{"instruction": "Add", "input": "1 2", "output": "3"}, {"instruction": "Hi"},
               {"instruction": "Q2", "system": "S", "history": [["Q1", "A1"]]}]
    prefix, out = preprocess(capsys, tmp_path, records, "--handler-name", "PPOAlpacaStyleInstructionHandler",
                             "--prompt-type", "llama2", "--workers", "2")
    assert "wrote 3 documents" in out
    want = [list(LLAMA2.format("Add\n1 2").encode()), list(LLAMA2.format("Hi").encode()),
            list("<s>[INST] <<SYS>>\nS\n<</SYS>>\n\nQ1 [/INST]A1</s><s>[INST] Q2 [/INST]".encode())]
    got = samples(prefix, ("input_ids", "attention_mask"))
    assert [ids for ids, _ in got] == want and all(mask == [1] * len(ids) for ids, mask in got)
    assert not os.path.exists(f"{prefix}_packed_labels_document.idx")
    err = preprocess(capsys, tmp_path, records, "--handler-name", "PPOAlpacaStyleInstructionHandler",
                     "--prompt-type", "llama2", "--pack", "--seq-length", "64", name="packed", fails=True)
    assert "drop --pack" in err
    code = cli.main(["train", *MODEL, "--stage", "sft", "--data-path", prefix, "--micro-batch-size", "1",
                     "--global-batch-size", "1", "--train-iters", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "holds prompts without replies (PPOAlpacaStyleInstructionHandler)" in err, err


@pytest.mark.feature("handler-sharegpt")
def test_long_samples_are_dropped_or_cut_and_packs_keep_whole_conversations(capsys, tmp_path):
    records = [{"conversations": [{"from": "human", "value": "q" * n}, {"from": "gpt", "value": "a" * n}]}
               for n in (4, 30, 9, 2)]  # 4 + 2n tokens each, with the empty template and the end of document
    common = ["--handler-name", "SharegptStyleInstructionHandler", "--prompt-type", "empty", "--seq-length", "23"]
    prefix, out = preprocess(capsys, tmp_path, records, *common, name="drop")
    assert "1 samples longer than --seq-length + 1 tokens were dropped" in out
    assert [len(ids) for ids, _ in samples(prefix)] == [9, 19, 5]
    cut = ["--truncation", "cut", "--seq-length", "39"]
    prefix, out = preprocess(capsys, tmp_path, records, *common, *cut, name="cut")
    assert "1 samples longer than --seq-length + 1 tokens were cut" in out
    assert samples(prefix)[1] == layout(("q" * 30, False), ("a" * 10, True))
    # packed: samples of 9, 19 and 5 tokens into packs of at most 24, each sample whole
    prefix, out = preprocess(capsys, tmp_path, records, *common, "--pack", "--workers", "2", name="pack")
    packs = documents(prefix, "input_ids")
    assert sorted(sorted(len(s) for s in pack) for pack in packs) == [[5, 19], [9]]
    labels = documents(prefix, "labels")
    unpacked = dict((tuple(i), tuple(l)) for i, l in samples(str(tmp_path / "out" / "drop")))
    for pack, pack_labels in zip(packs, labels):
        for ids, lab in zip(pack, pack_labels):
            assert unpacked[tuple(ids)] == tuple(lab)
    assert not list((tmp_path / "out").glob("pack.unpacked*")), "the unpacked step is removed"


def test_a_cut_that_leaves_nothing_to_train_drops_the_sample(capsys, tmp_path):
    records = [{"conversations": [{"from": "human", "value": "q" * 40}, {"from": "gpt", "value": "a"}]},
               {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}]
    prefix, out = preprocess(capsys, tmp_path, records, "--handler-name", "SharegptStyleInstructionHandler",
                             "--prompt-type", "empty", "--seq-length", "15", "--truncation", "cut")
    assert "1 samples longer than --seq-length + 1 tokens were dropped" in out
    assert samples(prefix) == [layout(("q", False), ("a", True), (EOD, True))]


def test_hugging_face_templates_mark_the_assistant_by_rendering_step_by_step():
    source = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf = chat_templates.HFTemplate(source, {}, "test")
    ours = chat_templates.TEMPLATES["chatml"]
    conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                    {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                    {"role": "assistant", "content": "a2"}]
    for messages, generation in ((conversation, False), (conversation[:-1], True)):  # trained; a chat's prompt
        want = ours.segments(messages, generation)
        got = hf.segments(messages, generation)
        assert "".join(t for t, _ in got) == "".join(t for t, _ in want)
        replies = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        assert [t for t, a in got if a] == [t for t, a in want if a] == replies
    # a template that writes the last reply differently cannot say which tokens are the assistant's
    rewriting = source.replace("{{ m.content }}", "{{ m.content }}{% if loop.last %}!{% endif %}")
    with pytest.raises(MindSpeedError, match="before message 2 differently"):
        chat_templates.HFTemplate(rewriting, {}, "test").segments(conversation, False)


@pytest.mark.parametrize("record, message", [
    ({"conversations": [{"from": "gpt", "value": "a"}]}, "message 0 is from 'gpt' where 'human' or 'observation' "
                                                         "belongs"),
    ({"conversations": [{"from": "human", "value": "q"}]}, "the conversation ends with the user's turn: nothing to train on"),
    ({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "a"}]}, "message 0's 'value' is int"),
    ({"conversations": "hello"}, "'conversations' must be a non-empty list"),
])
def test_malformed_records_name_their_line_and_write_nothing(capsys, tmp_path, record, message):
    good = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    err = preprocess(capsys, tmp_path, [good, record], "--handler-name", "SharegptStyleInstructionHandler", fails=True)
    assert "data.jsonl:2: " + message in err
    assert not (tmp_path / "out").exists()  # made by the run, removed again


def test_bad_instruction_options_are_one_line_errors(capsys, tmp_path):
    alpaca = ["--handler-name", "AlpacaStyleInstructionHandler"]
    err = preprocess(capsys, tmp_path, ALPACA, *alpaca, "--map-keys", '{"prompts": "q"}', fails=True)
    assert "'prompts' is not a column of alpaca data" in err
    err = preprocess(capsys, tmp_path, ALPACA, "--handler-name", "AlpacaStylePairwiseHandler", "--pack",
                     "--seq-length", "64", fails=True)
    assert "AlpacaStylePairwiseHandler data is not packed" in err
    err = preprocess(capsys, tmp_path, ALPACA, *alpaca, "--seq-length", "4", fails=True)
    assert "all 2 were longer than --seq-length 4 + 1 tokens" in err


# ---- training --------------------------------------------------------------------------------

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "64", "--seq-length", "160", "--make-vocab-size-divisible-by", "8",
         "--tokenizer-type", "ByteLevel", "--eval-iters", "0", "--log-interval", "1", "--no-progress",
         "--split", "100,0,0", "--seed", "3"]
DIALOGUES = [("add 2 and 3", "5"), ("name a colour", "blue"), ("say hi", "hi there"), ("count to 3", "1 2 3"),
             ("2 times 4", "8")]


def _conversation(question, answer):
    return layout((CHATML.format("user", question) + "<|im_start|>assistant\n", False),
                  (answer + "<|im_end|>\n", True))


def reference_loss(state: dict, cfg: ModelConfig) -> float:
    """Mean negative log-likelihood of every trained token, each conversation run alone, in
    float64 numpy."""
    total, count = 0.0, 0
    for question, answer in DIALOGUES:
        ids, labels = _conversation(question, answer)
        logp = numeric.token_log_probs(state, cfg, ids)
        trained = np.asarray(labels[1:]) != IGNORE
        total -= float(logp[trained].sum())
        count += int(trained.sum())
    return total / count


def losses(path) -> dict:
    return {r["iteration"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r}


@pytest.mark.feature("sft")
@pytest.mark.feature("handler-alpaca")
@pytest.mark.feature("dynamic-padding")
@pytest.mark.feature("no-shuffle")
@pytest.mark.feature("per-token-loss")
def test_sft_loss_is_the_assistant_tokens_mean_and_packing_changes_nothing(capsys, tmp_path):
    records = [{"instruction": q, "output": a} for q, a in DIALOGUES]
    common = ["--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "chatml", "--seq-length", "160"]
    plain, _ = preprocess(capsys, tmp_path, records, *common, name="plain")
    packed, out = preprocess(capsys, tmp_path, records, *common, "--pack", name="packed")
    assert len(documents(packed, "input_ids")) < len(DIALOGUES), out  # some packs hold several conversations
    ckpt = tmp_path / "ckpt"
    code = cli.main(["train", *MODEL, "--micro-batch-size", "5", "--global-batch-size", "5", "--stage", "sft", "--data-path", plain, "--train-iters", "2",
                     "--lr", "1e-2", "--save", str(ckpt)])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    state = checkpoint.load_model_arrays(str(ckpt), 2)
    cfg = ModelConfig.from_dict(checkpoint.read_meta(str(ckpt), 2)["model"])
    want = reference_loss(state, cfg)
    # dynamic padding: the micro-batch as wide as its longest sample (far below --seq-length 160)
    for name, prefix, extra in (("plain", plain, []), ("packed", packed, []),
                                ("dynamic", plain, ["--no-pad-to-seq-lengths", "--no-shuffle"])):
        # one micro-batch of every sample (a pack is a sample): the step's loss is the mean over
        # all trained tokens, whatever the order, the packing and the padding
        n = str(len(documents(prefix, "input_ids")))
        metrics = tmp_path / f"{name}.jsonl"
        code = cli.main(["train", *MODEL, "--micro-batch-size", n, "--global-batch-size", n, "--stage", "sft",
                         "--data-path", prefix, "--train-iters", "1", "--lr", "0", "--load", str(ckpt), "--finetune",
                         "--metrics-file", str(metrics), *extra])
        out = capsys.readouterr()
        assert code == 0, out.err
        assert "fine-tuning from the weights of" in out.out
        got = losses(metrics)
        assert list(got) == [1], got  # --finetune starts at iteration 0
        assert abs(got[1] - want) <= 1e-5 * want, (name, got[1], want)
    # a micro-batch a sample: the mean of the micro-batches' means is another number; with
    # --calculate-per-token-loss (Megatron's) each label weighs 1 / the step's labels, the mean
    # over all trained tokens again
    n = str(len(documents(plain, "input_ids")))
    per_micro = {}
    for flags in ([], ["--calculate-per-token-loss"]):
        metrics = tmp_path / f"micro{len(flags)}.jsonl"
        code = cli.main(["train", *MODEL, "--micro-batch-size", "1", "--global-batch-size", n, "--stage", "sft",
                         "--data-path", plain, "--train-iters", "1", "--lr", "0", "--load", str(ckpt), "--finetune",
                         "--metrics-file", str(metrics), *flags])
        assert code == 0, capsys.readouterr().err
        capsys.readouterr()
        per_micro[bool(flags)] = losses(metrics)[1]
    assert abs(per_micro[True] - want) <= 1e-5 * want, (per_micro, want)
    assert abs(per_micro[False] - want) > 5e-4 * want, (per_micro, want)  # measured 1.3e-3 apart


def test_dynamic_padding_cuts_padding_only_and_no_shuffle_reads_in_file_order(capsys, tmp_path):
    from mindspeed_core.data import finetune_dataset

    records = [{"instruction": q, "output": a} for q, a in DIALOGUES]
    prefix, _ = preprocess(capsys, tmp_path, records, "--handler-name", "AlpacaStyleInstructionHandler",
                           "--prompt-type", "chatml", "--seq-length", "160")
    ordered = finetune_dataset.build_splits([prefix], "100,0,0", 160, 3, pad=EOD, shuffle=False)["train"]
    seeded = finetune_dataset.build_splits([prefix], "100,0,0", 160, 3, pad=EOD)["train"]
    want = [_conversation(q, a)[0] for q, a in DIALOGUES]
    first = [list(ordered[i][0][:len(w)]) for i, w in enumerate(want)]
    assert first == want  # file order, and again in the second epoch
    assert [list(ordered[len(want) + i][0][:len(w)]) for i, w in enumerate(want)] == want
    assert [list(seeded[i][0][:len(w)]) for i, w in enumerate(want)] != want  # the default shuffles
    rows = [ordered[i] for i in range(len(want))]
    longest = max(len(w) for w in want)
    for multiple in (8, 24):
        cut = finetune_dataset.trimmed(rows, multiple)
        width = -(-longest // multiple) * multiple
        assert all(len(x) == width + 1 for row in cut for x in row), (multiple, longest)
        for full, short in zip(rows, cut):  # what went is padding: no token, no label, no document
            assert (full[2][width + 1:] == -1).all() and (full[1][width + 1:] == IGNORE).all()
            assert all(np.array_equal(a[:width + 1], b) for a, b in zip(full, short))
    assert finetune_dataset.trimmed(rows, None) is rows
    assert all(len(x) == 161 for row in finetune_dataset.trimmed(rows, 256) for x in row)  # never longer
