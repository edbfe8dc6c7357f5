"""Text (jsonl, txt, parquet) -> Megatron indexed dataset, in MindSpeed-LLM's shape.

    mindspeed preprocess --input data.jsonl --output-prefix out/corpus \\
        --tokenizer-type PretrainedFromHF --tokenizer-name-or-path tok/ --append-eod --workers 2

writes out/corpus_text_document.bin/.idx (one file pair per --json-keys key).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os

from mindspeed_core.data import indexed
from mindspeed_core.data.tokenizer import build_tokenizer
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.progress import Progress


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="a .jsonl/.json/.txt/.parquet file or a folder of them")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--tokenizer-type", default=None)
    parser.add_argument("--tokenizer-name-or-path", default=None)
    parser.add_argument("--append-eod", action="store_true")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=1000)


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


def iter_records(path: str, keys: list[str]):
    """Yield {key: text} per document."""
    for file in _files(path):
        if file.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError as exc:
                raise MindSpeedError(f"reading .parquet needs a working pyarrow ({exc}); "
                                     "with numpy 1.x: pip install 'pyarrow<20'") from None
            table = pq.read_table(file, columns=keys)
            for row in table.to_pylist():
                yield row
        elif file.endswith(".txt"):
            with open(file, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if line.strip():
                        yield {keys[0]: line.rstrip("\n")}
        else:
            with open(file, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        raise MindSpeedError(f"{file}:{n} is not valid JSON") from None
                    missing = [k for k in keys if k not in rec]
                    if missing:
                        raise MindSpeedError(f"{file}:{n} has no key {missing[0]!r} (--json-keys)")
                    yield rec


_worker_state: dict = {}


def _init_worker(tokenizer_type, name_or_path, keys, append_eod):
    _worker_state.update(tok=build_tokenizer(tokenizer_type, name_or_path), keys=keys, eod=append_eod)


def _encode(record):
    tok = _worker_state["tok"]
    out = {}
    for key in _worker_state["keys"]:
        ids = tok.encode(str(record[key]))
        if _worker_state["eod"]:
            ids.append(tok.eod)
        out[key] = ids
    return out


def run(args) -> dict:
    tok = build_tokenizer(args.tokenizer_type, args.tokenizer_name_or_path)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    dtype = indexed.token_dtype(tok.vocab_size)
    writers = {k: indexed.IndexedDatasetWriter(f"{args.output_prefix}_{k}_document", dtype) for k in args.json_keys}
    init = (args.tokenizer_type, args.tokenizer_name_or_path, args.json_keys, args.append_eod)
    progress = Progress(None, "preprocess (documents)")
    counts = {"documents": 0, "tokens": 0}
    records = iter_records(args.input, args.json_keys)
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
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    progress.close()
    for w in writers.values():
        w.finalize()
    counts["outputs"] = [f"{args.output_prefix}_{k}_document" for k in args.json_keys]
    return counts
