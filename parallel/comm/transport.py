"""Transports: the data movement of each collective on one group, as graph-mode callables without autodiff rules
(the Cells in `collectives.py` give them their gradients).

Two transports behind one interface, so the parallel modules above never ask which machine they run on:
- `NativeTransport` (Ascend over HCCL, GPU over NCCL): MindSpore's own primitives on the group, one each.
- `CpuTransport` (mccl): MindSpore's CPU collectives are AllReduce on any group and AllGather/Broadcast on the world
  group only (measured on 2.9; README), so the rest is made of those: an all-gather on a sub-group is an all-reduce
  of a zero buffer holding this rank's slot, an all-to-all an all-gather from which each rank keeps its column, a
  reduce-scatter an all-reduce of which each rank keeps its slice, a point-to-point transfer an all-reduce on the
  pair's group to which the receiver adds zeros. This moves more bytes than the real collectives (g times for an
  all-to-all); the values and, through the Cells, the gradients are exact.

Conventions: all-gather and all-to-all concatenate along axis 0 in group order; all-to-all sends rows
[j*c, (j+1)*c) of its input to the group's j-th rank and returns, at the same rows, what rank j sent.
`all_to_all_v(x, send_counts, recv_counts)` is the uneven form (the dropless expert exchange's): x [n, ...] holds
send_counts[j] rows for member j, in member order; the result holds recv_counts[j] rows from member j, in member
order. Its row count is known only at run time (graph mode's dynamic shape): `NativeTransport` binds MindSpore's
AlltoAllV (Ascend; counts moved to the host first, as MindFormers' dropless dispatcher does), `CpuTransport` puts
every member's rows into one buffer of exactly the group's rows (destination-major) and all-reduces it.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import ops

from parallel.comm.counters import CountingTransport, counting_enabled
from parallel.comm.groups import Group, world_group_name


def row_index(x):
    """0, 1, ... for the rows of `x` [n, w], n possibly known only at run time (then `x.shape[0]` is not)."""
    return ops.stop_gradient(ops.cumsum(ops.ones_like(x[:, 0], dtype=ms.int32), 0) - 1)


def segment_of(index, ends):
    """For each `index` [n], the segment it lies in, of segments ending (exclusive, cumulative) at `ends` [s]."""
    return ops.stop_gradient((ops.expand_dims(index, 1) >= ends).astype(ms.int32).sum(1))


class NativeTransport:
    """MindSpore's primitives on the group (HCCL on Ascend, NCCL on GPU)."""

    def __init__(self, group: Group):
        self.group = group
        g, name = group.size, group.name
        self._all_reduce = ops.AllReduce(op="sum", group=name)
        self._all_gather = ops.AllGather(group=name)
        self._reduce_scatter = ops.ReduceScatter(op="sum", group=name)
        self._all_to_all = ops.AlltoAll(split_count=g, split_dim=0, concat_dim=0, group=name)
        self._to_host = ops.MoveTo()

    def all_reduce(self, x):
        return self._all_reduce(x)

    def all_gather(self, x):
        return self._all_gather(x)

    def reduce_scatter(self, x):
        return self._reduce_scatter(x)

    def all_to_all(self, x):
        return self._all_to_all(x)

    def all_to_all_v(self, x, send_counts, recv_counts):
        # AlltoAllV takes a flat input and counts of elements, as host values (a sync per call, as in MindFormers)
        row = 1
        for d in x.shape[1:]:
            row *= d
        send = self._to_host(send_counts.astype(ms.int64), "CPU", True)
        recv = self._to_host(recv_counts.astype(ms.int64), "CPU", True)
        out = ops.AlltoAllV(group=self.group.name, block_size=row)(x.reshape(-1), send, recv)
        return out.reshape((-1,) + x.shape[1:])

    def broadcast(self, x, root: int):
        return ops.Broadcast(root_rank=self.group.ranks[root], group=self.group.name)((x,))[0]

    def send(self, x, tag: int = 0):
        peer = 1 - self.group.index
        return ops.Send(sr_tag=tag, dest_rank=peer, group=self.group.name)(x)

    def recv(self, shape, dtype, tag: int = 0):
        peer = 1 - self.group.index
        return ops.Receive(sr_tag=tag, src_rank=peer, shape=list(shape), dtype=dtype, group=self.group.name)()


