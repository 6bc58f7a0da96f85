"""Megatron-compatible indexed datasets (.bin tokens + .idx index): written in bulk, read memory-mapped.

The .idx layout is Megatron-Core's (and MindFormers' copy of it): the magic b"MMIDIDX\\x00\\x00", <Q version 1,
<B dtype code, <Q sequence count, <Q document count, then int32 sequence lengths, int64 byte pointers into the .bin,
int64 document boundaries (indices into the sequences). Files written here read back through MindFormers'
`IndexedDataset` and vice versa (tests/test_data_indexed.py). One sequence per document, as Megatron's
preprocess_data.py writes by default; a document of several sequences is read as their concatenation.

Nothing here reads a whole file into memory: the index arrays and the tokens are numpy memmaps, so a process pays
only for the pages it touches.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from data_sched.errors import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"   # Megatron's magic, then <Q version 1, <B dtype code
_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8
# Megatron's DType codes (megatron/core/datasets/indexed_dataset.py)
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
           8: np.uint16}
_CODES = {np.dtype(v): k for k, v in _DTYPES.items()}


def token_dtype(vocab_size: int) -> type:
    """uint16 while ids fit (half the bytes), else int32: Megatron's `DType.optimal_dtype`."""
    return np.uint16 if vocab_size < 65500 else np.int32


def prefix_of(path: str) -> str:
    """`data/corpus.bin`, `data/corpus.idx` and `data/corpus` all name the dataset `data/corpus`."""
    return path[:-4] if path.endswith((".bin", ".idx")) else path


class IndexWriter:
    """Appends documents to `<prefix>.bin/.idx` under temporary names; `commit()` renames both into place.

    Documents go in batches (`add`: one flat token array and the documents' lengths), so a generator of billions of
    tokens writes at disk speed; only the index's lengths stay in memory until the end.
    """

    def __init__(self, prefix: str, vocab_size: int):
        self.prefix, self.vocab_size, self.dtype = prefix, vocab_size, np.dtype(token_dtype(vocab_size))
        self.tmp_bin, self.tmp_idx = f"{prefix}.bin.tmp{os.getpid()}", f"{prefix}.idx.tmp{os.getpid()}"
        self._bin = open(self.tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []
        self.documents = self.tokens = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        tokens, lengths = np.asarray(tokens).reshape(-1), np.asarray(lengths, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"{tokens.size} tokens but document lengths summing to {int(lengths.sum())}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            bad = int(np.searchsorted(np.cumsum(lengths), np.argmax((tokens < 0) | (tokens >= self.vocab_size)),
                                      side="right"))
            raise DataError(f"{self.prefix}: token id outside [0, {self.vocab_size}) in document "
                            f"{self.documents + bad}")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(lengths.astype(np.int32))
        self.documents += len(lengths)
        self.tokens += tokens.size

    def commit(self) -> tuple[int, int]:
        """Write the index, rename both files into place; returns (documents, tokens)."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self.tmp_idx, "wb") as f:
            f.write(INDEX_HEADER)
            f.write(np.array([1], "<u8").tobytes() + bytes([_CODES[self.dtype]]))
            f.write(np.array([len(lengths), len(lengths) + 1], "<u8").tobytes())
            f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
        os.replace(self.tmp_bin, f"{self.prefix}.bin")
        os.replace(self.tmp_idx, f"{self.prefix}.idx")
        return self.documents, self.tokens

    def discard(self) -> None:
        self._bin.close()
        for tmp in (self.tmp_bin, self.tmp_idx):
            Path(tmp).unlink(missing_ok=True)


def write_indexed_dataset(prefix: str, docs: Iterable[np.ndarray], vocab_size: int) -> tuple[int, int]:
    """Write `<prefix>.bin/.idx` (to temporary names, then renamed); returns (documents, tokens)."""
    writer = IndexWriter(prefix, vocab_size)
    try:
        for doc in docs:
            arr = np.asarray(doc)
            writer.add(arr, [arr.size])
        return writer.commit()
    finally:
        writer.discard()


@dataclass(frozen=True)
class IndexedDataset:
    """An indexed dataset opened memory-mapped; opening touches O(1) pages whatever the corpus's size."""
    prefix: str
    tokens: np.ndarray          # the whole .bin, in its dtype (a memmap)
    seq_lengths: np.ndarray     # int32 [S] (a memmap)
    doc_bounds: np.ndarray      # int64 [D+1]: document d is sequences doc_bounds[d]..doc_bounds[d+1] (a memmap)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def documents(self) -> tuple[np.ndarray, np.ndarray]:
        """(first token, length) of every document, int64 [D] each: computed in memory (index building only)."""
        bounds = np.asarray(self.doc_bounds)
        if (np.diff(bounds) < 0).any():
            raise _corrupt(self.prefix, "document boundaries")
        seq_ends = np.zeros(len(self.seq_lengths) + 1, dtype=np.int64)
        np.cumsum(self.seq_lengths, out=seq_ends[1:])
        starts = seq_ends[bounds[:-1]]
        return starts, seq_ends[bounds[1:]] - starts


