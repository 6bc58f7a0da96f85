"""Token permutation by expert: the order every dispatcher sorts routed token copies into, each expert's group
size, and the drop of copies beyond an expert's capacity (`capacity.py` sizes it). Pure functions of the routing,
shared by the model's dispatchers and the alignment harness's expert-parallel emulation, so both permute
identically."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops


def stable_order(keys):
    """Indices that sort the int32 `keys` [n] stably. Each key is made unique as key * n + position, so the order is
    a pure function of the keys (ties keep their position) on every backend, whatever its sort."""
    n = keys.shape[0]
    return ops.sort(keys * n + ops.arange(0, n, dtype=ms.int32))[1]


def expert_group_sizes(flat_expert, num_experts: int):
    """int32 [E]: how many of the dispatched rows go to each expert (constant under the gradient)."""
    sizes = ops.one_hot(flat_expert, num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32)).sum(0)
    return ops.stop_gradient(sizes).astype(ms.int32)


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
