"""Training data for ``hasten train``: read files, tokenize records, the embedded corpus."""

from hasten.data.datasets import (
    DataError,
    embedded_corpus_path,
    load_dataset,
    read_records,
    tokenize_records,
)
from hasten.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "DataError",
    "embedded_corpus_path",
    "load_dataset",
    "read_records",
    "tokenize_records",
]
