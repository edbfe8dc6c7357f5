"""Tokenizers, Megatron indexed datasets, preprocessing, splits and blends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mindspeed_core.data import gpt_dataset, indexed, preprocess
from mindspeed_core.data.tokenizer import ByteTokenizer, build_tokenizer, padded_vocab_size
from mindspeed_core.errors import MindSpeedError

DOCS = ["hello world", "second document, with ünïcode", "x" * 50, "the end"]


def write_jsonl(path, docs, key="text"):
    with open(path, "w") as fh:
        for d in docs:
            fh.write(json.dumps({key: d}) + "\n")


def preprocess_args(inp, prefix, workers=1, **extra):
    import argparse

    parser = argparse.ArgumentParser()
    preprocess.add_args(parser)
    argv = ["--input", str(inp), "--output-prefix", str(prefix), "--append-eod", "--workers", str(workers)]
    for k, v in extra.items():  # a value of "" is a switch
        argv += [f"--{k.replace('_', '-')}"] + ([str(v)] if v != "" else [])
    return parser.parse_args(argv)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("añb")
    assert ids == [97, 195, 177, 98] and tok.decode(ids + [tok.eod]) == "añb"
    assert padded_vocab_size(tok.vocab_size) == 384 and padded_vocab_size(257, 8) == 264


def test_hf_tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = build_tokenizer("PretrainedFromHF", str(tmp_path))
    assert ours.eod == tok.token_to_id("</s>") and ours.vocab_size == tok.get_vocab_size()
    assert ours.decode(ours.encode("hello world")).strip() == "hello world"
    with pytest.raises(MindSpeedError, match="no tokenizer.json"):
        build_tokenizer("PretrainedFromHF", str(tmp_path / "nowhere"))
    with pytest.raises(MindSpeedError, match="unknown --tokenizer-type"):
        build_tokenizer("SentencePiece", None)


def test_indexed_dataset_round_trip(tmp_path):
    prefix = str(tmp_path / "ds")
    w = indexed.IndexedDatasetWriter(prefix, np.uint16)
    docs = [[1, 2, 3], [], [7] * 5, [65000, 4]]
    for d in docs:
        w.add_document(d)
    w.finalize()
    ds = indexed.IndexedDataset(prefix)
    assert len(ds) == 3 and ds.dtype == np.uint16  # the empty document adds no sequence
    for i, d in enumerate(d for d in docs if d):
        assert ds[i].tolist() == d
    assert ds.tokens(1, 3).tolist() == [7] * 5 + [65000, 4]
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 3]


@pytest.fixture(scope="module")
def megatron_made(tmp_path_factory):
    """One process of megatron-core (megatron_preprocess.py; it imports torch, which this
    process may not): what Megatron's preprocessing writes for PARITY_DOCS with and without the
    tokenizer's special tokens, and what its IndexedDataset reads from our files of DOCS.
    Returns (folder, the tokenizer's special ids, {job: its printed JSON})."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("megatron")
    ids = _llama_style_tokenizer(root / "tok")
    write_jsonl(root / "parity.jsonl", PARITY_DOCS)
    write_jsonl(root / "docs.jsonl", DOCS)
    preprocess.run(preprocess_args(root / "docs.jsonl", root / "ours-docs"))
    jobs = {"read": {"read": str(root / "ours-docs_text_document")}}
    for special in (True, False):
        jobs[special] = {"src": str(root / "parity.jsonl"), "tokenizer": str(root / "tok"),
                         "prefix": str(root / f"megatron-{special}"), "special_tokens": special}
    (root / "jobs.json").write_text(json.dumps(list(jobs.values())))
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "megatron_preprocess.py"), str(root / "jobs.json")],
                         capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "MINDSPEED_AI_FRAMEWORK"})
    assert out.returncode == 0, out.stderr[-3000:]
    return root, ids, dict(zip(jobs, map(json.loads, out.stdout.strip().splitlines()[-len(jobs):])))


