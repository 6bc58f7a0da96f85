"""Balance attention work across (DP rank, micro-batch) slots of one global batch without changing what is trained.

A global batch of G = dp x micro_batch_num x micro_batch_size packed samples is laid out rank-major: output sample
j goes to DP rank j // (mb*mbs), micro-batch (j // mbs) % mb, so each rank's share stays contiguous and each
micro-batch is mbs consecutive rows of it. Modes:

- off:     the samples in their given order.
- reorder: a permutation of the samples. They are partitioned into dp*mb slots of exactly mbs samples (greedy
           longest-processing-time-first with the size limit, then swaps that lower the heaviest slot), and the
           slots are grouped into ranks of exactly mb slots the same way (this alone balances ranks when mbs = 1).
- repack:  reorder's plan, then re-pack document pieces where that helps: the slots whose cost exceeds by more
           than REPACK_TOLERANCE the least worth aiming at (the mean, a lower bound from the long pieces, the
           heaviest slot of whole single pieces, which nothing can change), together with as many of the coldest
           slots as absorb their excess, are rebuilt from their pieces (`_pack_slots`: the longest pieces spread
           whole, the rest filled in with a mix of short and long pieces that levels the slots). The change is
           kept only if the batch's heaviest slot falls, its heaviest rank does not rise and the share of tokens
           that lose their earlier context (`BatchAssignment.context_loss`) is within the cap; otherwise the plan
           is reorder's exactly, nothing cut. Every (input, label) token pair is kept exactly once; pieces are cut
           only where a sample's share of short or long pieces ends (at most two cuts per re-packed sample) or,
           rarely, where a long piece fits no sample.

Under context parallelism (`cp` > 1) a sample's attention term is its slowest cp rank's (context_split.py: the
load-balanced split's blocks, each rank's causal work), so reorder balances what the step waits for; repack keeps
reorder's plan there (its piece re-packing prices whole sequences).

One cost model per plan: it balances, and it prices the plan's slot costs (`slot_costs_after`, `spread`: against
the plan's own mean), which the bench reports; the loader plans with the recipe's calibration or the attention
term alone.

The output gives the pieces (source sample, start, length) of every output sample, gathered on demand for the
samples a rank takes; each is one document piece, so the output document lengths are the piece lengths. NumPy
and deterministic; the seed only decides which balanced group lands on which rank and micro-batch, so no rank is
systematically the hot one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from data_sched.attention_cost import CostModel
from data_sched.context_split import context_parallel_sq
from data_sched.doc_lengths import DocLengths, _offsets, _segment_positions
from data_sched.errors import DataError
from data_sched.partition import _group_ranks, balanced_partition, partition_bound
from data_sched.repack import _repack, _Source, repack_bound

MODES = ("off", "reorder", "repack")


@dataclass(frozen=True)
class BatchAssignment:
    mode: str
    dp: int
    micro_batch_num: int
    micro_batch_size: int
    seq_length: int
    # The pieces are kept as ranges of a table, gathered (and placed) only for the samples asked for: each rank
    # needs its own share, and gathering the whole batch would take as long as planning it. Entries 0..S-1 of
    # the table are the source's document pieces (source_lengths, sample by sample); entries S.. are repack's
    # pieces (table: position in the batch's samples laid end to end, and length).
    source_lengths: np.ndarray            # [S] the batch's document pieces, flat
    table: tuple[np.ndarray, np.ndarray]  # int64 [T] each; a piece's sample is position // seq_length
    rows: np.ndarray     # int64 [G]: the source sample output sample j is (-1 where repack rebuilt it)
    firsts: np.ndarray   # int64 [G, r]: output sample j holds the table's pieces firsts[j, i] : firsts[j, i] +
    counts: np.ndarray   #   counts[j, i] for i = 0..r-1, in that order (each one document piece)
    slot_costs_before: np.ndarray  # float64 [dp*mb]; slot s = (rank s // mb, micro-batch s % mb)
    slot_costs_after: np.ndarray   # by `cost_model`, the one cost the plan was made with
    cost_model: CostModel = CostModel(a=1.0, b=0.0)
    # Share of the batch's tokens that lose their earlier context: those of output pieces that begin inside a
    # source document piece (repack's cuts; 0 for off and reorder).
    context_loss: float = 0.0

    @property
    def num_samples(self) -> int:
        return len(self.firsts)

    def spread(self) -> dict[str, float]:
        """max/mean of the plan's own costs (after repack's cuts): over the micro-batch slots of the whole batch
        (what a pipeline waits for), over the ranks (what the DP all-reduce waits for), and the mean over ranks
        of max/mean among a rank's own micro-batches."""
        slots = self.slot_costs_after
        per_rank = slots.reshape(self.dp, self.micro_batch_num)
        ranks = per_rank.sum(axis=1)
        return {"slot": float(slots.max() / slots.mean()), "rank": float(ranks.max() / ranks.mean()),
                "within_rank": float(np.mean(per_rank.max(axis=1) / per_rank.mean(axis=1)))}

    def pieces(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source sample, start position, length) of every piece of output samples start..stop, in order."""
        counts = self.counts[start:stop]
        idx = _segment_positions(self.firsts[start:stop].reshape(-1), counts.reshape(-1))
        n = len(self.source_lengths)
        own = idx < n
        length = self.source_lengths[np.minimum(idx, n - 1)].astype(np.int64, copy=False)
        pos = np.zeros(len(idx), dtype=np.int64)
        if len(self.table[0]):
            extra = np.maximum(idx - n, 0)
            length, pos = np.where(own, length, self.table[1][extra]), self.table[0][extra]
        # A source sample is taken whole and in order: its pieces' starts are the running sum of their lengths.
        per_sample = counts.sum(axis=1)
        before = np.cumsum(length) - length
        begin = before - np.repeat(before[_offsets(per_sample)[:-1]], per_sample)
        sample = np.where(own, np.repeat(self.rows[start:stop], per_sample), pos // self.seq_length)
        return sample, np.where(own, begin, pos - sample * self.seq_length), length

    @property
    def segments(self) -> np.ndarray:
        """int64 [P, 3]: (source sample, start position, length) of every output piece, in output order."""
        return np.stack(self.pieces(), axis=1)

    def doc_lens(self, j: int) -> np.ndarray:
        return self.pieces(j, j + 1)[2]

    def source_order(self) -> np.ndarray:
        """off/reorder: the source sample of each output sample."""
        if self.mode == "repack":
            raise ValueError("a repacked batch mixes samples; it has no sample order")
        return self.rows

    def rank_costs(self, slot_costs: np.ndarray) -> np.ndarray:
        return slot_costs.reshape(self.dp, self.micro_batch_num).sum(axis=1)

    def apply(self, tokens: np.ndarray, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, labels) [stop-start, seq_length] of output samples start..stop from source tokens [G, seq+1]."""
        sample, begin, length = self.pieces(start, stop)
        flat = _segment_positions(sample * tokens.shape[1] + begin, length)
        src = tokens.reshape(-1)
        shape = (len(self.firsts[start:stop]), self.seq_length)
        return src[flat].reshape(shape), src[flat + 1].reshape(shape)


