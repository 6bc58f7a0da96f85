"""Token dispatchers: move routed token copies to their experts and bring the results back.

Every dispatcher has the same two methods, as in Megatron-Core: `dispatch(x, indices)` returns the token copies
sorted by expert with the size of each expert's group, and `combine(expert_out, weights, state)` returns the
weighted sum per token. `LocalDispatcher` keeps all experts on this device (the CPU path, and any layout with
expert_parallel=1); expert-parallel dispatchers (All-to-All, hierarchical) plug in behind the same interface.
"""
from __future__ import annotations

from mindspore import nn, ops

from parallel.ep.permute import expert_group_sizes, stable_order


class LocalDispatcher(nn.Cell):
    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k

    def dispatch(self, x, indices):
        """x [T, h], indices [T, k] -> (tokens [T*k, h] sorted by expert, group_sizes [E] int32, state)."""
        flat_expert = indices.reshape(-1)
        order = stable_order(flat_expert)
        token_of_sorted = order // self.top_k
        tokens = ops.gather(x, token_of_sorted, 0)
        return tokens, expert_group_sizes(flat_expert, self.num_experts), (order, token_of_sorted)

    def combine(self, expert_out, weights, state):
        """expert_out [T*k, h] in dispatch order, weights [T, k] -> [T, h]."""
        order, token_of_sorted = state
        t = weights.shape[0]
        w_sorted = ops.gather(weights.reshape(-1), order, 0).astype(expert_out.dtype)
        return ops.unsorted_segment_sum(expert_out * ops.expand_dims(w_sorted, -1), token_of_sorted, t)


def make_dispatcher(kind: str, num_experts: int, top_k: int):
    if kind == "local":
        return LocalDispatcher(num_experts, top_k)
    raise ValueError(f"model.moe_token_dispatcher_type: {kind!r} runs only under expert parallelism on Ascend; "
                     f"use 'local' on this machine")