@pytest.mark.framework_free
def test_megatron_core_reads_our_files(megatron_made):
    tok = ByteTokenizer()
    assert megatron_made[2]["read"] == [tok.encode(d) + [tok.eod] for d in DOCS]


@pytest.mark.feature("handler-general-pretrain")
@pytest.mark.parametrize("fmt", ["jsonl", "txt", "parquet"])
def test_preprocess_formats_and_workers(tmp_path, fmt):
    docs = DOCS * 40  # 160: past the 128 records under which no worker pool is started
    if fmt == "jsonl":
        src = tmp_path / "d.jsonl"
        write_jsonl(src, docs)
    elif fmt == "txt":
        src = tmp_path / "d.txt"
        src.write_text("\n".join(docs) + "\n\n")
    else:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        src = tmp_path / "d.parquet"
        pq.write_table(pa.table({"text": docs}), str(src))
    one = preprocess.run(preprocess_args(src, tmp_path / "one"))
    two = preprocess.run(preprocess_args(src, tmp_path / "two", workers=2))
    assert one["documents"] == len(docs) and one["tokens"] == two["tokens"]
    assert (tmp_path / "one_text_document.bin").read_bytes() == (tmp_path / "two_text_document.bin").read_bytes()
    assert (tmp_path / "one_text_document.idx").read_bytes() == (tmp_path / "two_text_document.idx").read_bytes()


def test_preprocess_bad_input(tmp_path):
    with pytest.raises(MindSpeedError, match="does not exist"):
        preprocess.run(preprocess_args(tmp_path / "missing.jsonl", tmp_path / "o"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(MindSpeedError, match="bad.jsonl:2 is not valid JSON"):
        preprocess.run(preprocess_args(bad, tmp_path / "o"))
    nokey = tmp_path / "nokey.jsonl"
    write_jsonl(nokey, DOCS, key="content")
    with pytest.raises(MindSpeedError, match="no key 'text'"):
        preprocess.run(preprocess_args(nokey, tmp_path / "o"))


def _dataset(tmp_path, name, docs):
    src = tmp_path / f"{name}.jsonl"
    write_jsonl(src, docs)
    preprocess.run(preprocess_args(src, tmp_path / name))
    return str(tmp_path / f"{name}_text_document")


def test_samples_splits_and_blends_are_deterministic(tmp_path):
    a = _dataset(tmp_path, "a", [f"doc a{i} " * 8 for i in range(40)])
    b = _dataset(tmp_path, "b", [f"doc b{i} " * 8 for i in range(40)])
    splits = gpt_dataset.build_splits([a], "90,10,0", 16, seed=3)
    assert splits["test"] is None and splits["valid"] is not None
    first = gpt_dataset.batch(splits["train"], range(4))
    assert first.shape == (4, 17)
    again = gpt_dataset.build_splits([a], "90,10,0", 16, seed=3)
    np.testing.assert_array_equal(gpt_dataset.batch(again["train"], range(4)), first)
    other_seed = gpt_dataset.build_splits([a], "90,10,0", 16, seed=4)
    assert not np.array_equal(gpt_dataset.batch(other_seed["train"], range(4)), first)
    # past one epoch the samples keep coming, in a new order
    train = splits["train"]
    count = train.parts[0][1].count
    assert sorted(map(tuple, (train[i] for i in range(count)))) == sorted(map(tuple, (train[count + i] for i in range(count))))
    blend = gpt_dataset.build_splits(["0.75", a, "0.25", b], "100,0,0", 16, seed=3)["train"]
    blend[399]  # builds the blending index that far
    assert abs(np.mean(blend._which[:400] == 0) - 0.75) < 0.01
    with pytest.raises(MindSpeedError, match="weight/prefix pairs"):
        gpt_dataset.parse_data_path(["0.5", a, "0.5"])
    with pytest.raises(MindSpeedError, match="does not exist"):
        gpt_dataset.build_splits([str(tmp_path / "nothing")], "1,0,0", 16, 1)
    with pytest.raises(MindSpeedError, match="too few for one sample"):
        gpt_dataset.build_splits([a], "90,10,0", 100000, 1)


def test_truncated_index_is_a_clear_error(tmp_path):
    prefix = _dataset(tmp_path, "t", DOCS)
    with open(prefix + ".idx", "r+b") as fh:
        fh.truncate(30)
    with pytest.raises(MindSpeedError):
        indexed.IndexedDataset(prefix)
    with open(prefix + ".idx", "wb") as fh:
        fh.write(b"garbage!" * 8)
    with pytest.raises(MindSpeedError, match="bad magic"):
        indexed.IndexedDataset(prefix)


# Megatron parity: the documents a careful reviewer would try, and a tokenizer whose config
# names </s> the end of document while <|endoftext|> is in the vocabulary too, and whose
# post-processor puts <s> before every document (as Llama's does).
PARITY_DOCS = [
    "def add(a, b):\n    \"\"\"Sum.\"\"\"\n    return a + b\n",
    "中文的句子，日本語の文、한국어 문장.",
    "family 👩‍👩‍👧‍👦 and flags 🇯🇵 with ZWJ",
    "שלום עולם مرحبا بالعالم",
    "line one\u2028line two\u2029para",
    "literal </s> and <|endoftext|> and <s> inside the text",
    "   \t  ",
    "",
    "the long one " * 400,
    "",
    "last",
]


def _llama_style_tokenizer(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    special = ["<unk>", "<s>", "</s>", "<|endoftext|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(PARITY_DOCS * 5, trainers.BpeTrainer(
        vocab_size=500, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "unk_token": "<unk>",
        # an AddedToken object, as transformers writes it
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}}))
    return {t: tok.token_to_id(t) for t in special}