def _corrupt(prefix: str, why: str) -> DataError:
    return DataError(f"{prefix}.idx: corrupt indexed dataset index ({why})")


def open_indexed_dataset(path: str) -> IndexedDataset:
    """Open `<prefix>.bin/.idx` memory-mapped; one-line DataError for missing, foreign, truncated or corrupt files."""
    prefix = prefix_of(path)
    for name in (f"{prefix}.idx", f"{prefix}.bin"):
        if not Path(name).is_file():
            raise DataError(f"{name}: indexed dataset file not found")
    idx_size = os.path.getsize(f"{prefix}.idx")
    with open(f"{prefix}.idx", "rb") as f:
        head = f.read(_HEADER_BYTES)
    if len(head) < len(INDEX_HEADER) + 9 or head[:len(INDEX_HEADER)] != INDEX_HEADER \
            or int.from_bytes(head[9:17], "little") != 1:
        raise DataError(f"{prefix}.idx: not a Megatron indexed dataset index (MMIDIDX version 1)")
    if len(head) < _HEADER_BYTES or head[17] not in _DTYPES:
        raise _corrupt(prefix, "header")
    dtype = np.dtype(_DTYPES[head[17]])
    seqs, docs = int.from_bytes(head[18:26], "little"), int.from_bytes(head[26:34], "little")
    if docs < 1 or idx_size != _HEADER_BYTES + 4 * seqs + 8 * seqs + 8 * docs:
        raise _corrupt(prefix, f"{idx_size} bytes for {seqs} sequences and {docs - 1} documents")
    index = np.memmap(f"{prefix}.idx", dtype=np.uint8, mode="r")
    lengths = index[_HEADER_BYTES:_HEADER_BYTES + 4 * seqs].view(np.int32)
    pointers = index[_HEADER_BYTES + 4 * seqs:_HEADER_BYTES + 12 * seqs].view(np.int64)
    bounds = index[_HEADER_BYTES + 12 * seqs:].view(np.int64)
    if bounds[0] != 0 or bounds[-1] != seqs:
        raise _corrupt(prefix, "document boundaries")
    # the last sequence ends where the .bin must end: checked without reading the whole index
    expected = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize if seqs else 0
    actual = os.path.getsize(f"{prefix}.bin")
    if actual != expected:
        raise DataError(f"{prefix}.bin: holds {actual} bytes, its index describes {expected}")
    tokens = np.memmap(f"{prefix}.bin", dtype=dtype, mode="r") if actual else np.zeros(0, dtype)
    return IndexedDataset(prefix, tokens, lengths, bounds)


def read_documents(prefix: str, eod_id: int | None = None) -> list[np.ndarray]:
    """Documents of a (small) indexed dataset as int32 arrays in memory; a trailing `eod_id` (Megatron's
    --append-eod) is dropped, since packing appends its own. Training reads through `indexed_samples` instead."""
    ds = open_indexed_dataset(prefix)
    docs = []
    for start, length in zip(*ds.documents()):
        doc = np.asarray(ds.tokens[start:start + length], dtype=np.int32)
        if eod_id is not None and len(doc) and doc[-1] == eod_id:
            doc = doc[:-1]
        docs.append(doc)
    return docs


def scan_tokens(ds: IndexedDataset, starts: np.ndarray, lengths: np.ndarray,
                block_tokens: int = 1 << 22) -> tuple[int, np.ndarray]:
    """(largest token id, last token of every document (-1 for empty ones)) in one sequential pass over the .bin;
    `starts`, `lengths` from `ds.documents()`.

    Read with ordinary file reads in blocks, not through the memmap: a process's peak resident memory counts the
    mapped pages it touched, and this pass touches them all.
    """
    ends = starts + lengths - 1     # non-decreasing: documents follow each other in the .bin
    last = np.full(len(ends), -1, dtype=np.int64)
    top = -1
    with open(f"{ds.prefix}.bin", "rb") as f:
        for lo in range(0, ds.num_tokens, block_tokens):
            block = np.fromfile(f, dtype=ds.tokens.dtype, count=min(block_tokens, ds.num_tokens - lo))
            top = max(top, int(block.max()))
            a, b = np.searchsorted(ends, [lo, lo + len(block)])
            inside = np.arange(a, b)[lengths[a:b] > 0]
            last[inside] = block[ends[inside] - lo]
    return top, last
