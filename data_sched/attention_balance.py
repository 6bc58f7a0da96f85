"""Balance attention work across (DP rank, micro-batch) slots of one global batch without changing what is trained.

A global batch of G = dp x micro_batch_num x micro_batch_size packed samples is laid out rank-major: output sample
j goes to DP rank j // (mb*mbs), micro-batch (j // mbs) % mb, so each rank's share stays contiguous and each
micro-batch is mbs consecutive rows of it. Modes:

- off:     the samples in their given order.
- reorder: a permutation of the samples. They are partitioned into dp*mb slots of exactly mbs samples (greedy
           longest-processing-time-first with the size limit, then swaps that lower the heaviest slot), and the
           slots are grouped into ranks of exactly mb slots the same way (this alone balances ranks when mbs = 1).
- repack:  reorder, then move document pieces between slots: a piece of the most expensive slot trades places
           with as many tokens of a cheap sample (its smallest pieces, the last one cut) from one of the coldest
           slots. Every (input, label) token pair is kept exactly once; only where pieces sit, and one extra cut
           per trade at most, change. Costlier than reorder: one small NumPy evaluation per trade.

The output lists segments (source sample, start, length) per output sample; each segment is one document piece,
so the output document lengths are the segment lengths. NumPy and deterministic; the seed only decides which
balanced group lands on which rank and micro-batch, so no rank is systematically the hot one.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from data_sched.attention_cost import CostModel

MODES = ("off", "reorder", "repack")
# Swapping stops once the heaviest part is this close to its lower bound: closer is below timing noise.
REFINE_TOLERANCE = 5e-3


@dataclass(frozen=True)
class BatchAssignment:
    mode: str
    dp: int
    micro_batch_num: int
    micro_batch_size: int
    seq_length: int
    segments: np.ndarray        # int64 [P, 3]: (source sample, start position, length), in output order
    sample_offsets: np.ndarray  # int64 [G+1]: output sample j is segments[sample_offsets[j]:sample_offsets[j+1]]
    slot_costs_before: np.ndarray  # float64 [dp*mb]; slot s = (rank s // mb, micro-batch s % mb)
    slot_costs_after: np.ndarray

    @property
    def num_samples(self) -> int:
        return len(self.sample_offsets) - 1

    def doc_lens(self, j: int) -> np.ndarray:
        return self.segments[self.sample_offsets[j]:self.sample_offsets[j + 1], 2]

    def source_order(self) -> np.ndarray:
        """off/reorder: the source sample of each output sample."""
        if self.mode == "repack":
            raise ValueError("a repacked batch mixes samples; it has no sample order")
        return self.segments[self.sample_offsets[:-1], 0]

    def rank_costs(self, slot_costs: np.ndarray) -> np.ndarray:
        return slot_costs.reshape(self.dp, self.micro_batch_num).sum(axis=1)

    def apply(self, tokens: np.ndarray, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, labels) [stop-start, seq_length] of output samples start..stop from source tokens [G, seq+1]."""
        stop = self.num_samples if stop is None else stop
        seg = self.segments[self.sample_offsets[start]:self.sample_offsets[stop]]
        flat = _segment_positions(seg[:, 0] * tokens.shape[1] + seg[:, 1], seg[:, 2])
        src = tokens.reshape(-1)
        shape = (stop - start, self.seq_length)
        return src[flat].reshape(shape), src[flat + 1].reshape(shape)


def _segment_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start, start+length) over segments, without a Python loop."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - ends + lengths, lengths) + np.arange(int(ends[-1]) if len(ends) else 0)


# ---- equal-size partition minimising the largest sum ---------------------------------------------------------

def partition_bound(costs: np.ndarray, parts: int) -> float:
    """A lower bound on the largest part of any partition into `parts` parts of k = n/parts items each.

    Exact for k <= 2 (one item each; or pairs, where folding the sorted list, largest with smallest, is optimal).
    Otherwise the best of: the mean part, and for t = 1..k the pigeonhole bound: among the (t-1)*parts + 1
    largest items some part holds t, which cost at least the t smallest of them, plus the k-t smallest overall.
    """
    n = len(costs)
    k = n // parts
    desc = np.sort(np.asarray(costs, dtype=np.float64))[::-1]
    if k == 1:
        return float(desc[0])
    if k == 2:
        return float(np.max(desc[:parts] + desc[::-1][:parts]))
    smallest = np.concatenate([[0.0], np.cumsum(desc[::-1])])      # smallest[m]: the m smallest items
    prefix = np.concatenate([[0.0], np.cumsum(desc)])                # prefix[m]: the m largest items
    t = np.arange(1, k + 1)
    top = (t - 1) * parts + 1                                         # items that force t into one part
    forced = prefix[top] - prefix[top - t]                           # the t smallest of those
    return float(max(desc.sum() / parts, np.max(forced + smallest[k - t])))


