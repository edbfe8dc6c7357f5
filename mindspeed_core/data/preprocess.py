"""Text (jsonl, txt, parquet) -> Megatron indexed dataset, in MindSpeed-LLM's shape.

    mindspeed preprocess --input data.jsonl --output-prefix out/corpus \\
        --tokenizer-type PretrainedFromHF --tokenizer-name-or-path tok/ --append-eod --workers 2

writes out/corpus_text_document.bin/.idx (one file pair per --json-keys key), byte for byte
what Megatron-LM's tools/preprocess_data.py writes from the same input and tokenizer: text
encoded with the tokenizer's special tokens (--tokenizer-hf-no-include-special-tokens turns
them off), the tokenizer's own end of document after each document that has tokens, and
an empty document recorded with no sequence.

With ``--pack --seq-length S`` it also writes out/corpus_packed_text_document: the same
documents packed whole into samples of S + 1 tokens (see data/packing.py), which the
trainer reads one pack per sample.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re

from mindspeed_core import files
from mindspeed_core.compat.megatron_args import POSITIVE_INT, add_tokenizer_args
from mindspeed_core.data import indexed, packing
from mindspeed_core.data.tokenizer import build_tokenizer, tokenizer_args
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.progress import Progress


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="a .jsonl/.json/.txt/.parquet file or a folder of them")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    add_tokenizer_args(parser)
    parser.add_argument("--append-eod", action="store_true")
    parser.add_argument("--workers", type=POSITIVE_INT, default=1)
    parser.add_argument("--log-interval", type=POSITIVE_INT, default=1000)
    parser.add_argument("--pack", action="store_true",
                        help="also write the documents packed whole into samples of --seq-length + 1 tokens")
    parser.add_argument("--seq-length", type=POSITIVE_INT, default=None,
                        help="with --pack: the training --seq-length the packs are made for")


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        found = sorted(os.path.join(root, f) for root, _, names in os.walk(path) for f in names
                       if f.endswith((".jsonl", ".json", ".txt", ".parquet")))
        if not found:
            raise MindSpeedError(f"{path} holds no .jsonl, .json, .txt or .parquet files")
        return found
    if not os.path.isfile(path):
        raise MindSpeedError(f"input {path} does not exist")
    return [path]


def _lines(file: str):
    """(line number, text) of a UTF-8 file; a line that is not UTF-8 is a clear error."""
    with open(file, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise MindSpeedError(f"{file}:{n} is not UTF-8 text (byte {raw[exc.start]:#04x} at column "
                                     f"{exc.start + 1}); convert the file to UTF-8") from None


def _text(value, where: str, key: str) -> str:
    """A document's text: a string that UTF-8 can encode (JSON can carry lone surrogates)."""
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise MindSpeedError(f"{where}: {key!r} is {kind}, not text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise MindSpeedError(f"{where}: {key!r} holds a lone surrogate ({value[exc.start]!r} at character "
                             f"{exc.start}), which is not text") from None
    return value


def iter_records(path: str, keys: list[str]):
    """Yield {key: text} per document."""
    for file in _files(path):
        if file.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError as exc:
                raise MindSpeedError(f"reading .parquet needs a working pyarrow ({exc}); "
                                     "with numpy 1.x: pip install 'pyarrow<20'") from None
            try:
                table = pq.read_table(file, columns=keys)
            except Exception as exc:  # noqa: BLE001 - pyarrow's errors (missing column, corrupt file) vary
                raise MindSpeedError(f"cannot read {file}: {str(exc).splitlines()[0]}") from None
            for n, row in enumerate(table.to_pylist(), 1):
                yield {k: _text(row[k], f"{file} row {n}", k) for k in keys}
        elif file.endswith(".txt"):
            for n, line in _lines(file):
                if line.strip():
                    yield {keys[0]: _text(line.rstrip("\n"), f"{file}:{n}", keys[0])}
        else:
            for n, line in _lines(file):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    raise MindSpeedError(f"{file}:{n} is not valid JSON") from None
                if not isinstance(rec, dict):
                    raise MindSpeedError(f"{file}:{n} is a JSON {type(rec).__name__}, not an object with "
                                         f"{keys[0]!r}")
                missing = [k for k in keys if k not in rec]
                if missing:
                    raise MindSpeedError(f"{file}:{n} has no key {missing[0]!r} (--json-keys)")
                yield {k: _text(rec[k], f"{file}:{n}", k) for k in keys}


_worker_state: dict = {}


def _init_worker(tokenizer, keys, append_eod):
    _worker_state.update(tok=build_tokenizer(*tokenizer), keys=keys, eod=append_eod)


def document_ids(tok, text: str, append_eod: bool) -> list[int]:
    """A document's tokens as Megatron's preprocess_data.py writes them: the end of document
    follows only a document that has tokens (an empty one stays empty and adds no sequence)."""
    ids = tok.encode(text)
    return ids + [tok.eod] if ids and append_eod else ids


def _encode(record):
    tok = _worker_state["tok"]
    return {key: document_ids(tok, record[key], _worker_state["eod"]) for key in _worker_state["keys"]}


def _stale(prefix: str) -> re.Pattern:
    """The temporaries IndexedDatasetWriter leaves for ``prefix`` when killed."""
    return re.compile(re.escape(os.path.basename(prefix)) + r"\.tmp-(?P<pid>\d+)\.(bin|idx)$")


def packed_prefix(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_packed_{key}_document"


def run(args) -> dict:
    if args.pack and (args.seq_length is None or not args.append_eod):
        # the trainer finds a pack's document boundaries at the end-of-document tokens
        raise MindSpeedError("--pack needs --seq-length (the training sequence length the packs are for) and "
                             "--append-eod (documents in a pack end with the end-of-document token)")
    tok = build_tokenizer(*tokenizer_args(args))
    folder = os.path.dirname(os.path.abspath(args.output_prefix))
    files.check_writable(folder, f"--output-prefix {args.output_prefix}")
    _files(args.input)  # a missing input fails here, before anything is written
    records = iter_records(args.input, args.json_keys)
    created = []  # the folders this run makes, removed again if it fails
    path = folder
    while not os.path.isdir(path):
        created.append(path)
        path = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    prefixes = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    for prefix in prefixes.values():
        files.remove_stale(folder, _stale(prefix))
    dtype = indexed.token_dtype(tok.vocab_size)
    writers = {k: indexed.IndexedDatasetWriter(p, dtype) for k, p in prefixes.items()}
    init = (tokenizer_args(args), args.json_keys, args.append_eod)
    progress = Progress(None, "preprocess (documents)")
    counts = {"documents": 0, "tokens": 0}
    if args.workers > 1:
        pool = multiprocessing.get_context("spawn").Pool(args.workers, _init_worker, init)
        encoded = pool.imap(_encode, records, chunksize=64)
    else:
        pool = None
        _init_worker(*init)
        encoded = map(_encode, records)
    try:
        for doc in encoded:  # imap keeps input order, so the output is the same for any --workers
            for key, ids in doc.items():
                writers[key].add_document(ids)
                counts["tokens"] += len(ids)
            counts["documents"] += 1
            progress.update(1, f"{counts['tokens']} tokens")
        for w in writers.values():
            w.finalize()
        if args.pack:
            for key, prefix in prefixes.items():
                target = packed_prefix(args.output_prefix, key)
                counts.setdefault("packing", {})[key] = packing.pack_dataset(prefix, target, args.seq_length + 1)
        progress.close()  # its last line only on success: a failure is the one error line
    except BaseException:
        for w in writers.values():
            w.abort()  # nothing half-written stays behind
        if pool is not None:
            pool.terminate()
        for path in created:  # deepest first; only while empty
            if not os.listdir(path):
                os.rmdir(path)
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    counts["outputs"] = list(prefixes.values())
    if args.pack:
        counts["outputs"] += [packed_prefix(args.output_prefix, k) for k in args.json_keys]
    counts["end_of_document"] = f"{tok.eod_source}, id {tok.eod}" if args.append_eod else None
    return counts
