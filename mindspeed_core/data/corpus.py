"""The embedded default corpus: the Python standard library's own source files.

Present offline on every machine that runs Python, real text (code and prose in comments
and docstrings), and large enough for a small model to learn from. Built once into a
Megatron indexed dataset with the byte-level tokenizer and cached.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig

from mindspeed_core.data import indexed
from mindspeed_core.data.handlers import document_ids
from mindspeed_core.data.tokenizer import ByteTokenizer

FORMAT = 2  # part of the cache key: 2 = empty files add no sequence (Megatron's rule)


def stdlib_files(limit_bytes: int) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
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
