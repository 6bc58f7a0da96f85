"""A transport for one process standing in for one rank of a group: every collective returns a tensor of the shape
a real member of the group would get, and is recorded.

`RecordingTransport(group)` takes a `parallel.comm.groups.Group` (e.g. `ProcessGroups(layout, rank,
create=False).axis(Axis.TP)`), so the layers read its size and this rank's index from `.group` as they do from a real
transport. The values are meaningless (an all-gather tiles its input g times, a reduce-scatter keeps the first 1/g of
the rows, an all-reduce, an all-to-all and a broadcast return their input); the shapes are a real rank's. Each call
appends `(kind, group size, tuple(shape), dtype name)` to `calls` (and to a shared `log`, if one is given), with the
shape of the tensor as it enters the collective (an uneven all-to-all's rows, known only at run time, as -1). Run the model in PyNative mode, where the collectives' Cells run
their `bprop` as Python, so the backward's collectives are recorded too.

`transports(layout, rank, log)` gives one per axis (dp, tp, ep, edp), a group of one rank getting
`SelfTransport` as in training (`parallel.comm.transport_for`: nothing to exchange, nothing recorded).
"""
from __future__ import annotations

from mindspore import ops

from parallel.comm import ProcessGroups
from parallel.comm.transport import SelfTransport
from parallel.layout import Axis, ParallelLayout


def dtype_name(dtype) -> str:
    """float32, float16, bfloat16, int32 ... of a MindSpore dtype."""
    return str(dtype).lower()


class RecordingTransport:
    def __init__(self, group, log: list | None = None, name: str = ""):
        self.group = group
        self.size = group.size
        self.name = name
        self.calls: list[tuple] = []
        self.log = log

    def _record(self, kind: str, x) -> None:
        entry = (kind, self.size, tuple(int(d) for d in x.shape), dtype_name(x.dtype))
        self.calls.append(entry)
        if self.log is not None:
            self.log.append(entry + (self.name,))

    def all_reduce(self, x):
        self._record("all_reduce", x)
        return x

    def all_gather(self, x):
        self._record("all_gather", x)
        return ops.concat([x] * self.size, 0)

    def reduce_scatter(self, x):
        self._record("reduce_scatter", x)
        return x[:x.shape[0] // self.size]

    def all_to_all(self, x):
        self._record("all_to_all", x)
        return x

    def all_to_all_v(self, x, send_counts, recv_counts):
        # rows known only at run time: recorded as -1 (the report lists them so); this rank's own counts come back
        # from the recording all-to-all, so what it receives is what it sent
        entry = ("all_to_all_v", self.size, (-1,) + tuple(int(d) for d in x.shape[1:]), dtype_name(x.dtype))
        self.calls.append(entry)
        if self.log is not None:
            self.log.append(entry + (self.name,))
        return x

    def broadcast(self, x, root: int = 0):
        self._record("broadcast", x)
        return x


def transport(group, log: list | None = None, name: str = ""):
    """A RecordingTransport, or SelfTransport for a group of one rank (what training builds there)."""
    return SelfTransport(group) if group.size == 1 else RecordingTransport(group, log, name)


def transports(layout: ParallelLayout, rank: int, log: list | None = None) -> dict:
    """{name: transport} of world rank `rank` for dp (the dense gradients' group: data x context), tp, ep, edp, cp,
    etp and tp_cp (the ranks routing a sequence's positions under context parallelism)."""
    groups = ProcessGroups(layout, rank, create=False)
    out = {a.value: transport(groups.axis(a), log, a.value) for a in (Axis.TP, Axis.EP, Axis.EDP, Axis.CP, Axis.ETP)}
    out["dp"] = transport(groups.axis(Axis.DP, Axis.CP), log, "dp")
    out["tp_cp"] = transport(groups.axis(Axis.TP, Axis.CP), log, "tp_cp")
    return out
