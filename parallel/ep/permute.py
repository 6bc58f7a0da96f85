"""Token permutation by expert: the order every dispatcher sorts routed token copies into, each expert's group
size, the places of rows moved between segment orders (`key_places`, `regroup`: the dropless exchange's, whose row
counts a graph may know only at run time), and the drop of copies beyond an expert's capacity (`capacity.py`
sizes it). Pure functions of the routing, shared by the model's dispatchers and the alignment harness's
expert-parallel emulation, so both permute identically."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from parallel.comm.transport import row_index, segment_of


def stable_order(keys):
    """Indices that sort the int32 `keys` [n] stably. Each key is made unique as key * n + position, so the order is
    a pure function of the keys (ties keep their position) on every backend, whatever its sort."""
    n = keys.shape[0]
    return ops.sort(keys * n + ops.arange(0, n, dtype=ms.int32))[1]


def expert_group_sizes(flat_expert, num_experts: int):
    """int32 [E]: how many of the dispatched rows go to each expert (constant under the gradient)."""
    sizes = ops.one_hot(flat_expert, num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32)).sum(0)
    return ops.stop_gradient(sizes).astype(ms.int32)


def key_places(keys, num_keys: int):
    """Where each row goes when rows are grouped by `keys` [n] in [0, num_keys) (stable inside a key), and how many
    rows each key has: (places [n], counts [num_keys]), int32 and constant under the gradient."""
    one_hot = ops.one_hot(keys, num_keys, ops.ones((), ms.int32), ops.zeros((), ms.int32))
    counts = one_hot.sum(0)
    before = ((ops.cumsum(one_hot, 0) - one_hot) * one_hot).sum(1)
    return ops.stop_gradient(ops.gather(ops.cumsum(counts, 0) - counts, keys, 0) + before), ops.stop_gradient(counts)


def regroup(counts, rows):
    """Rows held in segments (a, b) in a-major order, `counts` [A, B] int32 rows each, `rows` their `row_index`,
    regrouped b-major: for each row of the b-major order its row in the a-major one (gather with it to regroup), and
    for each a-major row its place in the b-major order (gather with it to go back). The expert exchange's received
    rows: source-major as they arrive, expert-major for the grouped matmul."""
    a, b = counts.shape
    by_a, by_b = counts.reshape(-1), counts.transpose(1, 0).reshape(-1)
    start_a = (ops.cumsum(by_a, 0) - by_a).reshape(a, b).transpose(1, 0).reshape(-1)   # b-major segment -> a start
    start_b = ops.cumsum(by_b, 0) - by_b
    in_b = segment_of(rows, ops.cumsum(by_b, 0))
    from_a = ops.gather(start_a, in_b, 0) + rows - ops.gather(start_b, in_b, 0)
    in_a = segment_of(rows, ops.cumsum(by_a, 0))
    segment_b = (in_a % b) * a + in_a // b
    to_b = ops.gather(start_b, segment_b, 0) + rows - (ops.gather(ops.cumsum(by_a, 0) - by_a, in_a, 0))
    return ops.stop_gradient(from_a), ops.stop_gradient(to_b)


class _SegmentSum(nn.Cell):
    """ops.unsorted_segment_sum for ids known to lie in [0, segments): its gradient is the plain gather of the
    output gradient. MindSpore's own backward also masks ids outside the range, a LogicalAnd and a Select over
    the whole [rows, hidden] gradient (on tiny's combine 6 of 7 ms a call)."""

    def construct(self, x, ids, segments):
        return ops.unsorted_segment_sum(x, ids, segments)

    def bprop(self, x, ids, segments, out, dout):
        return ops.gather(dout, ids, 0), ops.zeros_like(ids), 0


_SEGMENT_SUM = _SegmentSum()


def segment_sum(x, ids, segments: int):
    """Rows of `x` [n, ...] added into `segments` rows by `ids` [n], every id in [0, segments)."""
    return _SEGMENT_SUM(x, ids, segments)


def drop_over_capacity(indices, weights, num_experts: int, capacity: int, policy: str):
    """The routing [T, k] with every copy beyond its expert's `capacity` dropped (expert -1, weight 0): `probs`
    keeps each expert's highest-weight copies, `position` its earliest (token order); Megatron's drop policies.
    Exactly `capacity` at most per expert (ties in weight broken by the sort, alike on every backend's run)."""
    t, k = indices.shape
    n = t * k
    flat = indices.reshape(-1)
    position = ops.arange(0, n, dtype=ms.int32)
    if policy == "probs":
        priority = ops.argsort(ops.sort(weights.reshape(-1).astype(ms.float32), descending=True)[1]).astype(ms.int32)
    else:
        priority = position
    order = ops.sort(flat * n + priority)[1]                 # by expert, then by priority
    sizes = expert_group_sizes(flat, num_experts)
    start = ops.cumsum(sizes, 0) - sizes
    rank = position - ops.gather(start, ops.gather(flat, order, 0), 0)   # place in its expert's queue, sorted
    keep = ops.gather(rank < capacity, ops.argsort(order), 0)
    keep = ops.stop_gradient(keep).reshape(t, k)
    return ops.where(keep, indices, -1), ops.where(keep, weights, ops.zeros_like(weights))
