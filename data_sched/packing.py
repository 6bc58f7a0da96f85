"""Pack tokenized documents into fixed-length samples that remember where each document starts and ends.

Megatron style: documents are concatenated, each followed by EOD, and cut into samples of seq_length+1 tokens
that overlap by one (sample i covers stream[i*s : i*s+s+1]; input = [:-1], labels = [1:]), so every stream token
is an input exactly once. The incomplete tail (fewer than seq_length+1 tokens left) is dropped, as Megatron does;
`dropped_tokens` says how many. A document's segment is its tokens plus its EOD; a document cut by a sample
boundary contributes one piece to each sample it touches, so a sample's document lengths sum to seq_length.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from data_sched.doc_lengths import DocLengths
from data_sched.errors import DataError


def epoch_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The order in which epoch `epoch` visits a dataset's samples: one seeded permutation per epoch."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


@dataclass(frozen=True)
class PackedSamples:
    """Samples held in memory (text corpora): tokens int32 [N, seq_length+1]; sample i's document lengths are
    doc_lens[doc_offsets[i]:doc_offsets[i+1]].

    The loader reads every kind of sample set through the same five members: len, seq_length, ids_at (the samples
    at positions lo..hi of an epoch, in training order), take (their tokens) and doc_lengths; source_of and
    source_names say which source of a blend a sample came from. `indexed_samples.IndexedSamples` serves the same
    from memory-mapped files, `blend.BlendedSamples` mixes several by weight.
    """
    tokens: np.ndarray
    doc_offsets: np.ndarray  # int64 [N+1]
    doc_lens: np.ndarray     # int32 [total pieces]
    dropped_tokens: int = 0
    _orders: dict = field(default_factory=dict, compare=False, repr=False)
    source_names = ("corpus",)

    @property
    def seq_length(self) -> int:
        return self.tokens.shape[1] - 1

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def sample_doc_lens(self, i: int) -> np.ndarray:
        return self.doc_lens[self.doc_offsets[i]:self.doc_offsets[i + 1]]

    def doc_lens_list(self) -> list[np.ndarray]:
        return [self.sample_doc_lens(i) for i in range(len(self))]

    def ids_at(self, seed: int, epoch: int, lo: int, hi: int) -> np.ndarray:
        if (seed, epoch) not in self._orders:
            self._orders.clear()
            self._orders[(seed, epoch)] = epoch_order(seed, epoch, len(self))
        return self._orders[(seed, epoch)][lo:hi]

    def take(self, ids: np.ndarray) -> np.ndarray:
        return self.tokens[ids]

    def doc_lengths(self, ids: np.ndarray) -> DocLengths:
        return DocLengths.take(self.doc_lens, self.doc_offsets, np.asarray(ids))

    def source_of(self, ids: np.ndarray) -> np.ndarray:
        return np.zeros(len(ids), dtype=np.int64)


def pack_lengths(segment_lengths: np.ndarray, seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Document lengths per sample from segment lengths (document + EOD) alone: (doc_offsets, doc_lens).

    The length-only half of `pack_documents`, for planning and benchmarks that never hold the tokens.
    """
    seg_ends = np.cumsum(np.asarray(segment_lengths, dtype=np.int64))
    total = int(seg_ends[-1]) if len(seg_ends) else 0
    num = (total - 1) // seq_length if total > seq_length else 0
    covered = num * seq_length
    # Every cut (document end or sample start) inside the input positions splits a piece; pieces never straddle.
    cuts = np.union1d(seg_ends[seg_ends < covered], np.arange(num, dtype=np.int64) * seq_length)
    cuts = np.append(cuts, covered)
    piece_sample = cuts[:-1] // seq_length
    offsets = np.zeros(num + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(np.bincount(piece_sample, minlength=num))
    return offsets, np.diff(cuts).astype(np.int32)


def pack_documents(docs: list[np.ndarray], seq_length: int, eod_id: int) -> PackedSamples:
    """Concatenate `docs` (each + EOD) and cut into samples of seq_length+1 tokens; see the module docstring."""
    if seq_length < 1:
        raise DataError(f"model.seq_length: expected a positive integer, got {seq_length}")
    seg_lens = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
    stream = np.full(int(seg_lens.sum()), eod_id, dtype=np.int32)
    seg_ends = np.cumsum(seg_lens)
    for doc, end, n in zip(docs, seg_ends, seg_lens):
        stream[end - n:end - 1] = doc
    if len(stream) <= seq_length:
        raise DataError(f"corpus too small: {len(stream)} tokens cannot fill one sample of seq_length={seq_length}"
                        f" (+1 for the labels)")
    offsets, piece_lens = pack_lengths(seg_lens, seq_length)
    num = len(offsets) - 1
    covered = num * seq_length
    tokens = np.lib.stride_tricks.sliding_window_view(stream[:covered + 1], seq_length + 1)[::seq_length].copy()
    return PackedSamples(tokens=tokens, doc_offsets=offsets, doc_lens=piece_lens,
                         dropped_tokens=int(len(stream) - covered - 1))


def doc_lens_to_segment_ids(lens, seq_length: int) -> np.ndarray:
    """int32 [seq_length]: position p belongs to document piece k (0, 1, ...); the mask is per-segment causal."""
    lens = np.asarray(lens, dtype=np.int64)
    if lens.sum() != seq_length or (lens <= 0).any():
        raise ValueError(f"document lengths must be positive and sum to seq_length={seq_length}, got {lens.tolist()}")
    return np.repeat(np.arange(len(lens), dtype=np.int32), lens)


def doc_lens_to_actual_seq_len(lens, seq_length: int, pad_to: int) -> np.ndarray:
    """int32 [pad_to]: MindFormers' compressed EOD mask for FlashAttention's actual_seq_len on Ascend.

    The end position of every document piece but the last, padded with seq_length (as MindFormers'
    `_get_eod_attention_mask` builds it from EOD positions); the per-micro-batch offsets of the TND layout are
    added downstream, as MindFormers' `asl_batch_wrapper` does.
    """
    ends = np.cumsum(np.asarray(lens, dtype=np.int64))
    if ends[-1] != seq_length:
        raise ValueError(f"document lengths must sum to seq_length={seq_length}, got {int(ends[-1])}")
    if len(ends) - 1 > pad_to:
        raise ValueError(f"{len(ends) - 1} document boundaries exceed the compressed EOD mask length {pad_to}")
    return np.pad(ends[:-1], (0, pad_to - len(ends) + 1), constant_values=seq_length).astype(np.int32)