def _lpt(costs: np.ndarray, parts: int) -> np.ndarray:
    """Largest first, each to the lightest part that still has room -> members [parts, k]."""
    k = len(costs) // parts
    heap = [(0.0, p) for p in range(parts)]
    fill = [0] * parts
    values = costs.tolist()
    slot = [0] * len(costs)
    for i in np.argsort(-costs, kind="stable").tolist():
        load, p = heap[0]
        slot[i] = p
        fill[p] += 1
        if fill[p] < k:
            heapq.heapreplace(heap, (load + values[i], p))
        else:
            heapq.heappop(heap)
    return np.argsort(np.array(slot, dtype=np.int64), kind="stable").reshape(parts, k)


def _refine(costs: np.ndarray, members: np.ndarray, target: float, max_rounds: int) -> np.ndarray:
    """Swap one item of the heaviest part with the item of another part that best evens the two, while it helps.

    For each item x of the heaviest part p and each part q the ideal partner is y = x - (S_p - S_q)/2; one
    searchsorted over all parts' sorted items (rows offset apart) finds the two nearest candidates per (x, q).
    """
    members = members.copy()
    parts, k = members.shape
    vals = costs[members]
    order = np.argsort(vals, axis=1, kind="stable")
    ys = np.take_along_axis(vals, order, 1)
    sums = vals.sum(axis=1)
    shift = np.arange(parts)[:, None] * (2.0 * float(costs.max()) + 1.0)
    row = np.arange(parts)[None, :, None]
    for _ in range(max_rounds):
        p = int(np.argmax(sums))
        if sums[p] <= target:
            break
        x = vals[p]
        want = x[:, None] - (sums[p] - sums[None, :]) / 2 + shift.T
        pos = np.searchsorted((ys + shift).ravel(), want)
        cand = np.clip(np.stack([pos - 1, pos], -1) - row * k, 0, k - 1)   # [k, parts, 2] column in row q
        d = x[:, None, None] - ys[row, cand]
        new_max = np.maximum(sums[p] - d, sums[None, :, None] + d)
        new_max[:, p, :] = np.inf
        new_max[d <= 0] = np.inf
        f = int(np.argmin(new_max))
        if not new_max.flat[f] < sums[p] * (1 - 1e-12):
            break
        i, q, c = np.unravel_index(f, new_max.shape)
        j = order[q, cand[i, q, c]]
        members[p, i], members[q, j] = members[q, j], members[p, i]
        vals[p, i], vals[q, j] = vals[q, j], vals[p, i]
        sums[p] -= d[i, q, c]
        sums[q] += d[i, q, c]
        for r in (p, q):
            order[r] = np.argsort(vals[r], kind="stable")
            ys[r] = vals[r, order[r]]
    return members


def balanced_partition(costs: np.ndarray, parts: int) -> np.ndarray:
    """Indices [parts, n/parts]: equal-size parts whose largest sum is within REFINE_TOLERANCE of the bound
    where single swaps can get there. Deterministic."""
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    if parts < 1 or n % parts:
        raise ValueError(f"balanced_partition: {n} items do not split into {parts} equal parts")
    if parts == 1 or n == parts:
        return np.arange(n).reshape(parts, -1)
    target = partition_bound(costs, parts) * (1 + REFINE_TOLERANCE)
    return _refine(costs, _lpt(costs, parts), target, max_rounds=4 * parts)


# ---- the global batch ----------------------------------------------------------------------------------------

