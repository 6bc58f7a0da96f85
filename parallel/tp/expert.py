"""Expert tensor parallelism (Megatron-Core's expert_tensor_parallel_size, MindFormers' expert_model_parallel): each
routed expert's FFN split over the etp ranks of its expert group, the gate and up projections by columns
(column-parallel), the down projection by rows (row-parallel), so each rank computes a partial sum of every expert
output it holds.

The etp ranks of an expert group hold the same experts and receive different token copies from their EP exchanges
(each exchange runs among the ranks at one etp position; ParallelLayout's expert slab). Before the experts,
`ExpertRows.gather` brings every peer's rows to every peer (an uneven all-gather: the rows per expert are counted
and all-gathered, then each rank sends all its rows to every peer in one uneven all-to-all) and regroups them
expert-major for the grouped matmul; after them, `ExpertRows.scatter` sends each peer the partial sums of its own
rows and adds the etp partials (a reduce-scatter). Their backwards are the mirror collectives, so the gradients of
the shards and of the rows come out as one process computes them.

Packed gate|up weights [h, 2I] split as [gate shard | up shard] of I/etp columns each (`packed_columns`), so the
SwiGLU of a shard is the shard of the SwiGLU.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import mindspore as ms
from mindspore import nn, ops

from parallel.comm import AllToAllV, ProcessGroups, transport_for
from parallel.comm.transport import row_index
from parallel.ep.permute import regroup
from parallel.layout import Axis, ParallelLayout
from parallel.tp.layers import shard_range


@dataclass(frozen=True)
class ExpertTensorParallel:
    """A rank's expert-tensor-parallel group: degree, position in it, the transport (None at 1)."""
    etp: int = 1
    index: int = 0
    transport: object = None

    @classmethod
    def of(cls, layout: ParallelLayout, rank: int, device_target: str) -> "ExpertTensorParallel":
        if layout.etp == 1:
            return cls()
        group = ProcessGroups(layout, rank).axis(Axis.ETP)
        return cls(layout.etp, group.index, transport_for(group, device_target))


def packed_columns(full: np.ndarray, etp: int, index: int) -> np.ndarray:
    """Rank `index`'s columns of packed gate|up weights [..., 2I]: its I/etp gate columns, then its up columns."""
    half = full.shape[-1] // 2
    begin, end = shard_range(half, etp, index, "moe_intermediate_size")
    return np.concatenate((full[..., begin:end], full[..., half + begin:half + end]), -1)


def packed_whole(shards: np.ndarray, etp: int) -> np.ndarray:
    """The packed gate|up weights [..., 2I] from the etp ranks' `packed_columns` put side by side along the last
    axis: every rank's gate columns first, then every rank's up columns (the inverse of `packed_columns`)."""
    halves = [np.split(s, 2, -1) for s in np.split(shards, etp, -1)]
    return np.concatenate([g for g, _ in halves] + [u for _, u in halves], -1)


class ExpertRows(nn.Cell):
    """The rows for this rank's experts gathered over the etp group and the expert outputs' partial sums returned
    (module docstring)."""

    def __init__(self, etp: ExpertTensorParallel, experts: int):
        super().__init__()
        self.t, self.etp, self.experts = etp.transport, etp.etp, experts
        self.to_peers = AllToAllV(etp.transport)
        self.from_peers = AllToAllV(etp.transport)

    def gather(self, tokens, group_sizes):
        """tokens [n, h] sorted by expert (rows past the groups last: dropped copies), group_sizes [E] -> (every
        peer's rows [N, h] expert-major, their group sizes [E], state for `scatter`)."""
        # the rows, as a tensor: after an exchange they are known only at run time
        n = ops.stop_gradient(ops.ones_like(tokens[:, 0], dtype=ms.int32).sum().astype(ms.int32))
        sizes = group_sizes.astype(ms.int32)
        # one more segment per peer: its rows past the groups (none after an exchange), kept last
        mine = ops.concat((sizes, (n - sizes.sum()).reshape(1)))
        counts = ops.stop_gradient(self.t.all_gather(mine.astype(ms.float32))).astype(ms.int32)
        counts = counts.reshape(self.etp, self.experts + 1)                       # [peer, expert + tail]
        send = ops.ones(self.etp, ms.int32) * n
        recv = counts.sum(1).astype(ms.int32)
        received = self.to_peers(ops.tile(tokens, (self.etp, 1)), send, recv)    # peer-major
        by_expert, back = regroup(counts, row_index(received))
        return ops.gather(received, by_expert, 0), counts[:, :self.experts].sum(0).astype(ms.int32), (back, send, recv)

    def scatter(self, out, state):
        """The experts' partial outputs [N, h] in `gather`'s order -> this rank's rows [n, h], summed over etp."""
        back, send, recv = state
        returned = self.from_peers(ops.gather(out, back, 0), recv, send)          # [etp * n, h], peer-major
        return returned.reshape(self.etp, -1, returned.shape[-1]).sum(0)
