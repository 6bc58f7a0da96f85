"""Collectives as Cells with their gradients, usable inside graph mode (Megatron-Core's mappings).

Each Cell wraps one transport (one group). Forward and backward are each one collective:

| Cell | forward | backward | used for |
| --- | --- | --- | --- |
| `CopyToGroup` | identity | all-reduce | input of a column-parallel layer |
| `ReduceFromGroup` | all-reduce | identity | output of a row-parallel layer |
| `AllReduce` | all-reduce | all-reduce | a sum every rank's loss depends on |
| `GatherFromGroup` | all-gather (axis 0) | reduce-scatter | sequence-parallel input of a column-parallel layer |
| `ReduceScatterToGroup` | reduce-scatter (axis 0) | all-gather | sequence-parallel output of a row-parallel layer |
| `AllToAll` | all-to-all (axis 0) | all-to-all | expert dispatch and combine |
| `AllToAllV` | uneven all-to-all (axis 0) | the reverse one | dropless expert dispatch and combine |
| `Broadcast` | root's value to all | sum to the root | replicated state |

The gradient conventions are those of a sum of the members' losses: the backward of an all-gather sums, at each
rank, the gradients every member's loss sends to that rank's slot. Inside a graph, a collective whose result is
unused may be removed by the compiler; every member must then remove it alike, so no Cell here makes its use
depend on the rank.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops


class _Collective(nn.Cell):
    def __init__(self, transport):
        super().__init__()
        self.t = transport


class CopyToGroup(_Collective):
    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (self.t.all_reduce(dout),)


class ReduceFromGroup(_Collective):
    def construct(self, x):
        return self.t.all_reduce(x)

    def bprop(self, x, out, dout):
        return (dout,)


class AllReduce(_Collective):
    def construct(self, x):
        return self.t.all_reduce(x)

    def bprop(self, x, out, dout):
        return (self.t.all_reduce(dout),)


class GatherFromGroup(_Collective):
    def construct(self, x):
        return self.t.all_gather(x)

    def bprop(self, x, out, dout):
        return (self.t.reduce_scatter(dout),)


class ReduceScatterToGroup(_Collective):
    def construct(self, x):
        return self.t.reduce_scatter(x)

    def bprop(self, x, out, dout):
        return (self.t.all_gather(dout),)


class AllToAll(_Collective):
    def construct(self, x):
        return self.t.all_to_all(x)

    def bprop(self, x, out, dout):
        return (self.t.all_to_all(dout),)


class AllToAllV(_Collective):
    """x [n, w] holding send_counts[j] rows for member j -> the recv_counts[j] rows each member j sent here."""

    def construct(self, x, send_counts, recv_counts):
        return self.t.all_to_all_v(x, send_counts, recv_counts)

    def bprop(self, x, send_counts, recv_counts, out, dout):
        return (self.t.all_to_all_v(dout, recv_counts, send_counts), ops.zeros_like(send_counts),
                ops.zeros_like(recv_counts))


class Broadcast(_Collective):
    def __init__(self, transport, root: int = 0):
        super().__init__(transport)
        self.root = root
        self.mine = 1.0 if transport.group.index == root else 0.0

    def construct(self, x):
        return self.t.broadcast(x, self.root)

    def bprop(self, x, out, dout):
        # every member must run the all-reduce: one whose result went unused would be removed from the graph on
        # the non-root members only, and the group's collectives would no longer pair up
        return (self.t.all_reduce(dout) * self.mine,)
