"""Token permutation by expert: the order every dispatcher sorts routed token copies into, and each expert's group
size. Pure functions of the routing, shared by the model's dispatchers and the alignment harness's expert-parallel
emulation, so both permute identically."""
from __future__ import annotations

import mindspore as ms
from mindspore import ops


def stable_order(keys):
    """Indices that sort the int32 `keys` [n] stably. Each key is made unique as key * n + position, so the order is
    a pure function of the keys (ties keep their position) on every backend, whatever its sort."""
    n = keys.shape[0]
    return ops.sort(keys * n + ops.arange(0, n, dtype=ms.int32))[1]


def expert_group_sizes(flat_expert, num_experts: int):
    """int32 [E]: how many of the dispatched rows go to each expert (constant under the gradient)."""
    sizes = ops.one_hot(flat_expert, num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32)).sum(0)
    return ops.stop_gradient(sizes).astype(ms.int32)
