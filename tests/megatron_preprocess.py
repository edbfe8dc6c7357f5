"""What Megatron-LM's tools/preprocess_data.py writes for a jsonl file, made with megatron-core's
own pieces: its HuggingFaceTokenizer (AutoTokenizer underneath) and its IndexedDatasetBuilder.
The only part written here is preprocess_data.py's per-document rule (no sentence splitting):
the end of document follows a document only when the document has tokens, and a document
without tokens is recorded with no sequence.

usage: megatron_preprocess.py INPUT.jsonl TOKENIZER_DIR OUTPUT_PREFIX [--no-special-tokens]
Writes OUTPUT_PREFIX_text_document.bin/.idx and prints {"eod": id, "bos": id} as JSON.
"""

from __future__ import annotations

import json
import sys

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer


def main(src: str, tokenizer_dir: str, prefix: str, include_special_tokens: bool) -> None:
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], "--no-special-tokens" not in sys.argv[4:])