def check_balance_mode(mode: str) -> None:
    """The one check of `data.attention_balance` (the recipe, the loader and `balance_global_batch` call it)."""
    if mode not in MODES:
        raise DataError(f"data.attention_balance: expected {', '.join(MODES[:-1])} or {MODES[-1]}, got {mode!r}")


def check_context_loss(share: float) -> None:
    """The one check of `data.max_context_loss` (the recipe, the loader and `balance_global_batch` call it)."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
        raise DataError(f"data.max_context_loss: expected a number in [0, 1], got {share!r}")


def balance_global_batch(samples_doc_lens: Sequence[np.ndarray] | DocLengths, mode: str, dp: int,
                         micro_batch_num: int, cost_model: CostModel, seed: int,
                         max_context_loss: float = 1.0, cp: int = 1) -> BatchAssignment:
    """Assign the G samples of one global batch (given by their document lengths) to (rank, micro-batch) slots.

    Pure and deterministic for (inputs, seed): every rank computes the same assignment and takes its share.
    `cost_model` is the one cost of the plan: it balances and it prices the plan's slot costs. repack cuts
    documents only where that lowers the batch's largest slot without raising the largest rank, and only while at
    most `max_context_loss` of the batch's tokens lose their earlier context; otherwise its plan is reorder's.
    `cp`: the context-parallel degree whose split prices each sample (module docstring).
    """
    check_balance_mode(mode)
    check_context_loss(max_context_loss)
    batch = DocLengths.of(samples_doc_lens)
    g = len(batch)
    slots = dp * micro_batch_num
    if slots < 1 or g % slots:
        raise ValueError(f"global batch of {g} samples does not split into data_parallel={dp} x "
                         f"micro_batch_num={micro_batch_num} equal micro-batches")
    mbs = g // slots
    seq = int(np.sum(batch.sample(0)))
    src = _Source.of(batch, seq)
    if cp > 1:
        src = _Source(src.length, src.offsets, context_parallel_sq(batch, seq, cp), seq)
    fixed = cost_model.b * seq + cost_model.c
    before = (cost_model.a * src.sq + fixed).reshape(slots, mbs).sum(axis=1)
    order = np.arange(g)
    sample_sq = src.sq
    repacked = None
    slot_order = np.arange(slots)
    if mode != "off":
        order = balanced_partition(src.sq, slots).reshape(-1)
        sample_sq = src.sq[order]
        rank_slots = _group_ranks(sample_sq.reshape(slots, mbs).sum(axis=1), dp)
        if mode == "repack" and cost_model.a > 0 and cp == 1:
            repacked = _repack(src, order, rank_slots, mbs, seq, mbs * fixed / cost_model.a, max_context_loss)
            if repacked is not None:
                sample_sq, rank_slots = repacked.sample_sq, repacked.rank_slots
        rng = np.random.default_rng([seed, 0xBA1])
        slot_order = rng.permuted(rank_slots[rng.permutation(dp)], axis=1).reshape(-1)
    out_samples = (slot_order[:, None] * mbs + np.arange(mbs)).reshape(-1)    # output sample -> layout sample
    table = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    rows = order.copy()
    firsts = src.offsets[order][:, None]
    counts = np.diff(src.offsets)[order][:, None]
    lost = 0
    if repacked is not None:
        # The table: source pieces, then the re-packed layout's; a re-packed sample takes its ranges from the
        # layout instead of the source.
        layout, pool_slots = repacked.layout, repacked.pool_slots
        pool_samples = (pool_slots[:, None] * mbs + np.arange(mbs)).reshape(-1)
        empty = np.zeros((g, layout.first.shape[1]), dtype=np.int64)
        firsts = np.concatenate([firsts, empty], axis=1)
        counts = np.concatenate([counts, empty], axis=1)
        counts[pool_samples, 0] = 0
        firsts[pool_samples, 1:] = len(src.length) + layout.first
        counts[pool_samples, 1:] = layout.count
        rows[pool_samples] = -1
        table = (layout.pos, layout.length)
        lost = layout.lost
    after = (cost_model.a * sample_sq[out_samples] + fixed).reshape(slots, mbs).sum(axis=1)
    return BatchAssignment(mode, dp, micro_batch_num, mbs, seq, src.length, table, rows[out_samples],
                           firsts[out_samples], counts[out_samples], before, after, cost_model, lost / (g * seq))


def lower_bounds(samples_doc_lens: Sequence[np.ndarray] | DocLengths, dp: int, micro_batch_num: int,
                 cost_model: CostModel) -> dict[str, float]:
    """Lower bounds on the largest slot cost. mean: the average slot. reorder: `partition_bound` of the sample
    costs. repack: `repack_bound` of the document pieces (repack keeps the longest pieces whole)."""
    slots = dp * micro_batch_num
    batch = DocLengths.of(samples_doc_lens)
    mbs = len(batch) // slots
    seq = int(np.sum(batch.sample(0)))
    fixed = cost_model.b * seq + cost_model.c
    lengths = batch.lengths
    costs = cost_model.a * np.add.reduceat(lengths.astype(np.float64) ** 2, batch.offsets[:-1]) + fixed
    mean = float(costs.sum()) / slots
    return {"mean": mean,
            "reorder": max(mean, partition_bound(costs, slots)),
            "repack": max(mean, cost_model.a * repack_bound(lengths, slots, mbs, seq) + mbs * fixed)}
