"""Equal-size partitions minimising the largest sum: n items into `parts` parts of n/parts items each, largest
first then swaps that lower the heaviest part (`balanced_partition`), with the lower bound they aim at
(`partition_bound`). The balancer partitions samples into (rank, micro-batch) slots and slots into ranks."""
from __future__ import annotations

import numpy as np

# Swapping stops once the heaviest part is this close to its lower bound: closer is below timing noise.
REFINE_TOLERANCE = 5e-3
# Partitions with at most this many (part, item, item) triples refine by pricing every swap at once.
PAIRWISE_REFINE = 16384


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
    """Largest first, in rounds of `parts` items: the largest item of a round goes to the lightest part, the next
    to the next lightest, so every part takes one item per round -> members [parts, k]."""
    k = len(costs) // parts
    rounds = np.argsort(-costs, kind="stable").reshape(k, parts)
    load = np.zeros(parts)
    members = np.empty((parts, k), dtype=np.int64)
    for r in range(k):
        lightest = np.argsort(load, kind="stable")
        members[lightest, r] = rounds[r]
        load[lightest] += costs[rounds[r]]
    return members


def _refine(costs: np.ndarray, members: np.ndarray, target: float, max_rounds: int) -> np.ndarray:
    """Swap one item of the heaviest part with the item of another part that best evens the two, while it helps.

    For each item x of the heaviest part p and each part q the ideal partner is y = x - (S_p - S_q)/2; one
    searchsorted over all parts' sorted items (rows offset apart, each fenced by two sentinels) finds the two
    nearest candidates per (x, q). A swap helps only if it moves a positive amount less than S_p - S_q, so the
    sentinels (infinitely far), p's own items and items not smaller than x never win the least new maximum.
    """
    parts, k = members.shape
    if parts * k * k <= PAIRWISE_REFINE:
        return _refine_pairwise(costs, members, target, max_rounds)
    members = members.copy()
    vals = costs[members]
    sums = vals.sum(axis=1)
    top = float(costs.max())
    shift = np.arange(parts) * (top + 3.0)                    # row q spans [shift_q - 1, shift_q + top + 1]
    order = np.argsort(vals, axis=1, kind="stable")
    ys = np.full((parts, k + 2), -np.inf)                      # sorted items, between sentinels
    ys[:, -1] = np.inf
    ys[:, 1:-1] = np.take_along_axis(vals, order, 1)
    keys = ys + shift[:, None]                                 # the same, rows apart, for the search
    keys[:, 0], keys[:, -1] = shift - 1.0, shift + top + 1.0
    flat_keys, flat_ys = keys.ravel(), ys.ravel()             # views: they follow the row updates
    for _ in range(max_rounds):
        p = int(np.argmax(sums))
        top_sum = float(sums[p])
        if top_sum <= target:
            break
        # p's items ascending, so the wanted partners [q, i] ascend row after row: searchsorted runs fastest on
        # sorted needles. (Plain ufuncs, not np.clip: a round is a few dozen small calls, their overhead counts.)
        x = ys[p, 1:-1]
        want = (sums / 2)[:, None] + (x - top_sum / 2)
        np.minimum(np.maximum(want, -0.5, out=want), top + 0.5, out=want)
        want += shift[:, None]
        above = np.searchsorted(flat_keys, want)                  # [parts, k] flat index in row q
        best = None
        for at in (above - 1, above):                             # the nearest candidate below and above
            d = x - flat_ys[at]
            new_max = np.maximum(top_sum - d, sums[:, None] + d)
            f = int(np.argmin(new_max))
            if best is None or new_max.flat[f] < best[0]:
                best = (float(new_max.flat[f]), f, at, d)
        value, f, at, d = best
        if not value < top_sum * (1 - 1e-12):
            break
        q, xi = divmod(f, k)
        i = order[p, xi]
        j = order[q, at.flat[f] - q * (k + 2) - 1]
        moved = float(d.flat[f])
        members[p, i], members[q, j] = members[q, j], members[p, i]
        vals[p, i], vals[q, j] = vals[q, j], vals[p, i]
        sums[p] -= moved
        sums[q] += moved
        for r in (p, q):
            order[r] = np.argsort(vals[r], kind="stable")
            ys[r, 1:-1] = vals[r, order[r]]
            keys[r, 1:-1] = ys[r, 1:-1] + shift[r]
    return members


def _refine_pairwise(costs: np.ndarray, members: np.ndarray, target: float, max_rounds: int) -> np.ndarray:
    """`_refine` for small partitions (parts x k^2 pairs at most PAIRWISE_REFINE): every (x of the heaviest part,
    y of any part) swap priced at once, no sorted rows to keep: a round is a handful of calls on a few thousand
    numbers. The best swap is the one the nearest-candidate search finds (the new maximum is unimodal in y)."""
    members = members.copy()
    parts, k = members.shape
    vals = costs[members]
    sums = vals.sum(axis=1)
    for _ in range(max_rounds):
        p = int(np.argmax(sums))
        top_sum = float(sums[p])
        if top_sum <= target:
            break
        d = vals[p][:, None, None] - vals[None, :, :]              # [x of p, part q, y of q]: what x-y moves
        new_max = np.maximum(top_sum - d, sums[:, None] + d)        # p's own items and d <= 0 never win
        f = int(np.argmin(new_max))
        if not new_max.flat[f] < top_sum * (1 - 1e-12):
            break
        i, rest = divmod(f, parts * k)
        q, j = divmod(rest, k)
        moved = float(d.flat[f])
        members[p, i], members[q, j] = members[q, j], members[p, i]
        vals[p, i], vals[q, j] = vals[q, j], vals[p, i]
        sums[p] -= moved
        sums[q] += moved
    return members


def balanced_partition(costs: np.ndarray, parts: int, max_swaps: int | None = None) -> np.ndarray:
    """Indices [parts, n/parts]: equal-size parts whose largest sum is within REFINE_TOLERANCE of the bound
    where single swaps (at most `max_swaps`, default 4 x parts) can get there. Deterministic."""
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    if parts < 1 or n % parts:
        raise ValueError(f"balanced_partition: {n} items do not split into {parts} equal parts")
    if parts == 1 or n == parts:
        return np.arange(n).reshape(parts, -1)
    target = partition_bound(costs, parts) * (1 + REFINE_TOLERANCE)
    return _refine(costs, _lpt(costs, parts), target, max_rounds=4 * parts if max_swaps is None else max_swaps)


def _group_ranks(slot_sq: np.ndarray, dp: int) -> np.ndarray:
    """Slots [dp, mb] of each rank, balancing their sums. Swaps capped at a quarter of the ranks: where many ranks
    tie for the heaviest (slot costs in two bands after repack) each swap lowers it by hundredths of a percent."""
    return balanced_partition(slot_sq, dp, max(8, dp // 4))
