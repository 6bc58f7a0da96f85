"""Where a tensor-parallel region begins and ends, and the sequence splits of sequence parallelism (Megatron-Core's
`mappings.py`), over `parallel.comm`.

`TensorParallel` is one rank's view of its tensor-parallel group: the degree, its position, whether sequence
parallelism is on and the group's transport. A region is the stretch of a layer where the ranks compute different
shards (heads, FFN columns, vocabulary rows): `EnterRegion` opens it (sequence parallelism off: the replicated input
is used as is and its gradient all-reduced; on: the rank's sequence shard is all-gathered and its gradient
reduce-scattered back), a `RowParallelLinear` closes it. Replicated weights used inside a region (MLA's latent
projections and their norms, the router) therefore get a partial gradient on each rank, summed over tp by the
trainer; under sequence parallelism so do the weights used on sequence shards (the residual stream's norms).

Shards of the sequence are contiguous: rank r of tp holds positions [r*s/tp, (r+1)*s/tp) of every sequence.
Activations are batch-first [b, s, h]; the Cells of `parallel.comm` gather axis 0, so these put the sequence in
front and back again.
"""
from __future__ import annotations

from dataclasses import dataclass

from mindspore import nn, ops

from parallel.comm import CopyToGroup, GatherFromGroup, ProcessGroups, transport_for
from parallel.layout import Axis, ParallelLayout
from parallel.tp.layers import GatherReplicated, seq_first


@dataclass(frozen=True)
class TensorParallel:
    """A rank's tensor-parallel group: degree, position in it, sequence parallelism, the transport (None at 1)."""
    tp: int = 1
    index: int = 0
    sp: bool = False
    transport: object = None

    @classmethod
    def of(cls, layout: ParallelLayout, rank: int, device_target: str) -> "TensorParallel":
        if layout.tp == 1:
            return cls()
        group = ProcessGroups(layout, rank).axis(Axis.TP)
        return cls(layout.tp, group.index, bool(layout.sp), transport_for(group, device_target))

    def local(self, size: int, what: str) -> int:
        """This rank's share of a dimension split over tp."""
        if size % self.tp:
            raise ValueError(f"{what} {size} is not divisible by model_parallel {self.tp}")
        return size // self.tp


class GatherSequence(nn.Cell):
    """[b, s/tp, h] -> [b, s, h] for ranks that then compute different shards: all-gather of the sequence, whose
    backward reduce-scatters (sums the ranks' partial gradients and keeps this rank's positions)."""

    def __init__(self, tp: TensorParallel):
        super().__init__()
        self.gather = GatherFromGroup(tp.transport)

    def construct(self, x):
        return seq_first(self.gather(seq_first(x)))


class SplitSequence(nn.Cell):
    """A replicated [b, s, h] -> this rank's [b, s/tp, h] (Megatron's scatter_to_sequence_parallel_region): each
    rank then computes its own positions; the backward all-gathers the positions' gradients into the whole one."""

    def __init__(self, tp: TensorParallel):
        super().__init__()
        self.t, self.tp, self.me = tp.transport, tp.tp, tp.index

    def construct(self, x):
        n = x.shape[1] // self.tp
        return x[:, self.me * n:(self.me + 1) * n]

    def bprop(self, x, out, dout):
        return (seq_first(self.t.all_gather(seq_first(dout))),)


class GatherSequenceReplicated(nn.Cell):
    """[b, s/tp, h] -> [b, s, h] that every rank then uses alike (the inverse of SplitSequence): `GatherReplicated`
    over the sequence (its backward keeps this rank's positions of the replicated gradient, no collective)."""

    def __init__(self, tp: TensorParallel):
        super().__init__()
        self.gather = GatherReplicated(tp.transport)

    def construct(self, x):
        return seq_first(self.gather(seq_first(x)))


class EnterRegion(nn.Cell):
    """The input of a tensor-parallel region: the replicated [b, s, h] as is (gradient all-reduced over tp), or
    under sequence parallelism this rank's [b, s/tp, h] all-gathered into [b, s, h]. Identity at tp=1.

    Over tp the input is cast to `dtype` first, the compute dtype of the region's linear layers, which cast it so
    anyway: the collective moves (and its gradient comes back in) the compute dtype, not the float32 stream."""

    def __init__(self, tp: TensorParallel, dtype=None):
        super().__init__()
        self.active = tp.tp > 1
        self.dtype = dtype
        if self.active:
            self.enter = GatherSequence(tp) if tp.sp else CopyToGroup(tp.transport)

    def construct(self, x):
        if self.active:
            if self.dtype is not None:
                x = x.astype(self.dtype)
            return self.enter(x)
        return x
