"""What a sample costs its slowest context-parallel rank (parallel/cp): the load-balanced split cuts each sequence
into 2*cp blocks, rank r computing the query rows of blocks r and 2*cp-1-r, and a query row at position p of a
document starting at s attends p - s + 1 keys. A sample's attention work on rank r is the sum of that over its rows;
the step waits for the rank with the most, so balancing under cp prices a sample by its largest rank's work.

`context_parallel_sq` states it in the balancer's unit (a sample's sum of squared document lengths, what a whole
sequence costs): 2 * cp * the largest rank's work, which is sum(l^2 + l) when the ranks are even and grows with
how unevenly the documents fall on the blocks (short documents inside one block; not a document spanning the
whole sequence, which the split balances).
"""
from __future__ import annotations

import numpy as np

from data_sched.doc_lengths import DocLengths


def _causal_keys(first, end, start):
    """sum over rows p in [first, end) of p - start + 1 (0 where the range is empty)."""
    hi, lo = end - start, np.maximum(first - start, 0)
    return np.where(end > first, (hi * (hi + 1) - lo * (lo + 1)) / 2.0, 0.0)


def rank_work(batch: DocLengths, seq: int, cp: int) -> np.ndarray:
    """float64 [G, cp]: each sample's causal attention work (keys summed over query rows) on each cp rank."""
    if seq % (2 * cp):
        raise ValueError(f"seq_length {seq} is not divisible by 2*context_parallel = {2 * cp}")
    lengths = batch.lengths.astype(np.int64)
    counts = np.diff(batch.offsets)
    ends = np.cumsum(lengths)
    base = np.repeat(ends[batch.offsets[1:] - 1] - seq, counts)      # the sample's first position, flat
    stop = ends - base
    start = stop - lengths
    block = seq // (2 * cp)
    edges = np.arange(2 * cp + 1) * block
    # [pieces, 2cp]: the rows of each block inside each document piece
    work = _causal_keys(np.maximum(start[:, None], edges[None, :-1]), np.minimum(stop[:, None], edges[None, 1:]),
                        start[:, None])
    owner = np.minimum(np.arange(2 * cp), 2 * cp - 1 - np.arange(2 * cp))       # block b's rank
    per_rank = np.zeros((len(lengths), cp))
    np.add.at(per_rank.T, owner, work.T)
    return np.add.reduceat(per_rank, batch.offsets[:-1], axis=0)


def context_parallel_sq(batch: DocLengths, seq: int, cp: int) -> np.ndarray:
    """float64 [G]: 2 * cp * the largest rank's work of each sample (the balancer's sum-of-squares unit)."""
    return 2.0 * cp * rank_work(batch, seq, cp).max(axis=1)