class CpuTransport:
    """The same collectives from what mccl provides (see the module docstring)."""

    def __init__(self, group: Group):
        self.group = group
        self.size, self.me = group.size, group.index
        self.world = group.name == world_group_name()
        self._all_reduce = ops.AllReduce(op="sum", group=group.name)
        self._world_gather = ops.AllGather(group=group.name) if self.world else None

    def all_reduce(self, x):
        return self._all_reduce(x)

    def _slot(self, x):
        """[g, *x.shape]: zeros with x at this rank's slot."""
        parts = [ops.zeros_like(x)] * self.size
        parts[self.me] = x
        return ops.stack(parts)

    def all_gather(self, x):
        if self._world_gather is not None:
            return self._world_gather(x)
        return self._all_reduce(self._slot(x)).reshape((self.size * x.shape[0],) + x.shape[1:])

    def reduce_scatter(self, x):
        c = x.shape[0] // self.size
        return self._all_reduce(x)[self.me * c:(self.me + 1) * c]

    def all_to_all(self, x):
        g, c = self.size, x.shape[0] // self.size
        gathered = self.all_gather(x).reshape((g, g, c) + x.shape[1:])   # [source, destination, rows]
        return gathered[:, self.me].reshape(x.shape)

    def all_to_all_v(self, x, send_counts, recv_counts):
        # every member's counts [source, destination] (a fixed-shape all-gather), then one buffer of all the
        # group's rows, destination-major (source order inside), each row added at its place by its sender
        # (mccl's AllReduce takes floating point only: float32 holds counts exactly up to 2**24)
        counts = self.all_gather(ops.expand_dims(send_counts.astype(ms.float32), 0)).astype(ms.int32)
        to_member = counts.sum(0)
        member_start = ops.cumsum(to_member, 0) - to_member
        mine_start = member_start + (ops.cumsum(counts, 0) - counts)[self.me]       # my rows' first place per member
        send_counts = send_counts.astype(ms.int32)
        rows = row_index(x)
        member = segment_of(rows, ops.cumsum(send_counts, 0))
        place = ops.gather(mine_start, member, 0) + rows - ops.gather(ops.cumsum(send_counts, 0) - send_counts,
                                                                      member, 0)
        buffer = self._all_reduce(ops.unsorted_segment_sum(x, place, to_member.sum()))
        index = row_index(buffer)
        start, end = member_start[self.me], member_start[self.me] + to_member[self.me]
        return ops.gather(buffer, ops.nonzero(ops.logical_and(index >= start, index < end)).reshape(-1), 0)

    def broadcast(self, x, root: int):
        return self._all_reduce(x if self.me == root else ops.zeros_like(x))

    def send(self, x, tag: int = 0):
        # returns the all-reduce's result: inside a graph the caller must use it (an unused collective is removed
        # from the graph, and the receiver would wait)
        return self._all_reduce(x)

    def recv(self, shape, dtype, tag: int = 0):
        return self._all_reduce(ops.zeros(tuple(shape), dtype))


class SelfTransport:
    """A group of one rank: every collective is the identity (nothing to exchange, no group to create)."""

    def __init__(self, group: Group):
        self.group = group

    def all_reduce(self, x):
        return x

    all_gather = reduce_scatter = all_to_all = all_reduce

    def all_to_all_v(self, x, send_counts, recv_counts):
        return x

    def broadcast(self, x, root: int):
        return x


def transport_for(group: Group, device_target: str):
    """The transport of `group` on this machine, counted when counters are on (counters.py)."""
    if group.size == 1:
        return SelfTransport(group)
    transport = CpuTransport(group) if device_target == "CPU" else NativeTransport(group)
    return CountingTransport(transport) if counting_enabled() else transport
