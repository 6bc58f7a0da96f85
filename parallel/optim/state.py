"""The distributed optimizer's state by parameter, outside the training graph: what checkpoints, tensor dumps and
expert migration need of a `ShardedAdamW` whose state lives in bucket slices.

- `local_pieces(opt)`: this rank's part of each parameter's master, adam_m and adam_v, as flat float32 arrays
  (the elements [start, start + length) of the flattened parameter; `Piece`), which a checkpoint writes as is.
- `load_pieces(opt, pieces)`: the reverse, after a checkpoint assembled them for this rank.
- `whole_states(opt)` / `whole_gradients(opt, shards)`: every parameter's state or reduced gradient, whole, on
  every rank (each bucket all-gathered over its group: collective).
- `write_whole(opt, param, kind, value)`: replace one parameter's state (the slice this rank holds of `value`).

Writes go through an assignment inside a graph (`Overwrite`): Parameter.set_data between calls of a graph that
updates that Parameter in place is not seen by it (MindSpore 2.9, measured by the trainer's authors).
"""
from __future__ import annotations

import numpy as np
from mindspore import ParameterTuple, Tensor, nn, ops

from parallel.optim.buckets import Piece

KINDS = ("master", "adam_m", "adam_v")
_writers: dict = {}     # (optimizer, kind, buckets) -> its Overwrite, compiled once


def _tensors(opt, kind: str):
    return {"master": opt.master, "adam_m": opt.exp_avg, "adam_v": opt.exp_avg_sq}[kind]


def kinds(opt) -> tuple[str, ...]:
    """The states `opt` holds: a master slice only below float32 (float32 weights are their own master)."""
    return KINDS if opt.master is not None else KINDS[1:]


class Overwrite(nn.Cell):
    """New values into parameters inside a graph: Parameter.set_data between calls of the graphs that use a
    parameter was not seen by them on MindSpore 2.9 (see TrainStep), an assignment inside a graph is."""

    def __init__(self, params):
        super().__init__(auto_prefix=False)
        self.params = ParameterTuple(params)

    def construct(self, *values):
        for i in range(len(self.params)):
            ops.assign(self.params[i], values[i])
        return values[0]


def _write(opt, kind: str, values: dict[int, np.ndarray]) -> None:
    """Bucket b's slice of `kind` := values[b] (float32, the slice's length)."""
    if not values:
        return
    held = _tensors(opt, kind)
    order = sorted(values)
    key = (id(opt), kind, tuple(order))
    if key not in _writers:
        _writers[key] = Overwrite([held[b] for b in order])
    _writers[key](*[Tensor(np.ascontiguousarray(values[b], np.float32)) for b in order]).asnumpy()


def local_pieces(opt) -> list[tuple[Piece, dict[str, np.ndarray]]]:
    """(piece, {kind: its elements}) of every parameter this rank holds a part of, in parameter order."""
    slices = {kind: [t.asnumpy() for t in _tensors(opt, kind)] for kind in kinds(opt)}
    out = []
    for piece in sorted(opt.plan.pieces(opt.index), key=lambda q: q.param):
        at = slice(piece.offset, piece.offset + piece.length)
        out.append((piece, {kind: slices[kind][piece.bucket][at].copy() for kind in kinds(opt)}))
    return out


def load_pieces(opt, given: dict[int, dict[str, np.ndarray]]) -> None:
    """given[param][kind]: this rank's piece of that parameter's state (flat float32); a kind left out keeps its
    value (the master of float32 weights is taken from the weights)."""
    slices = {kind: [t.asnumpy().copy() for t in _tensors(opt, kind)] for kind in kinds(opt)}
    changed = {kind: set() for kind in kinds(opt)}
    for piece in opt.plan.pieces(opt.index):
        for kind, value in given.get(piece.param, {}).items():
            if kind not in slices:
                continue
            slices[kind][piece.bucket][piece.offset:piece.offset + piece.length] = np.asarray(value).reshape(-1)
            changed[kind].add(piece.bucket)
    for kind in kinds(opt):
        _write(opt, kind, {b: slices[kind][b] for b in changed[kind]})


def masters_from_weights(opt) -> None:
    """Every master slice := the working weights' values (after the weights were loaded or moved)."""
    if opt.master is None:
        return
    _write(opt, "master", {b: opt._slice_of(opt.parameters, b) for b in range(len(opt.plan.buckets))})


def _whole_bucket(opt, b: int, value) -> np.ndarray:
    # a plain tensor of the values (a Parameter, a Ref to the CPU transport's eager ops, does not stack with zeros)
    value = value.asnumpy() if isinstance(value, Tensor) else value
    return opt.comms[b].gather(Tensor(np.ascontiguousarray(value))).asnumpy()


def _split(opt, b: int, whole: np.ndarray) -> dict[int, np.ndarray]:
    bucket = opt.plan.buckets[b]
    return {p: whole[s:s + opt.sizes[p]].reshape(opt.shapes[p]) for p, s in zip(bucket.params, bucket.starts)}


def whole_gradients(opt, shards) -> list[np.ndarray]:
    """The reduced gradients (this rank's bucket slices, as ShardedGradients returned them, times the factor), whole
    and in parameter order, on every rank."""
    out = {}
    for b in range(len(opt.plan.buckets)):
        out.update(_split(opt, b, _whole_bucket(opt, b, shards[b])))
    return [out[p] for p in range(len(opt.sizes))]


def whole_states(opt) -> dict[str, list[np.ndarray]]:
    """{kind: every parameter's state, whole, in parameter order} on every rank."""
    out = {}
    for kind in kinds(opt):
        held, got = _tensors(opt, kind), {}
        for b in range(len(opt.plan.buckets)):
            got.update(_split(opt, b, _whole_bucket(opt, b, held[b])))
        out[kind] = [got[p] for p in range(len(opt.sizes))]
    return out


def write_whole(opt, param: int, values: dict[str, np.ndarray]) -> None:
    """Parameter `param`'s whole state {kind: array of its shape}: this rank keeps its slice (no collective)."""
    b, start = opt.plan.location(param)
    bucket = opt.plan.buckets[b]
    lo = opt.shard_index(b) * bucket.shard_size
    for kind, value in values.items():
        if kind not in kinds(opt):
            continue
        flat = _tensors(opt, kind)[b].asnumpy().copy()
        a, z = max(lo, start), min(lo + bucket.shard_size, start + opt.sizes[param])
        if z > a:
            flat[a - lo:z - lo] = np.asarray(value, np.float32).reshape(-1)[a - start:z - start]
            _write(opt, kind, {b: flat})
