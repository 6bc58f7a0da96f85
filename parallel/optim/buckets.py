"""Where each parameter's gradient and optimizer state live under the distributed optimizer: a pure plan.

Megatron-Core's DistributedOptimizer (megatron/core/distributed/param_and_grad_buffer.py, distrib_optimizer.py) lays
the gradients out in contiguous buffers cut into buckets; each bucket is reduce-scattered over its data-parallel
group, so that rank i of a group of g ends up with the summed i-th of g equal slices of the bucket, and rank i
updates exactly that slice of the fp32 master weights and both Adam moments. This module decides the buckets:

- Parameters are grouped by `Route` (which group the bucket is reduce-scattered over, which group its gradient is
  summed over first, which group its squares add over in the norm, its weight decay):
  a bucket holds parameters of one route only, so one collective and one decay rate serve all of it.
- Within a route, parameters go into buckets in the given order, a bucket closed once it holds `bucket_size`
  elements or more (a parameter is never split across buckets: a larger one is a bucket of its own, as Megatron
  does). `bucket_size <= 0`: one bucket per route.
- A bucket's length is padded up to a multiple of its group's size; the padding is zeros, reduced and updated like
  the rest and never read back into a parameter.

`BucketPlan.pieces(index)` says which elements of which parameters rank `index` of the group holds: the map the
checkpoint, the tensor dumps and expert migration use to find a parameter's state in the shards.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """How a parameter's gradient is reduced. `shard`: the group (a name into the transports) its bucket is
    reduce-scattered over and its state split over; `pre_sum`: a group its gradient is all-reduced over first (a
    tensor-parallel copy whose gradient is each rank's share), or None; `norm_sum`: the group over which its
    squares add up to the whole model's in the norm (tensor-parallel slices, expert shards), or None."""
    shard: str
    pre_sum: str | None = None
    norm_sum: str | None = None
    weight_decay: float = 0.0


@dataclass(frozen=True)
class Bucket:
    route: Route
    params: tuple[int, ...]         # indices into the plan's parameters, in buffer order
    starts: tuple[int, ...]         # each one's first element in the bucket
    numel: int                      # the parameters' elements
    padded: int                     # numel rounded up to a multiple of the group size
    group_size: int

    @property
    def shard_size(self) -> int:
        return self.padded // self.group_size


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + length) of parameter `param` (flattened) are elements [offset, offset + length) of
    this rank's shard of bucket `bucket`."""
    param: int
    bucket: int
    offset: int
    start: int
    length: int


@dataclass(frozen=True)
class BucketPlan:
    buckets: tuple[Bucket, ...]
    sizes: tuple[int, ...]          # every parameter's element count

    @classmethod
    def of(cls, sizes: list[int], routes: list[Route], group_sizes: dict[str, int],
           bucket_size: int) -> "BucketPlan":
        """`sizes[i]` / `routes[i]`: parameter i's element count and route; `group_sizes`: each shard group's size;
        `bucket_size`: elements a bucket holds before it is closed (<= 0: one bucket per route)."""
        if len(sizes) != len(routes):
            raise ValueError(f"{len(sizes)} sizes for {len(routes)} routes")
        order: dict[Route, list[int]] = {}
        for i, route in enumerate(routes):
            order.setdefault(route, []).append(i)
        buckets = []
        for route, members in order.items():
            g = group_sizes[route.shard]
            current: list[int] = []
            for i in members:
                current.append(i)
                if bucket_size > 0 and sum(sizes[j] for j in current) >= bucket_size:
                    buckets.append(_bucket(route, current, sizes, g))
                    current = []
            if current:
                buckets.append(_bucket(route, current, sizes, g))
        return cls(tuple(buckets), tuple(sizes))

    def pieces(self, index: dict[str, int]) -> list[Piece]:
        """What a rank holds, parameter by parameter (an empty piece is left out); `index[group]`: its position in
        each shard group."""
        out = []
        for b, bucket in enumerate(self.buckets):
            lo = index[bucket.route.shard] * bucket.shard_size
            hi = lo + bucket.shard_size
            for p, start in zip(bucket.params, bucket.starts):
                a, z = max(lo, start), min(hi, start + self.sizes[p])
                if z > a:
                    out.append(Piece(p, b, a - lo, a - start, z - a))
        return out

    def shard_elements(self) -> int:
        """Elements of one rank's shards over all buckets (padding included)."""
        return sum(b.shard_size for b in self.buckets)

    def backward_order(self) -> tuple[int, ...]:
        """The buckets in the order the backward completes them, the order to issue their reductions in: a bucket
        is complete once the gradient of its parameter earliest in the given (forward) order is, so the one whose
        earliest parameter comes last goes first (Megatron-Core builds its buckets in reverse for the same reason).
        Collectives on one communication stream run in the order they are issued: issued in the forward's order,
        the first bucket (the embedding's, complete last) would hold every other bucket's reduction back until
        the backward ends."""
        return tuple(sorted(range(len(self.buckets)), key=lambda b: -min(self.buckets[b].params)))

    def location(self, param: int) -> tuple[int, int]:
        """(bucket, first element in it) of parameter `param`."""
        for b, bucket in enumerate(self.buckets):
            if param in bucket.params:
                return b, bucket.starts[bucket.params.index(param)]
        raise KeyError(param)


def _bucket(route: Route, members: list[int], sizes: list[int], group_size: int) -> Bucket:
    starts, at = [], 0
    for i in members:
        starts.append(at)
        at += sizes[i]
    padded = -(-at // group_size) * group_size
    return Bucket(route, tuple(members), tuple(starts), at, padded, group_size)
