"""repack: document pieces of the hottest (rank, micro-batch) slots and of as many cold ones re-packed into new
samples that level the slots (attention_balance.py's docstring says when a re-pack is kept), and the lower bound on
what any re-pack reaches (`repack_bound`). The batch's pieces are a `_Source`; the re-packed samples a `_Layout`
of ranges of a table of pieces."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from data_sched.doc_lengths import DocLengths, _offsets, _segment_positions
from data_sched.partition import REFINE_TOLERANCE, _group_ranks, partition_bound

# Long pieces per slot at most that repack places one by one; shorter pieces fill the rest as sand.
BIG_PER_SLOT = 8
# Repack rebuilds the slots above the mean cost by more than this (and as many cold slots): a looser aim than
# REFINE_TOLERANCE, as each rebuilt slot costs time.
REPACK_TOLERANCE = 1.8e-2


@dataclass(frozen=True)
class _Source:
    """The document pieces of the global batch's samples, concatenated: sample j holds pieces
    offsets[j]:offsets[j+1] (seq tokens) and costs sq[j] = sum(l^2). Positions are found only for the pieces that
    need them (`positions`): a running sum over every piece of a heavy-tailed batch is a millisecond."""
    length: np.ndarray
    offsets: np.ndarray
    sq: np.ndarray
    seq: int

    @classmethod
    def of(cls, batch: DocLengths, seq: int) -> "_Source":
        # The lengths stay in the dataset's int32 (no int64 copy of every piece): what reads them gathers first.
        length = batch.lengths
        if length.dtype not in (np.int32, np.int64):
            length = length.astype(np.int64)
        offsets = batch.offsets.astype(np.int64, copy=False)
        counts = np.diff(offsets)
        # Sample sums in the lengths' own type where no sum can overflow it (int32 sums take a sixth of the time).
        wide = np.int64
        if length.dtype == np.int32 and len(length) and int(offsets[-1]) == len(length):
            if max(-int(length.min()), int(length.max())) * int(counts.max()) < 2 ** 31:
                wide = np.int32
        sums = np.where(counts > 0, np.add.reduceat(length, np.minimum(offsets[:-1], max(len(length) - 1, 0)),
                                                    dtype=wide) if len(length) else 0, 0)
        if counts.min() < 1 or (sums != seq).any():
            bad = int(np.argmax((counts < 1) | (sums != seq)))
            raise ValueError(f"sample {bad} of the global batch holds {int(np.sum(batch.sample(bad)))} tokens, "
                             f"expected {seq} like the first: samples must be fully packed")
        sq = np.add.reduceat(np.square(length, dtype=np.float64), offsets[:-1])
        return cls(length, offsets, sq, seq)

    def pieces_of(self, samples: np.ndarray) -> np.ndarray:
        """Indices of the pieces of `samples`, sample by sample."""
        return _segment_positions(self.offsets[samples], np.diff(self.offsets)[samples])

    def positions(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(indices, positions in the samples laid end to end, int64 lengths) of the pieces of `samples`, sample
        by sample."""
        idx = self.pieces_of(samples)
        length = self.length[idx].astype(np.int64, copy=False)
        counts = np.diff(self.offsets)[samples]
        # One running sum of the lengths shifted by one, a sample's first piece carrying the jump from the start
        # of the piece before (the last of the sample before, which ends at that sample's start + seq) to its own.
        step = np.empty(len(idx), dtype=np.int64)
        step[1:] = length[:-1]
        if len(idx):
            firsts = _offsets(counts)[:-1]
            step[firsts] = np.diff(samples * self.seq, prepend=-self.seq) - self.seq
            step[firsts[1:]] += length[firsts[1:] - 1]
        return idx, np.cumsum(step, out=step), length


@dataclass(frozen=True)
class _Layout:
    """Output samples as ranges of a table of pieces: entry e is tokens pos[e]:pos[e]+length[e] of the batch's
    samples laid end to end; output sample j holds entries first[j, i] : first[j, i] + count[j, i] for i = 0..r-1,
    in that order, and costs sq[j] = sum(l^2) over them."""
    pos: np.ndarray
    length: np.ndarray
    first: np.ndarray   # int64 [samples, r]
    count: np.ndarray
    sq: np.ndarray      # float64 [samples]
    lost: int = 0       # tokens of entries that begin inside a source piece: they lose their earlier context


