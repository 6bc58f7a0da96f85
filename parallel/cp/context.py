"""Context parallelism: each rank of a context-parallel group computes a share of every sequence's positions, and
attention sees the whole sequence through gathered keys and values (Megatron-Core's `cp_comm_type: all_gather`).

The split is load-balanced for causal attention: the sequence is cut into 2*cp equal blocks and rank r holds blocks
r and 2*cp-1-r (a front and a back block), so every rank's queries see about as many keys. A rank's tensors hold its
positions in that order ([front block | back block]); `shard_positions` says which they are.

What moves between the ranks is small and exact:
- the tokens, labels, loss mask, segment ids and positions of the whole sequence are on every rank (the data loader
  gives a context-parallel group one data-parallel rank's rows); `ShardSequence` takes the rank's positions;
- attention gathers the rank's compressed keys and values (MLA's normed latent and its rotated shared key, one
  tensor [b, s/cp, kv_lora_rank + rope]) over the group with `GatherContext` (an all-gather whose backward is a
  reduce-scatter), put back in sequence order; the rank's query rows attend at their own positions (the flash
  kernel's `positions`), so causal and per-document masks hold across the shards;
- each loss is the rank's part of the whole sequence's token mean, summed over the group (`ReduceFromGroup`: the
  value every rank logs is the whole one; the backward is each rank's own part).

Gradients follow the convention of tensor parallelism's partial weights: each rank's gradient is that of its part
of the loss, so the trainer sums every dense gradient over the data x context group and divides by data_parallel
(telechat_moe/gradients.py), and a routed expert's over its expert-data-parallel group, which holds the cp ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from parallel.comm import GatherFromGroup, ProcessGroups, ReduceFromGroup, transport_for
from parallel.layout import Axis, ParallelLayout
from parallel.tp.mappings import TensorParallel


def shard_positions(seq: int, cp: int, index: int) -> np.ndarray:
    """int32 [seq/cp]: the positions rank `index` of `cp` holds, its front block then its back block."""
    if seq % (2 * cp):
        raise ValueError(f"seq_length {seq} is not divisible by 2*context_parallel = {2 * cp}")
    n = seq // (2 * cp)
    back = 2 * cp - 1 - index
    return np.concatenate([np.arange(index * n, (index + 1) * n), np.arange(back * n, (back + 1) * n)]).astype(
        np.int32)


def gathered_order(seq: int, cp: int) -> np.ndarray:
    """int32 [seq]: for each sequence position, its row in the group's gathered shards (rank 0's, rank 1's, ...)."""
    held = np.concatenate([shard_positions(seq, cp, r) for r in range(cp)])
    order = np.empty(seq, np.int32)
    order[held] = np.arange(seq, dtype=np.int32)
    return order


@dataclass(frozen=True)
class ContextParallel:
    """A rank's context-parallel group: the degree, its position in it, the transport (None at 1), the sequence
    length it splits, and the transport of the tensor x context group (the ranks sharing a sequence's tokens)."""
    cp: int = 1
    index: int = 0
    transport: object = None
    seq: int = 0
    tokens_transport: object = None

    @classmethod
    def of(cls, layout: ParallelLayout, rank: int, device_target: str, seq: int) -> "ContextParallel":
        if layout.cp == 1:
            return cls()
        groups = ProcessGroups(layout, rank)
        group = groups.axis(Axis.CP)
        return cls(layout.cp, group.index, transport_for(group, device_target), seq,
                   transport_for(groups.axis(Axis.TP, Axis.CP), device_target))

    def positions(self) -> np.ndarray:
        return shard_positions(self.seq, self.cp, self.index)

    def tokens(self, tp: TensorParallel) -> TensorParallel:
        """The router's view of the ranks that each route a share of a sequence's positions: tp x cp of them (the
        balance losses' statistics are summed over this group; parallel/tp's group at cp=1)."""
        if self.cp == 1:
            return tp
        return TensorParallel(tp.tp * self.cp, 0, tp.sp, self.tokens_transport)


class ShardSequence(nn.Cell):
    """x [b, s, ...] of the whole sequence -> this rank's positions [b, s/cp, ...] (identity at cp=1). For the
    model's inputs (token ids, labels, masks, positions), which every rank of the group holds whole: the
    gradient, where there is one, is this rank's rows scattered back, no collective."""

    def __init__(self, cp: ContextParallel):
        super().__init__()
        self.active = cp.cp > 1
        if self.active:
            self.index = Tensor(cp.positions())

    def construct(self, x):
        if self.active:
            return ops.gather(x, self.index, 1)
        return x


class GatherContext(nn.Cell):
    """This rank's [b, s/cp, w] -> the whole sequence's [b, s, w] in sequence order: an all-gather over the group
    (backward: reduce-scatter, the members' gradients of this rank's rows summed), the shards put back in order."""

    def __init__(self, cp: ContextParallel):
        super().__init__()
        self.gather = GatherFromGroup(cp.transport)
        self.order = Tensor(gathered_order(cp.seq, cp.cp))

    def construct(self, x):
        gathered = ops.transpose(self.gather(ops.transpose(x, (1, 0, 2))), (1, 0, 2))
        return ops.gather(gathered, self.order, 1)


class SumOverContext(nn.Cell):
    """A loss made of this rank's part of a token mean over the whole sequence -> the whole mean (every rank the
    same value), the backward each rank's own part. `part(mean, mask, whole_mask)`: the rank's mean over its
    `mask` [b, s/cp] reweighted to the whole sequence's `whole_mask` [b, s] tokens, then summed over the group."""

    def __init__(self, cp: ContextParallel):
        super().__init__()
        self.sum = ReduceFromGroup(cp.transport)

    def construct(self, mean, mask, whole_mask):
        mine = mask.astype(ms.float32).sum()
        whole = ops.maximum(whole_mask.astype(ms.float32).sum(), 1.0)
        return self.sum(mean * ops.maximum(mine, 1.0) / whole)
