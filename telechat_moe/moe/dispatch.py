"""Token dispatchers: move routed token copies to their experts and bring the results back.

Every dispatcher has the two methods of Megatron-Core's: `dispatch(x, indices, weights)` returns the token copies
this rank's experts compute, sorted by (local) expert, with the size of each expert's group and a state;
`combine(expert_out, state)` returns the weighted sum per token of the rank's own tokens. All three carry every copy
the routing gives them, whatever its skew (a copy dropped to capacity comes as expert -1 and is skipped):

- `LocalDispatcher`: every expert on this device (expert_parallel=1).
- `AllToAllDispatcher` (`alltoall`): rank r of the EP group holds experts [r*E/ep, (r+1)*E/ep); each copy goes to
  its expert's rank in one all-to-all, the results come back by the reverse one.
- `HierarchicalDispatcher` (`hierarchical`): a token crosses to another node once per node that holds any of its
  experts (to the rank at its own position there), not once per expert; inside each node an all-to-all then moves
  the copies to their experts' ranks. Combine runs the reverse: each node sums its experts' weighted outputs of a
  token, and the token's home rank adds the nodes' sums.

Graph mode needs static shapes, so each exchange sends every destination a buffer of the same rows
(`parallel.ep.capacity`): dropless by default (room for the most copies one source can send one destination), or,
with `moe_expert_capacity_factor`, its experts' capacity (copies beyond an expert's capacity were dropped before
the dispatch: `drop_over_capacity`). The token rows travel in the compute dtype (the experts compute in it), the
local expert of each row as a float32 tag beside them (0: padding); the padding carries no gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
from mindspore import nn, ops

from dvm_fusion.rowwise import WeightedCombineCPU
from parallel.comm import AllToAll, ProcessGroups, transport_for
from parallel.ep.capacity import exchange_rows
from parallel.ep.permute import expert_group_sizes, segment_sum, stable_order
from parallel.layout import Axis, ParallelLayout


class LocalDispatcher(nn.Cell):
    def __init__(self, num_experts: int, top_k: int, device_target: str = "CPU"):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        # on CPU one kernel each way instead of a broadcast Mul and a segment sum (dvm_fusion/rowwise.py)
        self.fused_combine = None if device_target == "Ascend" else WeightedCombineCPU(top_k)

    def dispatch(self, x, indices, weights):
        """x [T, h], indices/weights [T, k] (expert -1: a dropped copy, weight 0) -> (tokens [T*k, h] sorted by
        expert, dropped copies last, group_sizes [E] int32, state)."""
        flat = indices.reshape(-1)
        key = ops.where(flat >= 0, flat, self.num_experts)
        order = stable_order(key)
        token_of_sorted = order // self.top_k
        tokens = ops.gather(x, token_of_sorted, 0)
        w_sorted = ops.gather(weights.reshape(-1), order, 0)
        sizes = expert_group_sizes(key, self.num_experts + 1)[:self.num_experts]
        return tokens, sizes, (token_of_sorted, w_sorted, x.shape[0])

    def combine(self, expert_out, state):
        """expert_out [T*k, h] in dispatch order -> [T, h]."""
        token_of_sorted, w_sorted, t = state
        if self.fused_combine is not None:
            return self.fused_combine(expert_out, w_sorted, token_of_sorted)
        return segment_sum(expert_out * ops.expand_dims(w_sorted.astype(expert_out.dtype), -1),
                                        token_of_sorted, t)


def _slots(dest, groups: int, capacity: int):
    """Where each row goes in a padded send buffer: destination `dest[i]` in [0, groups] (`groups` = nowhere) ->
    slot dest*capacity + (rows before it with the same destination), `groups*capacity` for nowhere."""
    one_hot = ops.one_hot(dest, groups + 1, ops.ones((), ms.float32), ops.zeros((), ms.float32))
    before = (ops.cumsum(one_hot, 0) * one_hot).sum(1) - 1
    return ops.stop_gradient(ops.minimum(dest * capacity + before.astype(ms.int32), groups * capacity))


class _ExpertExchange(nn.Cell):
    """One level of expert all-to-all: copies [n] of `tokens` rows, each to local expert `expert % experts_per_rank`
    of rank `expert // experts_per_rank` in the group (expert < 0: no copy), and the weighted sums back.
    `capacity_factor` (None: dropless) sizes the buffers: the rows come from `sources` ranks' tokens routed over
    `all_experts`, whose copies were dropped to capacity at each source."""

    def __init__(self, transport, experts: int, top_k: int, compute_dtype, capacity_factor=None, sources: int = 1,
                 all_experts: int | None = None):
        super().__init__()
        self.t = transport
        self.g = transport.group.size
        self.per_rank = experts // self.g
        self.top_k = top_k
        self.compute_dtype = compute_dtype
        self.capacity_factor, self.sources, self.all_experts = capacity_factor, sources, all_experts or experts
        self.exchange = AllToAll(transport)
        self.back = AllToAll(transport)

    def capacity(self, rows: int) -> int:
        return int(exchange_rows(rows, self.top_k, self.per_rank, self.all_experts, self.capacity_factor,
                                 self.sources))

    def dispatch(self, x, experts, weights):
        """x [R, h]; experts, weights [R, k] (experts -1 where no copy) -> (tokens for this rank's experts sorted
        by expert, group sizes [experts per rank], state)."""
        rows, h = x.shape
        k = experts.shape[1]
        capacity = self.capacity(rows)
        flat = experts.reshape(-1)
        valid = flat >= 0
        dest = ops.where(valid, flat // self.per_rank, self.g)
        slot = _slots(dest, self.g, capacity)
        token = ops.arange(0, rows * k, dtype=ms.int32) // k
        buffer = self.g * capacity
        copies = ops.gather(x, token, 0).astype(self.compute_dtype)
        send = segment_sum(copies, slot, buffer + 1)[:buffer]
        # each row's local expert + 1 (the padding's zeros read as "no expert"), beside the rows: no gradient
        tag = ops.stop_gradient(ops.where(valid, flat % self.per_rank + 1, 0).astype(ms.float32))
        tags = segment_sum(tag, slot, buffer + 1)[:buffer]
        received = self.exchange(send)
        local = ops.stop_gradient(self.t.all_to_all(tags)).astype(ms.int32) - 1
        key = ops.where(local >= 0, local, self.per_rank)
        order = stable_order(key)
        sizes = expert_group_sizes(key, self.per_rank + 1)[:self.per_rank]
        return ops.gather(received, order, 0), sizes, (order, slot, token, weights.reshape(-1), rows)

    def combine(self, expert_out, state):
        order, slot, token, weights, rows = state
        unsorted = segment_sum(expert_out, order, expert_out.shape[0])
        returned = self.back(unsorted)
        padded = ops.concat((returned, ops.zeros((1, returned.shape[1]), returned.dtype)), 0)
        copies = ops.gather(padded, slot, 0) * ops.expand_dims(weights.astype(returned.dtype), -1)
        return segment_sum(copies, token, rows)


class AllToAllDispatcher(nn.Cell):
    def __init__(self, num_experts: int, top_k: int, ep_transport, compute_dtype, capacity_factor=None):
        super().__init__()
        self.exchange = _ExpertExchange(ep_transport, num_experts, top_k, compute_dtype, capacity_factor)

    def dispatch(self, x, indices, weights):
        return self.exchange.dispatch(x, indices, weights)

    def combine(self, expert_out, state):
        return self.exchange.combine(expert_out, state)


class HierarchicalDispatcher(nn.Cell):
    def __init__(self, num_experts: int, top_k: int, across_nodes, in_node, compute_dtype, capacity_factor=None):
        super().__init__()
        self.nodes = across_nodes.group.size
        self.per_node = num_experts // self.nodes
        self.top_k = top_k
        self.to_nodes = AllToAll(across_nodes)
        self.from_nodes = AllToAll(across_nodes)
        # a node's rank receives the rows of one source in each node
        self.inside = _ExpertExchange(in_node, self.per_node, top_k, compute_dtype, capacity_factor, self.nodes,
                                      num_experts)

    def dispatch(self, x, indices, weights):
        t, h = x.shape
        k, n = indices.shape[1], self.nodes
        node = indices // self.per_node                                                    # [T, k]
        nodes = ops.arange(0, n, dtype=ms.int32).reshape(n, 1, 1)
        here = ops.equal(ops.expand_dims(node, 0), nodes)                                  # [N, T, k]
        touched = ops.stop_gradient(here.any(-1, keep_dims=True).astype(x.dtype))         # [N, T, 1]
        # row m*T + t: token t, its experts inside node m (as node-local ids + 1, 0 = not there), their weights
        tags = ops.where(here, indices % self.per_node + 1, 0).astype(x.dtype)
        weights_there = ops.where(here, ops.expand_dims(weights, 0), 0.0).astype(x.dtype)
        payload = ops.concat((ops.broadcast_to(ops.expand_dims(x, 0), (n, t, h)) * touched, tags, weights_there), -1)
        received = self.to_nodes(payload.reshape(n * t, h + 2 * k))
        experts = ops.stop_gradient(received[:, h:h + k]).astype(ms.int32) - 1
        tokens, sizes, inner = self.inside.dispatch(received[:, :h], experts, received[:, h + k:])
        return tokens, sizes, (inner, t)

    def combine(self, expert_out, state):
        inner, t = state
        per_node_sums = self.inside.combine(expert_out, inner)                              # [N*T, h]
        return self.from_nodes(per_node_sums).reshape(self.nodes, t, -1).sum(0)


@dataclass(frozen=True)
class ExpertParallel:
    """Where this rank sits among the routed experts: the EP degree and coordinate, its transports (None at ep=1),
    the dispatcher kind (`alltoall` or `hierarchical`) used when ep > 1, and the spare slots each rank holds for
    replicas of hot experts (telechat_moe/moe/replicas.py)."""
    ep: int = 1
    index: int = 0
    kind: str = "alltoall"
    ranks_per_node: int = 1        # EP ranks in each node (the traffic counts' topology)
    group: object = None           # transport on the EP group
    in_node: object = None         # hierarchical: the EP ranks of this node
    across_nodes: object = None    # hierarchical: this rank's counterparts in the other nodes
    spare_slots: int = 0

    @classmethod
    def of(cls, layout: ParallelLayout, rank: int, kind: str, device_target: str,
           spare_slots: int = 0) -> "ExpertParallel":
        if layout.ep == 1:
            return cls()
        groups = ProcessGroups(layout, rank)
        ep_index = layout.coords(rank)[Axis.EP]
        per_node = ProcessGroups(layout, rank, create=False).ep_in_node().size
        if kind == "hierarchical":
            return cls(layout.ep, ep_index, kind, per_node, None, transport_for(groups.ep_in_node(), device_target),
                       transport_for(groups.ep_across_nodes(), device_target))
        return cls(layout.ep, ep_index, kind, per_node, transport_for(groups.axis(Axis.EP), device_target),
                   spare_slots=spare_slots)

    def experts(self, num_experts: int) -> tuple[int, int]:
        """The routed experts [first, last) this rank holds."""
        per = num_experts // self.ep
        return self.index * per, (self.index + 1) * per


def make_dispatcher(num_experts: int, top_k: int, ep: ExpertParallel, compute_dtype=ms.float32,
                    capacity_factor: float | None = None, device_target: str = "CPU"):
    if ep.ep == 1:
        return LocalDispatcher(num_experts, top_k, device_target)
    if ep.kind == "hierarchical":
        return HierarchicalDispatcher(num_experts, top_k, ep.across_nodes, ep.in_node, compute_dtype, capacity_factor)
    return AllToAllDispatcher(num_experts, top_k, ep.group, compute_dtype, capacity_factor)