@dataclass(frozen=True)
class _Chunks:
    """A stream of pieces cut into chunks with every piece left in its place, so that no part of the stream is
    copied: piece i keeps its head, head[i] tokens (up to the first cut inside it), and a chunk that begins inside
    a piece begins with that piece's continuation, tokens cont_offset:cont_offset+cont_length of piece cont_piece
    (one per such chunk, in chunk order). Chunk t holds continuations cont_first[t] : cont_first[t] + cont_count[t]
    (none or one), then the heads of pieces head_first[t] : head_first[t] + head_count[t]: those beginning in it."""
    head: np.ndarray
    cont_piece: np.ndarray
    cont_offset: np.ndarray
    cont_length: np.ndarray
    cont_first: np.ndarray
    cont_count: np.ndarray
    head_first: np.ndarray
    head_count: np.ndarray

    def sq(self) -> np.ndarray:
        """Sum of squared part lengths per chunk (reduceat: a fraction of a cumsum's time in NumPy)."""
        squares = np.empty(len(self.head) + 1)                  # a 0 at the end for chunks past the stream
        np.square(self.head, out=squares[:-1])
        squares[-1] = 0.0
        sums = np.add.reduceat(squares, self.head_first)
        sums[self.head_count == 0] = 0.0
        sums[self.cont_count > 0] += np.square(self.cont_length, dtype=np.float64)
        return sums


def _cut(length: np.ndarray, cuts: np.ndarray) -> _Chunks:
    """Cut a stream of pieces (their lengths, in stream order) at the stream positions `cuts` (ascending, repeats
    allowed) into the len(cuts) + 1 chunks between them."""
    n = len(length)
    ends = np.cumsum(length)       # a piece's begin, ends - length, is taken only where needed
    start = np.concatenate([[0], cuts])
    stop = np.append(cuts, ends[-1] if n else 0)
    # The piece each chunk begins in; n (past the stream) stands for no piece.
    piece = np.searchsorted(ends, start, side="right")
    clipped = np.minimum(piece, max(n - 1, 0))
    begin = ends[clipped] - length[clipped] if n else np.zeros(len(start), dtype=np.int64)
    inside = (piece < n) & (begin < start) & (start < ends[clipped]) if n else np.zeros(len(start), bool)
    cut = np.flatnonzero(inside)
    first_cut = cut[np.diff(piece[cut], prepend=-1) != 0]
    head = length.copy()
    head[piece[first_cut]] = start[first_cut] - begin[first_cut]
    has = inside & (stop > start)
    cont = np.flatnonzero(has)
    cont_piece = piece[cont]
    cont_count = has.astype(np.int64)
    # The first piece beginning at or after each chunk's start: pieces 1.. begin where the one before ends.
    head_first = (np.searchsorted(ends[:-1], start, side="left") + (start > 0)) if n else np.zeros(len(start),
                                                                                                   dtype=np.int64)
    return _Chunks(head, cont_piece, start[cont] - begin[cont],
                   np.minimum(ends[cont_piece], stop[cont]) - start[cont], np.cumsum(cont_count) - cont_count,
                   cont_count, head_first, np.diff(np.append(head_first, n)))


def _assign_big(length: np.ndarray, sq: np.ndarray, slots: int, capacity: int, sand_density: float) -> np.ndarray:
    """Slot of each big piece (given largest first), -1 for one that no slot has room for any more: largest first
    to the slot of least estimated cost (its big pieces plus the rest of its room filled with sand of the average
    density), in vectorised rounds over the slots below the mean estimate that have room for the round's largest."""
    load = np.zeros(slots)
    room = np.full(slots, float(capacity))
    target = (sq.sum() + sand_density * (slots * capacity - length.sum())) / slots
    slot = np.full(len(length), -1, dtype=np.int64)
    i = 0
    while i < len(length):
        est = load + sand_density * room
        fits = room >= length[i]
        take = np.flatnonzero(fits & (est < target))
        if len(take) == 0:
            if not fits.any():
                i += 1
                continue
            take = np.flatnonzero(fits)
            take = take[np.argmin(est[take]):][:1]
        take = take[np.argsort(est[take], kind="stable")][:len(length) - i]
        slot[i:i + len(take)] = take
        load[take] += sq[i:i + len(take)]
        room[take] -= length[i:i + len(take)]
        i += len(take)
    return slot


