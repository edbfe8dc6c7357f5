"""The embedded default corpora, from the Python standard library's own source files.

Present offline on every machine that runs Python, real text (code and prose in comments
and docstrings), and large enough for a small model to learn from. Built once into Megatron
indexed datasets with the byte-level tokenizer and cached:

- pre-training (``mindspeed train``): the source files, a document each;
- fine-tuning (``mindspeed train --stage sft``): questions about the library's public
  functions and classes ("What does json.dumps do?"), answered by the first sentences of their
  docstrings, as ChatML conversations packed for the run's --seq-length.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sysconfig

from mindspeed_core.compat.megatron_args import ArgumentParser
from mindspeed_core.data import indexed, preprocess
from mindspeed_core.data.handlers import document_ids
from mindspeed_core.data.tokenizer import ByteTokenizer

FORMAT = 2  # part of the cache key: 2 = empty files add no sequence (Megatron's rule)


def stdlib_files(limit_bytes: int) -> list[str]:
    root = stdlib_root()
    files, total = [], 0
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib", "__pycache__"))
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                files.append(path)
                total += os.path.getsize(path)
                if total >= limit_bytes:
                    return files
    return files


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mindspeed-core")


def build_stdlib_corpus(limit_bytes: int = 4 * 2**20, folder: str | None = None) -> str:
    """Returns the dataset prefix, building it when missing."""
    files = stdlib_files(limit_bytes)
    listing = [f"format {FORMAT}"] + [f"{f}:{os.path.getsize(f)}" for f in files]
    key = hashlib.sha1("\n".join(listing).encode()).hexdigest()[:12]
    folder = folder or cache_dir()
    prefix = os.path.join(folder, f"stdlib-bytes-{key}_text_document")
    if os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin"):
        return prefix
    os.makedirs(folder, exist_ok=True)
    tok = ByteTokenizer()
    writer = indexed.IndexedDatasetWriter(prefix, indexed.token_dtype(tok.vocab_size))
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as fh:
            writer.add_document(document_ids(tok, fh.read(), append_eod=True))
    writer.finalize()
    return prefix


INSTRUCTION_TEMPLATE = "chatml"  # what the fine-tuning twin trains, and its chat command names


def _first_sentences(doc: str, limit: int = 160) -> str | None:
    """A docstring's first paragraph, whitespace collapsed, cut after the last sentence that
    ends within ``limit`` characters (None when even the first is longer, or there is none)."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", paragraph) if m.end() <= limit]
    return paragraph[:ends[-1]] if ends else None


def stdlib_instructions(limit_bytes: int = 4 * 2**20) -> list[dict]:
    """Alpaca records: "What does module.name do?" for each public top-level function and
    class of the library's files (read with ast, nothing imported) whose docstring opens with
    a short sentence; the answer is that sentence (or two)."""
    root, records = stdlib_root(), []
    for path in stdlib_files(limit_bytes):
        module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        if any(part.startswith("_") for part in module.split(".")):
            continue
        try:
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                answer = _first_sentences(ast.get_docstring(node) or "")
                if answer:
                    records.append({"instruction": f"What does {module}.{node.name} do?", "output": answer})
    return records


def build_stdlib_instructions(seq_length: int, folder: str | None = None) -> str:
    """The fine-tuning twin's data (stdlib_instructions, ChatML, packed for ``seq_length``);
    returns its --data-path prefix, building it when missing."""
    records = stdlib_instructions()
    text = "\n".join(json.dumps(r, sort_keys=True) for r in records)
    key = hashlib.sha1(f"format {FORMAT} {INSTRUCTION_TEMPLATE} {seq_length}\n{text}".encode()).hexdigest()[:12]
    folder = folder or cache_dir()
    prefix = os.path.join(folder, f"stdlib-instructions-{key}")
    if all(os.path.exists(f"{prefix}_packed_{k}_document{e}") for k in ("input_ids", "labels") for e in (".bin", ".idx")):
        return prefix
    os.makedirs(folder, exist_ok=True)
    source = f"{prefix}.{os.getpid()}.jsonl"
    with open(source, "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    parser = ArgumentParser()
    preprocess.add_args(parser)
    try:
        preprocess.run(parser.parse_args(["--input", source, "--output-prefix", prefix, "--handler-name",
                                          "AlpacaStyleInstructionHandler", "--prompt-type", INSTRUCTION_TEMPLATE,
                                          "--seq-length", str(seq_length), "--pack"]))
    finally:
        os.remove(source)
    return prefix
