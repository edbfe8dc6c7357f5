"""What Megatron-LM's tools/preprocess_data.py writes for a jsonl file, made with megatron-core's
own pieces: its HuggingFaceTokenizer (AutoTokenizer underneath) and its IndexedDatasetBuilder.
The only part written here is preprocess_data.py's per-document rule (no sentence splitting):
the end of document follows a document only when the document has tokens, and a document
without tokens is recorded with no sequence. Also what megatron-core's IndexedDataset reads
from files of ours.

usage: megatron_preprocess.py JOBS.json
JOBS: a list, each {"src": INPUT.jsonl, "tokenizer": TOKENIZER_DIR, "prefix": OUTPUT_PREFIX,
"special_tokens": bool} (writes OUTPUT_PREFIX_text_document.bin/.idx; prints {"eod": id, "bos": id})
or {"read": PREFIX} (prints the token lists of its sequences); one JSON line per job, in order.
One process for them all: importing megatron-core takes ~12 s here.
"""

from __future__ import annotations

import json
import sys

from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer


def write(src: str, tokenizer_dir: str, prefix: str, include_special_tokens: bool) -> None:
    # upstream Megatron-LM builds it with include_special_tokens unless
    # --tokenizer-hf-no-include-special-tokens is given
    tokenizer = HuggingFaceTokenizer(tokenizer_dir, include_special_tokens=include_special_tokens)
    builder = IndexedDatasetBuilder(f"{prefix}_text_document.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
    with open(src, encoding="utf-8") as fh:
        for line in fh:
            ids = tokenizer.text_to_ids(json.loads(line)["text"])
            lengths = []
            if ids:
                ids = ids + [tokenizer.eod]
                lengths = [len(ids)]
            builder.add_document(ids, lengths)
    builder.finalize(f"{prefix}_text_document.idx")
    print(json.dumps({"eod": tokenizer.eod, "bos": tokenizer.bos_id}))


def read(prefix: str) -> None:
    ds = IndexedDataset(prefix)
    print(json.dumps([ds[i].tolist() for i in range(len(ds))]))


if __name__ == "__main__":
    for job in json.load(open(sys.argv[1])):
        if "read" in job:
            read(job["read"])
        else:
            write(job["src"], job["tokenizer"], job["prefix"], job["special_tokens"])
