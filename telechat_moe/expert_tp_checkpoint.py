"""Checkpoints under expert tensor parallelism: a routed expert's weights and optimizer state are saved whole over
the etp group (each rank of it writes its experts' full FFN, gate|up columns and down rows put together), so the
files are those of expert_model_parallel=1 and a checkpoint resumes at any etp (and, through checkpoint.py's
resharding, at any expert_parallel and data_parallel): a resuming rank loads its experts whole and keeps its own
columns and rows.

Inside the trainer an etp-split entry first carries a marker shard along its split axis (`split_marker`): that sends
the distributed optimizer's state of it down the path that saves it in the weight's shape (optimizer_state.py,
`gathered`), which is what can be put together over etp here.
"""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor

from parallel.tp.expert import packed_columns, packed_whole
from telechat_moe.checkpoint import Shard
from telechat_moe.step_dump import gather_along

# the axis each expert weight is split along over etp: w1's packed gate|up columns, w2's rows
SPLIT_AXIS = {"experts.w1": -1, "experts.w2": 1}
STATE_KINDS = ("adam_m", "adam_v", "master")


def split_axis(key: str) -> int | None:
    """The etp-split axis of a checkpoint entry (a weight, or its optimizer state `adam_m.<name>`), or None."""
    head, _, rest = key.partition(".")
    name = rest if head in STATE_KINDS else key
    return next((axis for suffix, axis in SPLIT_AXIS.items() if name.endswith(suffix)), None)


def split_marker(name: str, shape: tuple, etp) -> Shard | None:
    """The trainer's shard of an etp-split weight before `whole_over_etp` replaces it (module docstring)."""
    axis = split_axis(name)
    if axis is None:
        return None
    axis %= len(shape)
    return Shard(axis, etp.index * shape[axis], etp.etp * shape[axis])


def whole_over_etp(params: list, shards: dict, etp, expert_shard) -> tuple[list, dict]:
    """The entries to save: each etp-split one put together over the etp group (a collective: every rank calls it
    with its entries in the same order), sharded as `expert_shard(name)` says (None: whole, expert_parallel=1)."""
    out, shards = [], dict(shards)
    for p in params:
        axis = split_axis(p.name)
        if axis is None:
            out.append(p)
            continue
        value = gather_along(etp.transport, p.asnumpy(), axis)
        if axis == -1:
            value = packed_whole(value, etp.etp)
        out.append(Parameter(Tensor(np.ascontiguousarray(value)), name=p.name, requires_grad=False))
        _set(shards, p.name, expert_shard(p.name))
    return out, shards


def whole_placeholders(params: list, shards: dict, etp, expert_shard) -> tuple[list, dict, object]:
    """The entries to load: each etp-split one as zeros of its whole shape; and `restore()`, which puts this rank's
    columns or rows of each loaded one into the entry it stands for."""
    out, shards, stand_ins = [], dict(shards), []
    for p in params:
        axis = split_axis(p.name)
        if axis is None:
            out.append(p)
            continue
        shape = list(p.shape)
        shape[axis] *= etp.etp
        holder = Parameter(Tensor(np.zeros(shape, np.float32)), name=p.name, requires_grad=False)
        out.append(holder)
        _set(shards, p.name, expert_shard(p.name))
        stand_ins.append((p, holder, axis))

    def restore() -> None:
        for p, holder, axis in stand_ins:
            value = holder.asnumpy()
            if axis == -1:
                value = packed_columns(value, etp.etp, etp.index)
            else:
                n = value.shape[axis] // etp.etp
                value = np.take(value, np.arange(etp.index * n, (etp.index + 1) * n), axis=axis)
            p.set_data(Tensor(np.ascontiguousarray(value).astype(p.asnumpy().dtype)))
    return out, shards, restore


def _set(shards: dict, name: str, shard) -> None:
    if shard is None:
        shards.pop(name, None)
    else:
        shards[name] = shard