@dataclass
class _Pieces:
    """Document pieces of G samples: flat (sample, start, length) rows, sample j's rows at offsets[j]:offsets[j+1]."""
    rows: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, samples_doc_lens: Sequence[np.ndarray]) -> "_Pieces":
        counts = np.fromiter(map(len, samples_doc_lens), dtype=np.int64, count=len(samples_doc_lens))
        lengths = np.concatenate(samples_doc_lens).astype(np.int64, copy=False)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        sample = np.repeat(np.arange(len(counts)), counts)
        start = np.cumsum(lengths) - lengths
        start -= np.repeat(start[offsets[:-1]], counts)
        return cls(np.stack([sample, start, lengths], axis=1), offsets)

    def sum_sq(self) -> np.ndarray:
        sq = self.rows[:, 2].astype(np.float64) ** 2
        return np.add.reduceat(sq, self.offsets[:-1]) if len(sq) else sq

    def take(self, order: np.ndarray) -> "_Pieces":
        counts = np.diff(self.offsets)[order]
        idx = _segment_positions(self.offsets[:-1][order], counts)
        return _Pieces(np.take(self.rows, idx, axis=0), np.concatenate([[0], np.cumsum(counts)]))

    def split(self) -> list[np.ndarray]:
        return np.split(self.rows, self.offsets[1:-1])

    @classmethod
    def join(cls, per_sample: list[np.ndarray]) -> "_Pieces":
        counts = np.fromiter((len(x) for x in per_sample), dtype=np.int64, count=len(per_sample))
        return cls(np.concatenate(per_sample), np.concatenate([[0], np.cumsum(counts)]))


def _best_trade(hot: np.ndarray, cold: np.ndarray, h_sq: float, c_sq: float):
    """Best trade of one hot piece for as many tokens of a cold sample's smallest pieces (the last one cut).

    Returns (worst of the two new slot sums, hot row, whole cold pieces taken, tokens cut) or None.
    """
    q = cold[:, 2].astype(np.float64)
    q_len, q_sq = np.cumsum(q), np.cumsum(q * q)
    lp = hot[:, 2].astype(np.float64)
    whole = np.searchsorted(q_len, lp, side="right")            # cold pieces taken whole
    prev = np.maximum(whole - 1, 0)
    taken_len = np.where(whole > 0, q_len[prev], 0.0)
    taken_sq = np.where(whole > 0, q_sq[prev], 0.0)
    cut = lp - taken_len                                        # tokens cut off the next cold piece
    nxt = q[np.minimum(whole, len(q) - 1)]
    new_h = h_sq - lp ** 2 + taken_sq + cut ** 2
    new_c = c_sq + lp ** 2 - taken_sq + np.where(cut > 0, (nxt - cut) ** 2 - nxt ** 2, 0.0)
    worst = np.maximum(new_h, new_c)
    best = int(np.argmin(worst))
    if not worst[best] < h_sq * (1 - 1e-9):
        return None
    return float(worst[best]), best, int(whole[best]), int(cut[best])


def _repack_moves(pieces: _Pieces, mbs: int, max_moves: int, cold_slots: int = 4) -> _Pieces:
    """Trade a piece of the hottest slot for as many tokens of a cold sample, while the hotter of the two slots'
    sums of squared lengths falls (the token and sample terms do not move). Cold samples are tried from the
    `cold_slots` coldest slots, cheapest sample first, until one trade helps; none helping ends the search."""
    samples = pieces.split()
    sq = pieces.sum_sq()
    slots = len(samples) // mbs
    slot_sq = sq.reshape(slots, mbs).sum(axis=1)
    longest_sq = float(pieces.rows[:, 2].max()) ** 2
    for _ in range(max_moves):
        h = int(np.argmax(slot_sq))
        if slot_sq[h] <= max(slot_sq.sum() / slots, longest_sq) * (1 + REFINE_TOLERANCE):
            break
        hot_rows = samples[h * mbs:(h + 1) * mbs]
        hot_sample = np.repeat(np.arange(h * mbs, (h + 1) * mbs), [len(r) for r in hot_rows])
        hot = np.concatenate(hot_rows)
        trade = None
        coldest = np.argpartition(slot_sq, min(cold_slots, slots) - 1)[:cold_slots]
        for c in coldest[np.lexsort((coldest, slot_sq[coldest]))].tolist():
            for cs in (c * mbs + np.argsort(sq[c * mbs:(c + 1) * mbs], kind="stable")).tolist():
                cold = samples[cs][np.argsort(samples[cs][:, 2], kind="stable")]
                trade = _best_trade(hot, cold, float(slot_sq[h]), float(slot_sq[c]))
                if trade:
                    break
            if trade:
                break
        if trade is None:
            break
        _, best, n_whole, x = trade
        hs = int(hot_sample[best])
        moved, keep = cold[:n_whole], cold[n_whole:].copy()
        if x:
            src, st, ln = keep[0]
            keep[0, 2] = ln - x
            moved = np.concatenate([moved, [[src, st + ln - x, x]]])
        local = best - int(np.searchsorted(hot_sample, hs))          # row of the piece inside sample hs
        samples[cs] = np.concatenate([keep, hot[best:best + 1]])
        samples[hs] = np.concatenate([np.delete(samples[hs], local, axis=0), moved])
        for s in (hs, cs):
            sq[s] = float(np.sum(samples[s][:, 2].astype(np.float64) ** 2))
        slot_sq[h] = sq[h * mbs:(h + 1) * mbs].sum()
        slot_sq[c] = sq[c * mbs:(c + 1) * mbs].sum()
    return _Pieces.join(samples)