def _place_big(slot: np.ndarray, length: np.ndarray, slots: int, mbs: int, seq: int):
    """Put each slot's big pieces (largest first) into its samples, best fit; a piece that fits no sample fills
    the roomiest one and goes on in the next. Returns (piece, output sample, offset, length) per placed part and
    the room left in every output sample."""
    order = np.argsort(slot, kind="stable")
    counts = np.bincount(slot, minlength=slots)
    if mbs == 1 and np.bincount(slot, weights=length, minlength=slots).max(initial=0) <= seq:
        taken = np.bincount(slot, weights=length, minlength=slots).astype(np.int64)
        return np.stack([order, slot[order], np.zeros_like(order), length[order]], axis=1), seq - taken
    rank = np.arange(len(slot)) - np.repeat(_offsets(counts)[:-1], counts)
    grid = np.full((slots, max(1, int(counts.max(initial=0)))), -1, dtype=np.int64)
    grid[slot[order], rank] = order
    room = np.full((slots, mbs), seq, dtype=np.int64)
    rows = np.arange(slots)
    parts = []
    for k in range(grid.shape[1]):
        piece = grid[:, k]
        rest = np.where(piece >= 0, length[np.maximum(piece, 0)], 0)
        done = np.zeros(slots, dtype=np.int64)
        while rest.any():
            fits = room >= rest[:, None]
            best = np.where(fits, room, np.iinfo(np.int64).max).argmin(axis=1)
            j = np.where(fits.any(axis=1), best, room.argmax(axis=1))
            put = np.minimum(rest, room[rows, j])
            moving = np.flatnonzero(put > 0)
            if len(moving) == 0:
                raise AssertionError("big pieces exceed their slot's capacity")
            parts.append(np.stack([piece[moving], moving * mbs + j[moving], done[moving], put[moving]], axis=1))
            room[rows, j] -= put
            done += put
            rest -= put
    placed = np.concatenate(parts) if parts else np.zeros((0, 4), dtype=np.int64)
    return placed[np.argsort(placed[:, 1], kind="stable")], room.reshape(-1)


@lru_cache(maxsize=32)
def _bit_reversed(bits: int) -> np.ndarray:
    """0..2**bits - 1, each with its `bits` bits reversed (read-only; cached, as batches repeat their sizes).
    int32 up to 2**31 numbers: the mask and gather of `_stratified` then move half the bytes."""
    rev = np.zeros(1, dtype=np.int32 if bits <= 31 else np.int64)
    for _ in range(bits):
        rev = np.concatenate([2 * rev, 2 * rev + 1])
    rev.flags.writeable = False
    return rev


def _stratified(n: int) -> np.ndarray:
    """A permutation of 0..n-1 (ranks of items sorted by size) whose every window holds items from across the
    whole range: rank of position j = j with its bits reversed (van der Corput order), skipping ranks >= n."""
    rev = _bit_reversed(max(1, int(n - 1).bit_length()))
    return rev[np.flatnonzero(rev < n)]      # (a boolean index on this irregular mask takes twice as long)


