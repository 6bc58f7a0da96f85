"""Packed samples of an indexed dataset, served from memory-mapped files: the corpus never enters memory.

The packing is `packing.pack_documents`'s, computed from the index alone: a split's documents (train or held-out,
by `loader.holdout_mask`) are laid end to end in corpus order, each followed by EOD (a document that already ends
in EOD, Megatron's --append-eod, keeps its own), and sample i is stream[i*s : i*s+s+1]. What that needs is cached
once per (files, seq_length, seed, eval_fraction, EOD id) by `index_cache`:

  <key>_<split>_starts.npy  int64 [D]  first token in the .bin of the split's d-th document
  <key>_<split>_ends.npy    int64 [D]  end of its segment (document + EOD) in the split's stream: the packing
                                       index; a sample's documents are two binary searches away
  <key>_max_id.npy          [1]        the largest token id (checked against the tokenizer on every open)
  <key>_<split>_shuffle<seed>_e<e>.npy epoch e's sample order (`packing.epoch_order`), built when first reached

A sample's tokens are read from the memory-mapped .bin when the loader asks for it, so a rank touches the pages
of its own micro-batches only, and resident memory is the index pages in use, whatever the corpus's size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_sched.doc_lengths import DocLengths
from data_sched.errors import DataError
from data_sched.index_cache import cache_folder, cache_key, cached_arrays, file_identity
from data_sched.indexed_dataset import IndexedDataset, open_indexed_dataset, scan_tokens
from data_sched.loader import holdout_mask
from data_sched.packing import epoch_order

SPLITS = ("train", "held_out")


@dataclass(frozen=True)
class IndexedSamples:
    """One split of one indexed dataset as packed samples (the sample-set members of `packing.PackedSamples`)."""
    dataset: IndexedDataset
    split: str                  # "train" or "held_out"
    seq_length: int
    eod_id: int
    doc_starts: np.ndarray      # int64 [D], memory-mapped
    seg_ends: np.ndarray        # int64 [D], memory-mapped
    folder: Path
    key: str
    _orders: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def source_names(self) -> tuple[str, ...]:
        return (Path(self.dataset.prefix).name,)

    @property
    def num_tokens(self) -> int:
        """Tokens of the split's stream (documents + EOD)."""
        return int(self.seg_ends[-1]) if len(self.seg_ends) else 0

    def __len__(self) -> int:
        total = self.num_tokens
        return (total - 1) // self.seq_length if total > self.seq_length else 0

    def order(self, seed: int, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s sample order, memory-mapped from the cache (built there when first asked for)."""
        if (seed, epoch) not in self._orders:
            self._orders.clear()
            n = len(self)
            dtype = np.int32 if n < 2 ** 31 else np.int64
            self._orders[(seed, epoch)] = cached_arrays(
                self.folder, f"{self.key}_{self.split}_shuffle{seed}_e{epoch}", ("order",),
                lambda: {"order": epoch_order(seed, epoch, n).astype(dtype)})["order"]
        return self._orders[(seed, epoch)]

    def ids_at(self, seed: int, epoch: int, lo: int, hi: int) -> np.ndarray:
        return np.asarray(self.order(seed, epoch)[lo:hi], dtype=np.int64)

    def take(self, ids: np.ndarray) -> np.ndarray:
        """int32 [len(ids), seq_length+1]: the samples' tokens, read from the .bin piece by piece."""
        s = self.seq_length
        out = np.empty((len(ids), s + 1), dtype=np.int32)
        firsts = np.searchsorted(self.seg_ends, np.asarray(ids, dtype=np.int64) * s, side="right")
        for row, (i, k) in enumerate(zip(np.asarray(ids).tolist(), firsts.tolist())):
            pos, end = i * s, i * s + s + 1
            while pos < end:
                seg_start = int(self.seg_ends[k - 1]) if k else 0
                seg_end = int(self.seg_ends[k])
                offset, n = pos - seg_start, min(end, seg_end) - pos
                from_doc = max(0, min(n, seg_end - seg_start - 1 - offset))   # the segment's last token is EOD
                at, start = pos - i * s, int(self.doc_starts[k]) + offset
                out[row, at:at + from_doc] = self.dataset.tokens[start:start + from_doc]
                out[row, at + from_doc:at + n] = self.eod_id
                pos += n
                k += 1
        return out

    def doc_lengths(self, ids: np.ndarray) -> DocLengths:
        """The document pieces of each sample's seq_length input positions (they sum to seq_length)."""
        starts = np.asarray(ids, dtype=np.int64) * self.seq_length
        ends = starts + self.seq_length
        first = np.searchsorted(self.seg_ends, starts, side="right")
        inner = np.searchsorted(self.seg_ends, ends, side="left") - first   # documents ending inside the sample
        counts = inner + 1
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        cut = np.empty(int(offsets[-1]), dtype=np.int64)
        last = offsets[1:] - 1
        cut[last] = ends
        is_inner = np.ones(len(cut), dtype=bool)
        is_inner[last] = False
        run = np.arange(int(inner.sum())) - np.repeat(np.cumsum(inner) - inner, inner)
        cut[is_inner] = self.seg_ends[np.repeat(first, inner) + run]
        before = np.empty_like(cut)
        before[1:] = cut[:-1]
        before[offsets[:-1]] = starts
        return DocLengths((cut - before).astype(np.int32), offsets)

    def source_of(self, ids: np.ndarray) -> np.ndarray:
        return np.zeros(len(ids), dtype=np.int64)


def _build(ds: IndexedDataset, seed: int, eval_fraction: float, eod_id: int) -> dict[str, np.ndarray]:
    """The packing indexes of both splits (one sequential pass over the .bin for the trailing EODs and the top id)."""
    starts, lengths = ds.documents()
    top, last = scan_tokens(ds, starts, lengths)
    segment = lengths + (last != eod_id)   # a stored trailing EOD ends the segment, else one is appended
    held = holdout_mask(len(segment), eval_fraction, seed)
    arrays = {"max_id": np.array([top], dtype=np.int64)}
    for split, mask in zip(SPLITS, (~held, held)):
        arrays[f"{split}_starts"] = starts[mask]
        arrays[f"{split}_ends"] = np.cumsum(segment[mask])
    return arrays


def open_indexed_samples(path: str, seq_length: int, seed: int, eval_fraction: float, eod_id: int,
                         vocab_size: int, cache_dir: str = "") -> dict[str, IndexedSamples]:
    """{"train", "held_out"} samples of the indexed dataset at `path`, from the cache (built there when missing).

    Token ids at or above `vocab_size` (the tokenizer's) are refused, naming the file.
    """
    ds = open_indexed_dataset(path)
    if seq_length < 1:
        raise DataError(f"model.seq_length: expected a positive integer, got {seq_length}")
    folder = cache_folder(cache_dir, ds.prefix)
    key = cache_key(bin=file_identity(f"{ds.prefix}.bin"), idx=file_identity(f"{ds.prefix}.idx"),
                    seq_length=seq_length, seed=seed, eval_fraction=eval_fraction, eod_id=eod_id)
    names = ("max_id",) + tuple(f"{split}_{part}" for split in SPLITS for part in ("starts", "ends"))
    arrays = cached_arrays(folder, key, names, lambda: _build(ds, seed, eval_fraction, eod_id))
    top = int(arrays["max_id"][0])
    if top >= vocab_size:
        raise DataError(f"{ds.prefix}.bin: token id {top} does not fit the tokenizer (vocab_size {vocab_size})")
    return {split: IndexedSamples(ds, split, seq_length, eod_id, arrays[f"{split}_starts"], arrays[f"{split}_ends"],
                                  folder, key) for split in SPLITS}