@pytest.mark.framework_free
@pytest.mark.parametrize("special_tokens", [True, False], ids=["special-tokens", "no-special-tokens"])
def test_preprocess_writes_what_megatron_writes(tmp_path, megatron_made, special_tokens):
    root, ids, printed = megatron_made
    extra = {} if special_tokens else {"tokenizer_hf_no_include_special_tokens": ""}
    args = preprocess_args(root / "parity.jsonl", tmp_path / "ours", tokenizer_name_or_path=root / "tok", **extra)
    counts = preprocess.run(args)
    assert counts["end_of_document"] == "'</s>', the eos_token of tokenizer_config.json, id %d" % ids["</s>"]
    assert printed[special_tokens] == {"eod": ids["</s>"], "bos": ids["<s>"]}
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours_text_document{ext}").read_bytes() == \
            (root / f"megatron-{special_tokens}_text_document{ext}").read_bytes(), ext

    # the three rules, read back from our files
    ds = indexed.IndexedDataset(str(tmp_path / "ours_text_document"))
    sequences = [ds[i].tolist() for i in range(len(ds))]
    assert all(s[-1] == ids["</s>"] and ids["<|endoftext|>"] not in (s[0], s[-1]) for s in sequences)
    assert all((s[0] == ids["<s>"]) == special_tokens for s in sequences)
    empty = PARITY_DOCS.count("")
    if special_tokens:  # "" encodes to <s>: a document with a token, so it ends with </s>
        assert len(ds) == len(PARITY_DOCS) and [ids["<s>"], ids["</s>"]] in sequences
    else:  # "" has no tokens: no sequence, and its document repeats the next start index
        assert len(ds) == len(PARITY_DOCS) - empty
        starts = ds.document_indices.tolist()
        assert len(starts) == len(PARITY_DOCS) + 1 and len(set(starts)) == len(starts) - empty
    # the literal strings in the text are the special tokens, as in Megatron (HF's added tokens)
    literal = sequences[PARITY_DOCS.index("literal </s> and <|endoftext|> and <s> inside the text")]
    assert literal.count(ids["</s>"]) == 2 and ids["<|endoftext|>"] in literal


