"""Megatron-compatible indexed datasets (.bin tokens + .idx index) through MindFormers' own builder and reader.

MindFormers 1.9 ships Megatron-Core's `IndexedDatasetBuilder` / `IndexedDataset` (`mindformers.dataset.
blended_datasets.indexed_dataset`) and they work as a library here, so they write and read the bytes; this module
adds what a user-facing tool needs around them: atomic writes, one-line errors for missing, foreign or truncated
files, and documents back as token arrays. One sequence per document (no sentence splitting), as Megatron's
preprocess_data.py writes by default. MindFormers is imported lazily: it pulls in MindSpore (seconds).
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterable

import numpy as np

from data_sched.errors import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"   # Megatron's magic, then <Q version 1, <B dtype code


def _mf():
    from mindformers.dataset.blended_datasets import indexed_dataset
    return indexed_dataset


def token_dtype(vocab_size: int) -> type:
    """uint16 while ids fit (half the bytes), else int32: Megatron's choice."""
    return _mf().DType.optimal_dtype(vocab_size)


def prefix_of(path: str) -> str:
    """`data/corpus.bin`, `data/corpus.idx` and `data/corpus` all name the dataset `data/corpus`."""
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def write_indexed_dataset(prefix: str, docs: Iterable[np.ndarray], vocab_size: int) -> tuple[int, int]:
    """Write `<prefix>.bin/.idx` (to temporary names, then renamed); returns (documents, tokens)."""
    mf = _mf()
    dtype = token_dtype(vocab_size)
    bin_path, idx_path = f"{prefix}.bin", f"{prefix}.idx"
    tmp_bin, tmp_idx = f"{bin_path}.tmp{os.getpid()}", f"{idx_path}.tmp{os.getpid()}"
    num_docs = num_tokens = 0
    try:
        builder = mf.IndexedDatasetBuilder(tmp_bin, dtype=dtype)
        for doc in docs:
            arr = np.asarray(doc)
            if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
                raise DataError(f"{prefix}: token id outside [0, {vocab_size}) in document {num_docs}")
            builder.add_document(arr.astype(dtype, copy=False), [int(arr.size)])
            num_docs += 1
            num_tokens += int(arr.size)
        builder.finalize(tmp_idx)
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    finally:
        for tmp in (tmp_bin, tmp_idx):
            Path(tmp).unlink(missing_ok=True)
    return num_docs, num_tokens


def _check_files(prefix: str) -> None:
    for path in (f"{prefix}.idx", f"{prefix}.bin"):
        if not Path(path).is_file():
            raise DataError(f"{path}: indexed dataset file not found")
    with open(f"{prefix}.idx", "rb") as f:
        head = f.read(len(INDEX_HEADER) + 9)
    if len(head) < len(INDEX_HEADER) + 9 or head[:len(INDEX_HEADER)] != INDEX_HEADER \
            or int.from_bytes(head[9:17], "little") != 1:
        raise DataError(f"{prefix}.idx: not a Megatron indexed dataset index (MMIDIDX version 1)")


def read_documents(prefix: str, eod_id: int | None = None) -> list[np.ndarray]:
    """Documents of an indexed dataset as int32 arrays; a trailing `eod_id` (Megatron's --append-eod) is dropped,
    since packing appends its own."""
    prefix = prefix_of(prefix)
    _check_files(prefix)
    try:
        ds = _mf().IndexedDataset(prefix)
        lengths = ds.sequence_lengths.astype(np.int64)
        bounds = ds.document_indices.astype(np.int64)
        itemsize = np.dtype(ds.index.dtype).itemsize
    except (AssertionError, ValueError, struct.error, OSError) as e:
        raise DataError(f"{prefix}.idx: corrupt indexed dataset index ({type(e).__name__})") from None
    expected = int(lengths.sum()) * itemsize
    actual = os.path.getsize(f"{prefix}.bin")
    if actual != expected:
        raise DataError(f"{prefix}.bin: holds {actual} bytes, its index describes {expected}")
    tokens = np.memmap(f"{prefix}.bin", dtype=ds.index.dtype, mode="r")
    ends = np.cumsum(lengths)
    docs = []
    for d in range(len(bounds) - 1):
        lo = int(ends[bounds[d] - 1]) if bounds[d] > 0 else 0
        hi = int(ends[bounds[d + 1] - 1]) if bounds[d + 1] > 0 else 0
        doc = np.asarray(tokens[lo:hi], dtype=np.int32)
        if eod_id is not None and len(doc) and doc[-1] == eod_id:
            doc = doc[:-1]
        docs.append(doc)
    return docs

