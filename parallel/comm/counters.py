"""Counters of what the communication layer issued: each collective a transport runs records its kind, its group
and the bytes of the tensor that enters it, when it runs.

`counting(True)` before the parallel modules build their transports makes `transport_for` wrap each one (of a group
of more than one rank) in `CountingTransport`. Every collective call then passes its input's element count and dtype
to a host callback (`ops.Custom(func_type="pyfunc")`), tied to the collective by `ops.depend`, so the count happens
each time the compiled graph runs the collective, forward and backward alike, and holds the bytes of that call's
actual tensor (an uneven all-to-all's rows known only at run time included). A callback costs a host round trip per
collective: counting is for measurement runs (the trainer's `profile.collectives`), never on by default.

What is counted is the collective's contract, not how a transport moves it: on CPU an all-gather over a sub-group is
made of an all-reduce of g times the bytes (transport.py), and it counts as one all-gather of its input. Bytes are
the input's on this rank: an all-reduce's, reduce-scatter's or all-to-all's whole input, an all-gather's slot (the
output is g times it), a broadcast's tensor, a point-to-point transfer's sent tensor (a receive counts nothing: its
bytes are the sender's). Kinds: all_reduce, all_gather, reduce_scatter, all_to_all (all_to_all_v counts as one),
broadcast, p2p.
"""
from __future__ import annotations

import re
import threading
from collections import defaultdict

import numpy as np
import mindspore as ms
from mindspore import ops

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "p2p")


class CommCounters:
    """Calls and bytes by (kind, group label, group size), this process's, since the last `take()`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, int], list[int]] = defaultdict(lambda: [0, 0])

    def add(self, kind: str, group: str, size: int, nbytes: int) -> None:
        with self._lock:
            entry = self._counts[(kind, group, size)]
            entry[0] += 1
            entry[1] += int(nbytes)

    def take(self) -> list[dict]:
        """What was counted since the last call, one record per (kind, group, size); the counts restart."""
        with self._lock:
            counts, self._counts = self._counts, defaultdict(lambda: [0, 0])
        return [{"kind": k, "group": g, "size": s, "calls": c, "bytes": b}
                for (k, g, s), (c, b) in sorted(counts.items())]


COUNTERS = CommCounters()
_enabled = False


def counting(on: bool) -> None:
    """Whether `transport_for` counts the transports it builds from now on."""
    global _enabled
    _enabled = bool(on)


def counting_enabled() -> bool:
    return _enabled


def by_kind(records: list[dict]) -> dict[str, int]:
    """Bytes per kind of `CommCounters.take()`'s records (every kind of KINDS, 0 where none ran)."""
    out = dict.fromkeys(KINDS, 0)
    for r in records:
        out[r["kind"]] += r["bytes"]
    return out


def group_label(name: str) -> str:
    """A group's axis as its name says it ('tp', 'dp_cp', 'expert', 'p2p' ...; 'world' for the world group)."""
    match = re.match(r"(.*?)_\d+_\d+_[0-9a-f]+$", name)
    return match.group(1) if match else "world"


def _tick(kind: str, group, counters: CommCounters):
    """A graph operator that counts, each time it runs, `kind` on `group` of the bytes of a tensor given as its
    element count (int32 [1]) and a one-element sample of its dtype; a float32 [1] of zero out, for `ops.depend`.
    The callback never sees the tensor itself (no copy to the host), and the count is the run's even where the rows
    are known only at run time."""
    label, size = group_label(group.name), group.size

    def count(numel, sample):
        counters.add(kind, label, size, int(numel[0]) * sample.itemsize)
        return np.zeros((1,), np.float32)

    return ops.Custom(count, out_shape=lambda numel, sample: (1,), out_dtype=lambda numel, sample: ms.float32,
                      func_type="pyfunc")


def _size_of(x):
    """The arguments of a tick for tensor `x`: its element count as a tensor (known at run time for an uneven
    all-to-all's rows; a 0-d tensor counts one) and a one-element tensor of its dtype."""
    return ops.dyn_shape(ops.reshape(x, (-1,))).astype(ms.int32), ops.zeros((1,), x.dtype)


class CountingTransport:
    """`inner`'s collectives, each counted as it runs (module docstring); every other attribute is `inner`'s."""

    def __init__(self, inner, counters: CommCounters = COUNTERS):
        self.inner = inner
        self.group = inner.group
        # one counting operator per kind, as plain attributes (what graph mode resolves in a method it compiles)
        self.count_all_reduce, self.count_reduce_scatter, self.count_all_gather, self.count_all_to_all, \
            self.count_broadcast, self.count_p2p = (_tick(kind, inner.group, counters) for kind in KINDS)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def all_reduce(self, x):
        return self.inner.all_reduce(ops.depend(x, self.count_all_reduce(*_size_of(x))))

    def all_gather(self, x):
        return self.inner.all_gather(ops.depend(x, self.count_all_gather(*_size_of(x))))

    def reduce_scatter(self, x):
        return self.inner.reduce_scatter(ops.depend(x, self.count_reduce_scatter(*_size_of(x))))

    def all_to_all(self, x):
        return self.inner.all_to_all(ops.depend(x, self.count_all_to_all(*_size_of(x))))

    def all_to_all_v(self, x, send_counts, recv_counts):
        return self.inner.all_to_all_v(ops.depend(x, self.count_all_to_all(*_size_of(x))), send_counts, recv_counts)

    def broadcast(self, x, root: int):
        return self.inner.broadcast(ops.depend(x, self.count_broadcast(*_size_of(x))), root)

    def send(self, x, tag: int = 0):
        return self.inner.send(ops.depend(x, self.count_p2p(*_size_of(x))), tag)

    def recv(self, shape, dtype, tag: int = 0):
        return self.inner.recv(shape, dtype, tag)