def balance_global_batch(samples_doc_lens: Sequence[np.ndarray], mode: str, dp: int, micro_batch_num: int,
                         cost_model: CostModel, seed: int) -> BatchAssignment:
    """Assign the G samples of one global batch (given by their document lengths) to (rank, micro-batch) slots.

    Pure and deterministic for (inputs, seed): every rank computes the same assignment and takes its share.
    """
    if mode not in MODES:
        raise ValueError(f"data.attention_balance: expected one of {', '.join(MODES)}, got {mode!r}")
    g = len(samples_doc_lens)
    slots = dp * micro_batch_num
    if slots < 1 or g % slots:
        raise ValueError(f"global batch of {g} samples does not split into data_parallel={dp} x "
                         f"micro_batch_num={micro_batch_num} equal micro-batches")
    mbs = g // slots
    seq = int(np.sum(samples_doc_lens[0]))
    pieces = _Pieces.of(samples_doc_lens)
    fixed = cost_model.b * seq + cost_model.c
    sample_sq = pieces.sum_sq()
    before = (cost_model.a * sample_sq + fixed).reshape(slots, mbs).sum(axis=1)
    if mode != "off":
        order = balanced_partition(cost_model.a * sample_sq, slots).reshape(-1)
        if mode == "repack":
            # One trade per slot on average: more buys under 0.5% on long-tailed batches, at several times the time.
            pieces = _repack_moves(pieces.take(order), mbs, max_moves=slots)
            sample_sq, order = pieces.sum_sq(), np.arange(g)
        slot_cost = (cost_model.a * sample_sq[order] + fixed).reshape(slots, mbs).sum(axis=1)
        rank_slots = balanced_partition(slot_cost, dp)                                    # [dp, mb]
        rng = np.random.default_rng([seed, 0xBA1])
        rank_slots = rng.permuted(rank_slots[rng.permutation(dp)], axis=1)
        order = order[(rank_slots.reshape(-1, 1) * mbs + np.arange(mbs)).reshape(-1)]
        pieces, sample_sq = pieces.take(order), sample_sq[order]   # one gather of the pieces for both steps
    after = (cost_model.a * sample_sq + fixed).reshape(slots, mbs).sum(axis=1)
    return BatchAssignment(mode, dp, micro_batch_num, mbs, seq, pieces.rows, pieces.offsets, before, after)


def lower_bounds(samples_doc_lens: Sequence[np.ndarray], dp: int, micro_batch_num: int,
                 cost_model: CostModel) -> dict[str, float]:
    """Lower bounds on the largest slot cost. mean: the average slot. reorder: `partition_bound` of the sample
    costs. repack: the slot holding the longest document piece, filled up with the batch's smallest pieces (one
    cut at the margin), since repacking cuts pieces only where a trade needs it."""
    slots = dp * micro_batch_num
    mbs = len(samples_doc_lens) // slots
    pieces = _Pieces.of(samples_doc_lens)
    seq = float(np.sum(samples_doc_lens[0]))
    fixed = cost_model.b * seq + cost_model.c
    costs = cost_model.a * pieces.sum_sq() + fixed
    mean = float(costs.sum()) / slots
    lens = np.sort(pieces.rows[:, 2].astype(np.float64))
    longest, rest = lens[-1], lens[:-1]
    room = mbs * seq - longest
    whole = int(np.searchsorted(np.cumsum(rest), room, side="right"))
    filled = float(np.sum(rest[:whole] ** 2)) + (room - float(np.sum(rest[:whole]))) ** 2
    return {"mean": mean,
            "reorder": max(mean, partition_bound(costs, slots)),
            "repack": max(mean, cost_model.a * (longest ** 2 + filled) + mbs * fixed)}
