"""The distributed optimizer's state as the trainer's checkpoints and dumps name it (parallel/optim holds it in
bucket slices; this module maps it to parameter names).

Checkpoint entries, per weight `<name>` of which this rank holds a piece of the optimizer state:
- `adam_m.<name>`, `adam_v.<name>` (and `master.<name>` below float32 weights): this rank's piece of the flattened
  weight, sharded along dim 0 of the whole flattened tensor (`Shard(0, first element, all elements)`). A weight
  split along its dim 0 over expert or tensor parallelism (the routed experts) is a contiguous run of the whole
  tensor's elements, so its pieces are placed in the whole tensor too: a checkpoint reshards over dp, ep or both.
- A weight split along another dim over tensor parallelism: its state is gathered over the data-parallel group and
  saved as the rank's tensor-parallel slice, as the replicated optimizer saves it (the flat pieces of a slice that
  is not a run of the whole tensor cannot be placed in it; what does not divide over dp).

`telechat_moe/checkpoint.py` assembles and re-cuts flat and shaped tensors, so a checkpoint of either optimizer
loads into the other and into any data-parallel degree.
"""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor

from parallel.optim import state
from telechat_moe.checkpoint import Shard


class OptimizerCheckpoint:
    """`opt`: the ShardedAdamW; `names`: its weights' names in its order, None for a weight whose state is not
    checkpointed (a replica's, rebuilt on resume); `weight_shards`: name -> Shard of the weights split over tensor
    or expert parallelism (the others are whole on this rank)."""

    def __init__(self, opt, names: list[str | None], weight_shards: dict[str, Shard]):
        self.opt, self.names, self.weight_shards = opt, names, weight_shards
        self.pieces = {p.param: p for p in opt.plan.pieces(opt.index) if names[p.param] is not None}
        self.gathered = [i for i, n in enumerate(names) if n in weight_shards and weight_shards[n].dim != 0]
        self.holders: list[tuple[int, str, Parameter]] = []

    def _flat(self, i: int) -> tuple[int, int]:
        """(offset of this rank's local weight in the whole flattened tensor, the whole tensor's elements)."""
        size = self.opt.sizes[i]
        s = self.weight_shards.get(self.names[i])
        if s is None:
            return 0, size
        row = size // self.opt.shapes[i][0]
        return s.offset * row, s.full * row

    def tensors(self) -> tuple[list[Parameter], dict[str, Shard]]:
        """The state's checkpoint entries and their shards (collective where a weight's state is gathered: every
        rank calls it at the same save)."""
        params, shards = [], {}
        held = dict(state.local_pieces(self.opt))
        by_param = {p.param: values for p, values in held.items()}
        whole = state.whole_states(self.opt) if self.gathered else None
        for kind in state.kinds(self.opt):
            for i, name in enumerate(self.names):
                key = f"{kind}.{name}"
                if i in self.gathered:
                    params.append(Parameter(Tensor(np.ascontiguousarray(whole[kind][i])), name=key,
                                            requires_grad=False))
                    shards[key] = self.weight_shards[name]
                elif i in by_param and i in self.pieces:
                    base, full = self._flat(i)
                    params.append(Parameter(Tensor(by_param[i][kind]), name=key, requires_grad=False))
                    shards[key] = Shard(0, base + self.pieces[i].start, full)
        return params, shards

    def placeholders(self, kinds=None) -> tuple[list[Parameter], dict[str, Shard]]:
        """Zeros in the shape of each entry this rank loads, and their shards (for load_checkpoint)."""
        params, shards = [], {}
        self.holders = []
        for kind in kinds or state.kinds(self.opt):
            for i, name in enumerate(self.names):
                key = f"{kind}.{name}"
                if i in self.gathered:
                    shape, shard = self.opt.shapes[i], self.weight_shards[name]
                elif i in self.pieces:
                    base, full = self._flat(i)
                    shape, shard = (self.pieces[i].length,), Shard(0, base + self.pieces[i].start, full)
                else:
                    continue
                holder = Parameter(Tensor(np.zeros(shape, np.float32)), name=key, requires_grad=False)
                params.append(holder)
                shards[key] = shard
                self.holders.append((i, kind, holder))
        return params, shards

    def apply(self) -> None:
        """The loaded placeholders into the optimizer's slices; the master of float32 weights is the weights."""
        given: dict[int, dict[str, np.ndarray]] = {}
        for i, kind, holder in self.holders:
            value = holder.asnumpy()
            if i in self.gathered:
                if i not in self.pieces:
                    continue
                piece = self.pieces[i]
                value = value.reshape(-1)[piece.start:piece.start + piece.length]
            given.setdefault(i, {})[kind] = value
        state.load_pieces(self.opt, given)
        if "master" not in {kind for _, kind, _ in self.holders}:
            state.masters_from_weights(self.opt)
        self.holders = []


def held_bytes(params) -> int:
    """What the trainer holds between steps: the bytes of every distinct Parameter among `params` (weights,
    optimizer state, gradient buffers), as allocated."""
    seen, total = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.nbytes
    return total


class SlicedMoments:
    """Expert migration's access to the distributed optimizer's state of one weight (telechat_moe/
    expert_placement.py): read a whole state (the weight's bucket all-gathered over its group: every rank of the
    group calls it at the same point), write a whole state (each rank keeps its slice). `kinds`: adam_m, adam_v
    and, below float32 weights, the float32 master, which moves with its weight."""

    def __init__(self, opt):
        self.opt = opt
        self.kinds = state.kinds(opt)
        self.index = {id(p): i for i, p in enumerate(opt.parameters)}

    def read(self, weight, kind: str) -> np.ndarray:
        i = self.index[id(weight)]
        b, start = self.opt.plan.location(i)
        whole = state._whole_bucket(self.opt, b, state._tensors(self.opt, kind)[b])
        return whole[start:start + self.opt.sizes[i]].reshape(self.opt.shapes[i])

    def write(self, weight, kind: str, value: np.ndarray) -> None:
        state.write_whole(self.opt, self.index[id(weight)], {kind: value})
