"""Each collective Cell of parallel/comm across real processes (the CPU transport), forward and gradient, against
NumPy on every member's inputs: on the world group, on a sub-group of two and on a group of one (the uneven
all-to-all with as many rows as `_uneven` says, different for every pair); and a point-to-point transfer. Called by ep_layer.py's 4-process run (one msrun start for both)."""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from parallel.comm import (AllReduce, AllToAll, AllToAllV, Broadcast, CopyToGroup, GatherFromGroup, ProcessGroups,
                           ReduceFromGroup, ReduceScatterToGroup, transport_for)
from parallel.layout import Axis, ParallelLayout

ROWS, COLS = 4, 3


def _x(rank: int) -> np.ndarray:
    return np.random.default_rng(100 + rank).normal(size=(ROWS, COLS)).astype(np.float32)


def _cotangent(rank: int, rows: int) -> np.ndarray:
    return np.random.default_rng(200 + rank).normal(size=(rows, COLS)).astype(np.float32)


def _expected(kind: str, me: int, xs: list, cs: list):
    """(forward, gradient w.r.t. this member's input) for the members' inputs xs and output cotangents cs."""
    g = len(xs)
    c = ROWS // g
    if kind == "AllReduce":
        return sum(xs), sum(cs)
    if kind == "CopyToGroup":
        return xs[me], sum(cs)
    if kind == "ReduceFromGroup":
        return sum(xs), cs[me]
    if kind == "GatherFromGroup":
        return np.concatenate(xs), sum(ci[me * ROWS:(me + 1) * ROWS] for ci in cs)
    if kind == "ReduceScatterToGroup":
        return sum(xs)[me * c:(me + 1) * c], np.concatenate(cs)
    if kind == "AllToAll":
        return (np.concatenate([xs[j][me * c:(me + 1) * c] for j in range(g)]),
                np.concatenate([cs[j][me * c:(me + 1) * c] for j in range(g)]))
    if kind == "Broadcast":
        return xs[0], (sum(cs) if me == 0 else np.zeros_like(cs[me]))
    raise ValueError(kind)


def _out_rows(kind: str, g: int) -> int:
    return {"GatherFromGroup": g * ROWS, "ReduceScatterToGroup": ROWS // g}.get(kind, ROWS)


class _Gradient(nn.Cell):
    def __init__(self, cell):
        super().__init__()
        self.cell = cell
        self.grad = ops.GradOperation(sens_param=True)

    def construct(self, x, cotangent):
        return self.grad(self.cell)(x, cotangent)


def _uneven(source: int, destination: int) -> int:
    """Rows member `source` sends member `destination` in the uneven all-to-all's check."""
    return 1 + (source + 2 * destination) % 3


class _UnevenGradient(nn.Cell):
    """The gradient of an AllToAllV Cell w.r.t. its rows, the counts as inputs too."""

    def __init__(self, cell):
        super().__init__()
        self.cell = cell
        self.grad = ops.GradOperation(sens_param=True)

    def construct(self, x, send, recv, cotangent):
        return self.grad(self.cell)(x, send, recv, cotangent)


def _all_to_all_v_errors(t, group, rank: int) -> dict[str, float]:
    g, me = group.size, group.index
    send = [[_uneven(i, j) for j in range(g)] for i in range(g)]
    xs = [np.random.default_rng(300 + i).normal(size=(sum(send[i]), COLS)).astype(np.float32) for i in range(g)]
    recv = [send[i][me] for i in range(g)]
    cs = [np.random.default_rng(400 + j).normal(size=(sum(send[i][j] for i in range(g)), COLS)).astype(np.float32)
          for j in range(g)]

    def part(rows, counts, j):      # rows [sum(counts), w] -> the block of member j
        return rows[sum(counts[:j]):sum(counts[:j + 1])]

    want_y = np.concatenate([part(xs[i], send[i], me) for i in range(g)])
    want_dx = np.concatenate([part(cs[j], [send[i][j] for i in range(g)], me) for j in range(g)])
    cell = AllToAllV(t)
    counts = Tensor(np.array(send[me], np.int32)), Tensor(np.array(recv, np.int32))
    y = cell(Tensor(xs[me]), *counts).asnumpy()
    dx = _UnevenGradient(cell)(Tensor(xs[me]), *counts, Tensor(cs[me])).asnumpy()
    return {"AllToAllV on forward": float(np.abs(y - want_y).max()) if y.shape == want_y.shape else np.inf,
            "AllToAllV on gradient": float(np.abs(dx - want_dx).max()) if dx.shape == want_dx.shape else np.inf}


def check_collectives(rank: int, world: int) -> dict[str, float]:
    """Worst absolute error of each (collective, group) case on this rank (graph mode)."""
    groups = ProcessGroups(ParallelLayout(dp=world, ep=2).validate(world), rank)
    errors = {}
    for label, group in (("world", groups.axis(Axis.DP)), ("pair", groups.axis(Axis.EP)),
                         ("self", groups.axis(Axis.TP))):
        t = transport_for(group, "CPU")
        for cell in (AllReduce(t), CopyToGroup(t), ReduceFromGroup(t), GatherFromGroup(t), ReduceScatterToGroup(t),
                     AllToAll(t), Broadcast(t, 0)):
            kind = type(cell).__name__
            rows = _out_rows(kind, group.size)
            xs = [_x(r) for r in group.ranks]
            cs = [_cotangent(r, rows) for r in group.ranks]
            want_y, want_dx = _expected(kind, group.index, xs, cs)
            y = cell(Tensor(_x(rank))).asnumpy()
            dx = _Gradient(cell)(Tensor(_x(rank)), Tensor(_cotangent(rank, rows))).asnumpy()
            errors[f"{kind} on {label}: forward"] = float(np.abs(y - want_y).max())
            errors[f"{kind} on {label}: gradient"] = float(np.abs(dx - want_dx).max())
        errors.update({name.replace(" on", f" on {label}:"): err
                       for name, err in _all_to_all_v_errors(t, group, rank).items()})
    # point-to-point: 0 -> 1 (and 3 -> 2 with four ranks), each pair on its own group
    peer = rank ^ 1
    if peer < world:
        t = transport_for(groups.pair(peer), "CPU")
        if rank in (0, 3):
            t.send(Tensor(_x(rank)))
        else:
            errors["send/recv"] = float(np.abs(t.recv((ROWS, COLS), ms.float32).asnumpy() - _x(peer)).max())
    return errors