def _coarse_share(need: np.ndarray, room: np.ndarray, fine: float, coarse: float, coarse_tokens: int) -> np.ndarray:
    """Tokens of coarse sand per slot (the rest of its room fine) that bring every slot's sand cost as close to
    its need as the two densities allow, using exactly `coarse_tokens` in all. Integer, 0 <= share <= room.

    Slot s wants base_s = (need_s - fine * room_s) / (coarse - fine) coarse tokens; all wants move by one common
    shift, found where the total of clip(base + shift, 0, room), piecewise linear in the shift, meets the supply.
    """
    base = (need - fine * room) / max(coarse - fine, 1e-12)
    points = np.concatenate([-base, room - base])
    order = np.argsort(points, kind="stable")
    points = points[order]
    slope = np.cumsum(np.where(order < len(base), 1, -1))           # slots between 0 and room right of a point
    totals = np.concatenate([[0.0], np.cumsum(slope[:-1] * np.diff(points))])
    k = min(int(np.searchsorted(totals, coarse_tokens, side="right")) - 1, len(points) - 1)
    shift = points[k] + (coarse_tokens - totals[k]) / max(slope[k], 1)
    share = np.clip(base + shift, 0, room)
    out = np.floor(share).astype(np.int64)
    short = coarse_tokens - int(out.sum())
    if short > 0:
        out[np.argsort(-np.where(out < room, share - out, -1.0), kind="stable")[:short]] += 1
    elif short < 0:
        out[np.argsort(np.where(out > 0, out - share, -np.inf), kind="stable")[short:]] -= 1
    return out


