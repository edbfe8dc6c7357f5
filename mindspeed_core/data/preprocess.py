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

With an instruction ``--handler-name`` (data/handlers.py) each record is a conversation or a
preference pair, written as MindSpeed-LLM writes it: out/corpus_packed_<key>_document per
key (input_ids, attention_mask, labels; or chosen_/rejected_ input_ids and labels), int32,
one sample per document. ``--seq-length S`` drops (or with ``--truncation cut`` cuts) samples
longer than S + 1 tokens; ``--pack`` puts whole samples together, each pack one document whose
sequences are its samples, so that the trainer knows where each begins.
"""

from __future__ import annotations

import argparse
import json
import itertools
import multiprocessing
import os
import re

import numpy as np

from mindspeed_core import features, files
from mindspeed_core.compat import megatron_args
from mindspeed_core.compat.megatron_args import DATA_HANDLERS, POSITIVE_INT, add_compat_args, add_tokenizer_args
from mindspeed_core.data import chat_templates, handlers, indexed, packing
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
                        help="with --pack: the training --seq-length the packs are made for; for instruction data "
                             "also the longest sample kept (--seq-length + 1 tokens, see --truncation)")
    h = parser.add_argument_group("instruction and preference data (data/handlers.py)")
    h.add_argument("--handler-name", choices=DATA_HANDLERS, default="GeneralPretrainHandler")
    chat_templates.add_args(h, "default: the tokenizer's chat template, else empty")
    h.add_argument("--map-keys", default=None,
                   help="JSON renaming the record's columns, e.g. '{\"prompt\": \"question\", \"response\": \"answer\"}'; "
                        "ShareGPT also takes \"tags\": {\"role_tag\": \"role\", ...}")
    h.add_argument("--truncation", choices=("drop", "cut"), default="drop",
                   help="a sample longer than --seq-length + 1 tokens is dropped (the default, as MindSpeed-LLM does) "
                        "or cut to that length; either is counted in the summary")
    h.add_argument("--placeholder-token", default="\u043a\u0438",
                   help="AlpacaStyleProcessRewardHandler: the token that ends each step (default 'ки')")
    h.add_argument("--reward-tokens", nargs="+", default=None,
                   help="AlpacaStyleProcessRewardHandler: the step labels allowed (e.g. + -)")
    h.add_argument("--enable-thinking", type=megatron_args.TRISTATE, default=None, help="--prompt-type qwen3: false puts an empty <think></think> before each reply, "
                                      "as Qwen3's template does when thinking is off")
    h.add_argument("--neat-pack", action="store_true",
                   help="with --pack (MindSpeed-LLM): each sample of a pack attends to itself only, as packs always do "
                        "here")
    add_compat_args(parser, skip=tuple(a for o in parser._actions for a in o.option_strings))


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


def _parquet_rows(file: str, columns: list[str] | None) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MindSpeedError(f"reading .parquet needs a working pyarrow ({exc}); "
                             "with numpy 1.x: pip install 'pyarrow<20'") from None
    try:
        return pq.read_table(file, columns=None if columns is None else list(columns)).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors (missing column, corrupt file) vary
        raise MindSpeedError(f"cannot read {file}: {str(exc).splitlines()[0]}") from None


def iter_records(path: str, keys: list[str]):
    """Yield {key: text} per document."""
    for file in _files(path):
        if file.endswith(".parquet"):
            for n, row in enumerate(_parquet_rows(file, keys), 1):
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


def iter_objects(path: str):
    """(where, record) of each JSON object of .json (an array, or one object per line),
    .jsonl and .parquet files: instruction data, whose records hold lists and objects."""
    for file in _files(path):
        if file.endswith(".txt"):
            raise MindSpeedError(f"{file}: instruction data is JSON or parquet records, not plain text")
        if file.endswith(".parquet"):
            for n, row in enumerate(_parquet_rows(file, None), 1):
                yield f"{file} row {n}", row
            continue
        with open(file, "rb") as fh:
            head = fh.read(4096).lstrip()
        if file.endswith(".json") and head[:1] == b"[":
            try:
                with open(file, encoding="utf-8") as fh:
                    rows = json.load(fh)
            except (ValueError, UnicodeDecodeError) as exc:
                raise MindSpeedError(f"{file} is not valid JSON: {exc}") from None
            for n, row in enumerate(rows):
                yield f"{file} record {n}", row
            continue
        for n, line in _lines(file):
            if not line.strip():
                continue
            try:
                yield f"{file}:{n}", json.loads(line)
            except ValueError:
                raise MindSpeedError(f"{file}:{n} is not valid JSON") from None


_worker_state: dict = {}
_CHUNK = 64  # records a worker encodes at a time


def _build_handler(tokenizer: tuple, handler_name: str, template: tuple | None, options: dict):
    """The handler a run (or a worker) encodes with; ``template`` is chat_templates.choose's
    arguments (a jinja2 template is made in each process, not pickled)."""
    tok = build_tokenizer(*tokenizer)
    chosen = chat_templates.choose(*template) if template is not None else None
    return handlers.HANDLERS[handler_name](tok, chosen, options)


def _init_worker(*spec):
    _worker_state["handler"] = _build_handler(*spec)


def _encode(item):
    where, record = item
    return _worker_state["handler"].encode(record, where)


def _stale(prefix: str) -> re.Pattern:
    """The temporaries IndexedDatasetWriter leaves for ``prefix`` when killed."""
    return re.compile(re.escape(os.path.basename(prefix)) + r"\.tmp-(?P<pid>\d+)\.(bin|idx)$")


def _stale_unpacked(output_prefix: str) -> re.Pattern:
    """The unpacked samples an --pack run of an earlier release kept under its pid when killed."""
    return re.compile(re.escape(os.path.basename(output_prefix)) + r"\.unpacked-(?P<pid>\d+)_.+\.(bin|idx)$")


def packed_prefix(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_packed_{key}_document"


def _fit(sample: dict, keys: tuple, capacity: int | None, policy: str):
    """An instruction sample within ``capacity`` tokens per sequence: as it is, cut to it
    (``--truncation cut``; None if nothing trained is left), or None (``drop``)."""
    if capacity is None or all(len(sample[k]) <= capacity for k in keys):
        return sample, None
    if policy == "drop":
        return None, "dropped"
    cut = {k: v[:capacity] for k, v in sample.items()}
    labels = [k for k in keys if k.endswith("labels")]
    if any(all(x == handlers.IGNORE for x in cut[k]) for k in labels):
        return None, "dropped"  # the cut left a side nothing to learn from
    return cut, "cut"


def run(args) -> dict:
    if args.neat_pack and not args.pack:
        raise MindSpeedError("--neat-pack qualifies --pack: give --pack --seq-length N too")
    cls = handlers.HANDLERS[args.handler_name]
    instruction = cls.instruction
    features.note_used(features.handler_feature(args.handler_name))
    if args.pack and (args.seq_length is None or not (args.append_eod or instruction)):
        # the trainer finds a pre-training pack's document boundaries at the end-of-document tokens
        raise MindSpeedError("--pack needs --seq-length (the training sequence length the packs are for) and, for "
                             "pre-training text, --append-eod (documents in a pack end with the end-of-document token)")
    if args.pack and instruction and "Pairwise" in args.handler_name:
        raise MindSpeedError(f"--pack: {args.handler_name} data is not packed (a chosen and a rejected reply train "
                             "side by side); drop --pack")
    if args.pack and getattr(cls, "prompt_only", False):
        raise MindSpeedError(f"--pack: {args.handler_name} data is not packed (each prompt is answered on its own); "
                             "drop --pack")
    tokenizer = tokenizer_args(args)
    tok = build_tokenizer(*tokenizer)
    template = None
    if instruction and "Style" in args.handler_name and "ProcessReward" not in args.handler_name:
        template = (args.prompt_type, args.hf_chat_template, args.tokenizer_name_or_path, args.enable_thinking)
    options = {"append_eod": args.append_eod, "json_keys": args.json_keys,
               "map_keys": handlers.parse_map_keys(args.map_keys), "placeholder_token": args.placeholder_token,
               "reward_tokens": args.reward_tokens}
    spec = (tokenizer, args.handler_name, template, options)
    handler = _build_handler(*spec)  # bad options fail here, before anything is written
    keys = handler.keys
    folder = os.path.dirname(os.path.abspath(args.output_prefix))
    files.check_writable(folder, f"--output-prefix {args.output_prefix}")
    _files(args.input)  # a missing input fails here, before anything is written
    records = iter_objects(args.input) if instruction else ((None, r) for r in iter_records(args.input, keys))
    created = []  # the folders this run makes, removed again if it fails
    path = folder
    while not os.path.isdir(path):
        created.append(path)
        path = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    if instruction:  # MindSpeed-LLM's names, packed or not; -100 labels need a signed type
        finals = {k: packed_prefix(args.output_prefix, k) for k in keys}
        # packed: the samples are written first as temporaries only, the packs made from them
        prefixes = ({k: f"{args.output_prefix}_{k}_unpacked" for k in keys} if args.pack else finals)
        dtype = np.int32
    else:
        prefixes = {k: f"{args.output_prefix}_{k}_document" for k in keys}
        finals = {k: packed_prefix(args.output_prefix, k) for k in keys} if args.pack else {}
        dtype = indexed.token_dtype(tok.vocab_size)
    journal = args.output_prefix + files.JOURNAL_SUFFIX  # the outputs are published together
    files.finish_publishing(folder)  # an earlier run killed while publishing is completed first
    for prefix in (*prefixes.values(), *finals.values()):
        files.remove_stale(folder, _stale(prefix))
    files.remove_stale(folder, _stale_unpacked(args.output_prefix))
    writers = {k: indexed.IndexedDatasetWriter(p, dtype) for k, p in prefixes.items()}
    capacity = args.seq_length + 1 if instruction and args.seq_length is not None else None
    progress = Progress(None, "preprocess (documents)")
    counts = {"documents": 0, "tokens": 0}
    renames = []  # (temporary, final) of the outputs, published together at the end
    pool = None
    try:
        # a pool only for an input worth it: under two chunks of records, starting the workers
        # (each loading the tokenizer; about a second for 4) costs more than they save
        head = list(itertools.islice(records, 2 * _CHUNK)) if args.workers > 1 else []
        records = itertools.chain(head, records)
        if len(head) == 2 * _CHUNK:
            pool = multiprocessing.get_context("spawn").Pool(args.workers, _init_worker, spec)
            encoded = pool.imap(_encode, records, chunksize=_CHUNK)
        else:
            _worker_state["handler"] = handler
            encoded = map(_encode, records)
        for doc in encoded:  # imap keeps input order, so the output is the same for any --workers
            doc, change = _fit(doc, keys, capacity, args.truncation) if instruction else (doc, None)
            if change is not None:
                counts[change] = counts.get(change, 0) + 1
            if doc is None:
                continue
            for key, ids in doc.items():
                writers[key].add_document(ids)
                if not instruction or key.endswith("input_ids"):  # not the labels and masks again
                    counts["tokens"] += len(ids)
            counts["documents"] += 1
            progress.update(1, f"{counts['tokens']} tokens")
        if instruction and not counts["documents"]:
            raise MindSpeedError(f"no sample of {args.input} is left: all {counts.get('dropped', 0)} were longer than "
                                 f"--seq-length {args.seq_length} + 1 tokens" if counts.get("dropped")
                                 else f"{args.input} holds no records")
        # every key's files complete as temporaries, then all published in one step: a run killed
        # at any point leaves the old outputs or the new ones, never some of each
        samples = [rename for w in writers.values() for rename in w.finalize(publish=False)]
        renames += [] if instruction and args.pack else samples  # packed instruction data: the packs only
        if args.pack:
            for key, w in writers.items():
                stats, packed = packing.pack_dataset(w.temp_prefix, finals[key], args.seq_length + 1, publish=False)
                counts.setdefault("packing", {})[key] = stats
                renames += packed
        files.publish_together(renames, journal)
        for temporary, final in samples:
            if instruction and args.pack:  # the unpacked samples were a step towards the packs
                os.remove(temporary)
        progress.close()  # its last line only on success: a failure is the one error line
    except BaseException:
        if os.path.exists(journal):  # interrupted while publishing: finish it, it is all written
            files.finish_publishing(folder)
        for w in writers.values():
            w.abort()  # nothing half-written stays behind
        for temporary, _ in renames:
            if os.path.exists(temporary):
                os.remove(temporary)
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
    if instruction:
        counts["outputs"] = list(finals.values())
        if template is not None:
            counts["template"] = handler.template.name
    else:
        counts["outputs"] = list(prefixes.values()) + list(finals.values())
    writes_eod = args.append_eod or (template is not None and not handler.template.writes_reply_end)
    counts["end_of_document"] = f"{tok.eod_source}, id {tok.eod}" if writes_eod else None
    return counts