def test_tokenizer_end_of_document_comes_from_its_config(tmp_path):
    pytest.importorskip("tokenizers")
    ids = _llama_style_tokenizer(tmp_path)
    tok = build_tokenizer("PretrainedFromHF", str(tmp_path))
    assert (tok.eod, tok.bos) == (ids["</s>"], ids["<s>"])
    assert tok.encode("last")[0] == ids["<s>"]
    assert build_tokenizer("PretrainedFromHF", str(tmp_path), include_special_tokens=False).encode("last")[0] != ids["<s>"]
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"sep_token": "<|endoftext|>"}))  # no eos_token: Megatron takes sep_token
    assert build_tokenizer("PretrainedFromHF", str(tmp_path)).eod == ids["<|endoftext|>"]
    config.write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(MindSpeedError, match="names '<|im_end|>' as the end of document"):
        build_tokenizer("PretrainedFromHF", str(tmp_path))
    config.write_text("{broken")
    with pytest.raises(MindSpeedError, match="cannot read .*tokenizer_config.json"):
        build_tokenizer("PretrainedFromHF", str(tmp_path))
    config.unlink()  # no config at all: the usual names, and the choice is said
    tok = build_tokenizer("PretrainedFromHF", str(tmp_path))
    assert tok.eod == ids["<|endoftext|>"] and "no eos_token" in tok.eod_source


def test_sampler_reads_each_global_batch_as_megatron_single_does():
    """Step i's global batch [16i, 16i + 16), read in rounds of micro-batch x DP samples, rank r
    the r-th micro-batch of each round (MegatronPretrainingSampler's order)."""
    from mindspeed_core.data.sampler import PretrainingSampler

    for dp in (1, 2, 4):
        samplers = [PretrainingSampler(16, 2, dp, r) for r in range(dp)]
        for it in (0, 3):
            got = [s.micro_batches(it) for s in samplers]
            assert all(len(rank) == 8 // dp for rank in got)
            rounds = [[i for rank in got for i in rank[k]] for k in range(8 // dp)]  # round k: rank 0's, rank 1's, ...
            assert [i for r in rounds for i in r] == list(range(16 * it, 16 * it + 16))
    assert PretrainingSampler(8, 1, 2, 1).micro_batches(1) == [[9], [11], [13], [15]]
    with pytest.raises(ValueError, match="not a multiple"):
        PretrainingSampler(12, 4, 2, 0)


@pytest.mark.framework_free
@pytest.mark.feature("dataloader-cyclic")
def test_cyclic_sampler_reshuffles_each_ranks_bucket_every_epoch():
    """--dataloader-type cyclic: the run's samples (here 5 steps of 16, less no remainder) cut into
    a bucket per DP rank; each epoch every rank reads its whole bucket once, in a new order; a
    sampler made at any step (a resumed run) reads what the first one read."""
    from mindspeed_core.data import sampler

    steps, per_epoch = 5, 16 * 5
    for dp in (1, 2, 4):
        ranks = [sampler.for_run("cyclic", 16, 2, dp, r, steps) for r in range(dp)]
        epochs = [[[i for it in range(e * steps, (e + 1) * steps) for rows in s.micro_batches(it) for i in rows]
                   for s in ranks] for e in range(2)]
        for r in range(dp):
            bucket = list(range(r * per_epoch // dp, (r + 1) * per_epoch // dp))
            assert sorted(epochs[0][r]) == bucket and sorted(epochs[1][r]) == bucket
            assert epochs[0][r] != bucket and epochs[1][r] != epochs[0][r]  # shuffled, and anew
        fresh = sampler.for_run("cyclic", 16, 2, dp, dp - 1, steps)
        assert fresh.micro_batches(7) == ranks[dp - 1].micro_batches(7)
    # a remainder of less than a round (micro-batch x DP) is left out of every epoch, as Megatron's
    odd = sampler.CyclicSampler(4, 1, 2, 0, total=9)
    assert odd.bucket == 4 and sorted(i for it in range(2) for rows in odd.micro_batches(it) for i in rows) == [0, 1, 2, 3]
    assert isinstance(sampler.for_run(None, 16, 2, 1, 0, steps), sampler.PretrainingSampler)