def _sort_by_length(length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(indices, lengths) of the pieces by length, ties by index: one sort of 32-bit keys (length, index), the
    length clipped to what the bits left over by the index hold, the few longer pieces at the end sorted apart.
    (NumPy sorts 32-bit numbers with SIMD: half the time of a stable argsort of 16-bit keys.)"""
    n = len(length)
    bits = max(1, int(n - 1).bit_length())
    if bits > 20:
        return _sort_by_length_radix(length)
    cap = (1 << (32 - bits)) - 1
    key = np.minimum(length, cap).astype(np.uint32)
    key <<= np.uint32(bits)
    key |= np.arange(n, dtype=np.uint32)
    key.sort()
    order = (key & np.uint32((1 << bits) - 1)).astype(np.int64)
    asc_length = (key >> np.uint32(bits)).astype(np.int64)
    tail = int(np.searchsorted(asc_length, cap))
    if tail < n:
        longest = order[tail:]
        order[tail:] = longest[np.argsort(length[longest], kind="stable")]
        asc_length[tail:] = length[order[tail:]]
    return order, asc_length


def _sort_by_length_radix(length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_sort_by_length` for a million pieces or more: NumPy's radix sort on 16-bit keys (lengths clipped to
    65535), the few longer pieces at the end sorted apart."""
    key = np.minimum(length, 65535).astype(np.uint16)
    order = np.argsort(key, kind="stable")
    tail = int(np.searchsorted(key[order], 65535))
    if tail < len(order):
        longest = order[tail:]
        order[tail:] = longest[np.argsort(length[longest], kind="stable")]
    return order, length[order]


def _pack_slots(pieces: np.ndarray, pos: np.ndarray, length: np.ndarray, slots: int, mbs: int, seq: int,
                total_sq: float | None = None) -> _Layout:
    """Re-pack the source pieces `pieces` (at positions `pos`, of int64 lengths `length`; `total_sq` their sum of
    squares where known) into `slots` slots of mbs samples of seq tokens, balancing sum(l^2).

    The longest pieces (at most BIG_PER_SLOT per slot, all longer than the average density) are spread largest
    first over the slots and packed whole into samples. The other pieces (sand) fill each sample's remaining room,
    split by length into a fine and a coarse half; each slot takes the mix of the two that brings it to the common
    level, and each half is dealt so that every share spans its whole range of lengths. Slots that want less than
    the fine half's density take its shortest pieces, the neediest first. Sand is cut where a share ends: at most
    two cuts per sample. Returns the slots' samples as a layout of pieces: big, then fine, then coarse sand.
    """
    capacity = mbs * seq
    # One sort of the pieces by length (ties by index): the longest are the big ones, the rest the sand in order.
    asc, asc_length = _sort_by_length(length)
    total = int(length.sum())
    if total_sq is None or not total_sq < 2.0 ** 53:       # (below 2^53 any sum of the integer squares is exact)
        total_sq = float(np.square(length, dtype=np.float64).sum())
    # Big: l * total > total_sq, i.e. l above the whole part of the average density.
    first_big = max(int(np.searchsorted(asc_length, int(total_sq // max(total, 1)), side="right")),
                    len(length) - BIG_PER_SLOT * slots)
    big = asc[first_big:][::-1]                                      # longer than the average density, largest first
    big_sq = np.square(length[big], dtype=np.float64)
    density = float(total_sq - big_sq.sum()) / max(total - int(length[big].sum()), 1)
    slot = _assign_big(length[big], big_sq, slots, capacity, density)
    left = big[slot < 0][::-1]                                       # no room: they go with the sand, the longest
    kept = slot >= 0
    big, slot, big_sq = big[kept], slot[kept], big_sq[kept]
    sand, sand_length = asc[:first_big], asc_length[:first_big]      # views, unless some big pieces are left
    if len(left):
        sand, sand_length = np.concatenate([sand, left]), np.concatenate([sand_length, length[left]])
    # Sand by length: the first count[i] pieces of `sand` are those of the i shortest lengths present, holding
    # tokens[i] tokens and sand_sq[i] squared tokens.
    count = np.concatenate([[0], np.flatnonzero(sand_length[1:] != sand_length[:-1]) + 1, [len(sand)]]
                           if len(sand) else [[0]])
    present = sand_length[count[:-1]]
    per_length = np.diff(count)
    tokens = _offsets(per_length * present)
    sand_sq = _offsets(per_length * np.square(present, dtype=np.float64))
    fine_end = int(np.searchsorted(tokens, tokens[-1] / 2))          # fine: the fine_end shortest lengths
    half = int(count[fine_end])
    fine = sand_sq[fine_end] / max(tokens[fine_end], 1)
    coarse = (sand_sq[-1] - sand_sq[fine_end]) / max(tokens[-1] - tokens[fine_end], 1)
    placed, room = _place_big(slot, length[big], slots, mbs, seq)
    load = np.bincount(slot, weights=big_sq, minlength=slots)
    rooms = room.reshape(slots, mbs)
    slot_room = rooms.sum(axis=1)
    level = (load.sum() + sand_sq[-1]) / slots
    share = _coarse_share(level - load, slot_room, fine, coarse, int(tokens[-1] - tokens[fine_end]))
    # Coarse tokens fill a slot's samples in order, fine tokens the rest of each sample.
    k_room = np.clip(share[:, None] - (np.cumsum(rooms, axis=1) - rooms), 0, rooms).reshape(-1)
    f_room = room - k_room
    wanting = np.flatnonzero(share == 0)
    wanting = wanting[np.argsort((level - load[wanting]) / np.maximum(slot_room[wanting], 1), kind="stable")]
    dealt = np.ones(slots, dtype=bool)
    dealt[wanting] = False
    dealt = np.repeat(dealt, mbs)
    f_order = np.concatenate([(wanting[:, None] * mbs + np.arange(mbs)).reshape(-1), np.flatnonzero(dealt)])
    shortest = min(half, int(count[np.searchsorted(tokens, f_room[~dealt].sum())]))
    rest = half - shortest
    # Fine then coarse sand as one stream (one gather of `sand` by the dealt ranks), cut where each sample's share
    # of it ends: chunk t is the fine share of sample f_order[t], chunk samples + j the coarse share of sample j.
    deal = np.empty(len(sand), dtype=np.int64)
    deal[:shortest] = _stratified(shortest)
    np.add(_stratified(rest), shortest, out=deal[shortest:half])
    np.add(_stratified(len(sand) - half), half, out=deal[half:])
    samples = slots * mbs
    stream = sand[deal]
    chunks = _cut(sand_length[deal], np.cumsum(np.concatenate([f_room[f_order], k_room]))[:-1])
    fine_chunk = np.empty(samples, dtype=np.int64)
    fine_chunk[f_order] = np.arange(samples)
    coarse_chunk = samples + np.arange(samples)
    b_count = np.bincount(placed[:, 1], minlength=samples)
    heads, conts = len(placed), len(placed) + len(stream)       # the table: big parts, heads, continuations
    first = [_offsets(b_count)[:-1]]
    count = [b_count]
    for chunk in (fine_chunk, coarse_chunk):
        first += [conts + chunks.cont_first[chunk], heads + chunks.head_first[chunk]]
        count += [chunks.cont_count[chunk], chunks.head_count[chunk]]
    chunk_sq = chunks.sq()
    sq = (np.bincount(placed[:, 1], weights=np.square(placed[:, 3], dtype=np.float64), minlength=samples)
          + chunk_sq[fine_chunk] + chunk_sq[coarse_chunk])
    # The table, written in place: big parts, heads, continuations.
    table_pos, table_length = np.empty((2, conts + len(chunks.cont_piece)), dtype=np.int64)
    table_pos[:heads] = pos[big[placed[:, 0]]] + placed[:, 2]
    np.take(pos, stream, out=table_pos[heads:conts])
    table_pos[conts:] = pos[stream[chunks.cont_piece]] + chunks.cont_offset
    table_length[:heads], table_length[heads:conts], table_length[conts:] = placed[:, 3], chunks.head, \
        chunks.cont_length
    return _Layout(table_pos, table_length, np.stack(first, axis=1), np.stack(count, axis=1), sq,
                   int(placed[placed[:, 2] > 0, 3].sum() + chunks.cont_length.sum()))


@dataclass(frozen=True)
class _Repacked:
    layout: _Layout            # the re-packed samples of `pool_slots`, slot by slot
    pool_slots: np.ndarray
    sample_sq: np.ndarray      # sum(l^2) of every layout sample of the batch, slot by slot
    rank_slots: np.ndarray     # [dp, mb] slots of each rank



def _repack_level(src: _Source, slot_sq: np.ndarray, whole: np.ndarray, mbs: int, seq: int) -> float:
    """The least largest slot sum(l^2) worth aiming at: the mean, a lower bound from the long pieces
    (`repack_bound` of the pieces over seq/16, without the short fill: only the long ones need looking at), and the
    heaviest slot that re-packing cannot change."""
    long = src.length[src.length > seq // 16]
    bound = 0.0
    if len(long):
        bound = max(repack_bound(long, len(slot_sq), mbs, seq, fill=False), float(long.max()) ** 2)
    return max(float(slot_sq.mean()), bound, float(slot_sq[whole].max(initial=0.0)))


def _repack(src: _Source, order: np.ndarray, rank_slots: np.ndarray, mbs: int, seq: int, fixed_sq: float,
            max_context_loss: float) -> _Repacked | None:
    """Re-pack the slots of `order` (samples, slot by slot; `rank_slots` their reorder grouping) whose cost is
    above the level worth aiming at (`_repack_level`) by more than REPACK_TOLERANCE and that are not whole single
    pieces, together with the coldest slots that can absorb their excess. `fixed_sq` is a slot's cost besides
    attention, in units of squared tokens. Kept only if the batch's largest slot falls, the largest rank does not
    rise and the share of tokens that lose their earlier context is at most `max_context_loss`; None otherwise
    (then nothing is cut)."""
    dp = rank_slots.shape[0]
    slots = len(order) // mbs
    sample_sq = src.sq[order]
    slot_sq = sample_sq.reshape(slots, mbs).sum(axis=1)
    # A slot whose every sample is one whole piece cannot change: re-packing never cuts such a piece.
    whole = np.diff(src.offsets)[order].reshape(slots, mbs).max(axis=1) == 1
    level = _repack_level(src, slot_sq, whole, mbs, seq)
    hot = (slot_sq > level + REPACK_TOLERANCE * (level + fixed_sq)) & ~whole
    if not hot.any():
        return None
    # As many of the coldest slots as take the hot slots' excess over the mean: the fine sand they bring is
    # what levels the hot ones.
    by_cost = np.argsort(slot_sq, kind="stable")
    mean = slot_sq.mean()
    excess = float(np.sum(slot_sq[hot] - mean))
    cold = int(np.searchsorted(np.cumsum(mean - slot_sq[by_cost]), excess)) + 1
    pool = hot.copy()
    pool[by_cost[:cold]] = True
    pool_slots = np.flatnonzero(pool)
    samples = order.reshape(slots, mbs)[pool_slots].reshape(-1)
    layout = _pack_slots(*src.positions(samples), len(pool_slots), mbs, seq, float(src.sq[samples].sum()))
    if layout.sq.reshape(-1, mbs).sum(axis=1).max() >= slot_sq.max() * (1 - 1e-12):
        return None
    if layout.lost > max_context_loss * len(order) * seq:
        return None
    sample_sq = sample_sq.copy()
    sample_sq.reshape(slots, mbs)[pool_slots] = layout.sq.reshape(-1, mbs)
    new_slot_sq = sample_sq.reshape(slots, mbs).sum(axis=1)
    # Ranks: reorder's grouping where its heaviest rank is still within REFINE_TOLERANCE of the mean rank (cost
    # with the fixed part), else regrouped if that is lighter; never heavier than reorder's heaviest rank.
    per_rank_fixed = fixed_sq * (slots // dp)
    limit = float(slot_sq[rank_slots].sum(axis=1).max()) * (1 + 1e-12)
    worst = float(new_slot_sq[rank_slots].sum(axis=1).max())
    if worst + per_rank_fixed > (1 + REFINE_TOLERANCE) * (new_slot_sq.sum() / dp + per_rank_fixed):
        regrouped = _group_ranks(new_slot_sq, dp)
        lighter = float(new_slot_sq[regrouped].sum(axis=1).max())
        if lighter < worst:
            rank_slots, worst = regrouped, lighter
    if worst > limit:
        return None
    return _Repacked(layout, pool_slots, sample_sq, rank_slots)


def _fill(ascending: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Least sum of squares of `room` tokens taken from pieces of these lengths: the shortest whole, one cut.
    (May count a piece that is also counted elsewhere: a lower bound all the same, only a weaker one.)"""
    csum = np.concatenate([[0.0], np.cumsum(ascending)])
    csq = np.concatenate([[0.0], np.cumsum(ascending ** 2)])
    room = np.clip(room, 0.0, csum[-1])
    whole = np.minimum(np.searchsorted(csum, room, side="right") - 1, len(ascending) - 1)
    return csq[whole] + (room - csum[whole]) ** 2


def repack_bound(lengths: np.ndarray, slots: int, mbs: int, seq: int, fill: bool = True) -> float:
    """A lower bound on the largest slot's sum of squared piece lengths when the longest pieces stay whole (but
    for a cut at a slot's margin). The largest of:
    - the mean slot;
    - for m = 1..slots: the slots holding the m longest pieces either hold one each, and then the heaviest costs
      at least their average, the rest of their room filled with the shortest pieces; or one holds two of them,
      at least the m-1-th and m-th longest plus the shortest pieces;
    - for t = 1, 2, ...: among the t*slots + 1 longest pieces some slot holds t + 1, at least the t + 1 shortest
      of them plus the shortest pieces;
    - pieces longer than half a sample need a sample each, so a slot holds at most mbs of them: `partition_bound`
      of those, padded with empty places to mbs per slot.
    Valid for any set of the longest pieces too, with fill=False (the rest of a slot's room then counts 0).
    """
    desc = np.sort(np.asarray(lengths, dtype=np.float64))[::-1]
    asc = desc[::-1] if fill else np.zeros(1)
    cap = float(mbs * seq)
    csq = np.concatenate([[0.0], np.cumsum(desc ** 2)])
    csum = np.concatenate([[0.0], np.cumsum(desc)])
    m = np.arange(1, min(slots, len(desc) - 1) + 1)
    alone = (csq[m] + _fill(asc, m * cap - csum[m])) / m
    pair = np.where(m >= 2, desc[m - 1] ** 2 + desc[np.maximum(m - 2, 0)] ** 2
                    + _fill(asc, cap - desc[m - 1] - desc[np.maximum(m - 2, 0)]), np.inf)
    spread = float(np.max(np.minimum(alone, pair))) if len(m) else 0.0
    t = np.arange(1, min(len(desc) // slots, 64) + 1)
    t = t[t * slots < len(desc)]
    lo, hi = t * slots + 1 - (t + 1), t * slots + 1                  # the t + 1 shortest of the top t*slots + 1
    pigeonhole = float(np.max(csq[hi] - csq[lo] + _fill(asc, cap - (csum[hi] - csum[lo])), initial=0.0))
    halves = desc[desc > seq / 2] ** 2
    separate = 0.0
    if 0 < len(halves) <= mbs * slots:
        separate = partition_bound(np.concatenate([halves, np.zeros(mbs * slots - len(halves))]), slots)
    return max(csq[-1] / slots, spread, pigeonhole, separate)
