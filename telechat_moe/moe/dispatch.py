"""Token dispatchers: move routed token copies to their experts and bring the results back.

Every dispatcher has the two methods of Megatron-Core's: `dispatch(x, indices, weights)` returns the token copies
this rank's experts compute, sorted by (local) expert, with the size of each expert's group and a state;
`combine(expert_out, state)` returns the weighted sum per token of the rank's own tokens. All three are dropless
whatever the skew of the routing:

- `LocalDispatcher`: every expert on this device (expert_parallel=1).
- `AllToAllDispatcher` (`alltoall`): rank r of the EP group holds experts [r*E/ep, (r+1)*E/ep); each copy goes to
  its expert's rank in one all-to-all with per-destination counts, the results come back by the reverse one.
- `HierarchicalDispatcher` (`hierarchical`): a token crosses to another node once per node that holds any of its
  experts (to the rank at its own position there), not once per expert; inside each node an all-to-all then moves
  the copies to their experts' ranks. Combine runs the reverse: each node sums its experts' weighted outputs of a
  token, and the token's home rank adds the nodes' sums.

Graph mode needs static shapes, so exchanges move capacity-padded chunks (`parallel.comm.AllToAllV`): the capacity is
the most copies one source can send one destination (every token of the source, each to at most min(k, experts
there) of that destination's experts), the padding carries no gradient, and no token is ever dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
from mindspore import nn, ops

from parallel.comm import AllToAll, AllToAllV, ProcessGroups, transport_for
from parallel.ep.permute import expert_group_sizes, stable_order
from parallel.layout import Axis, ParallelLayout


class LocalDispatcher(nn.Cell):
    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k

    def dispatch(self, x, indices, weights):
        """x [T, h], indices/weights [T, k] -> (tokens [T*k, h] sorted by expert, group_sizes [E] int32, state)."""
        flat_expert = indices.reshape(-1)
        order = stable_order(flat_expert)
        token_of_sorted = order // self.top_k
        tokens = ops.gather(x, token_of_sorted, 0)
        w_sorted = ops.gather(weights.reshape(-1), order, 0)
        return tokens, expert_group_sizes(flat_expert, self.num_experts), (token_of_sorted, w_sorted, x.shape[0])

    def combine(self, expert_out, state):
        """expert_out [T*k, h] in dispatch order -> [T, h]."""
        token_of_sorted, w_sorted, t = state
        return ops.unsorted_segment_sum(expert_out * ops.expand_dims(w_sorted.astype(expert_out.dtype), -1),
                                        token_of_sorted, t)


def _slots(dest, groups: int, capacity: int):
    """Where each row goes in a capacity-padded send buffer: destination `dest[i]` in [0, groups] (`groups` =
    nowhere) -> slot dest*capacity + (rows before it with the same destination), `groups*capacity` for nowhere;
    and the row count per destination [groups]."""
    one_hot = ops.one_hot(dest, groups + 1, ops.ones((), ms.float32), ops.zeros((), ms.float32))
    before = (ops.cumsum(one_hot, 0) * one_hot).sum(1) - 1
    counts = one_hot.sum(0)[:groups].astype(ms.int32)
    slot = ops.minimum(dest * capacity + before.astype(ms.int32), groups * capacity)
    return ops.stop_gradient(slot), ops.stop_gradient(counts)


class _ExpertExchange(nn.Cell):
    """One level of expert all-to-all: copies [n] of `tokens` rows, each to local expert `expert % experts_per_rank`
    of rank `expert // experts_per_rank` in the group (expert < 0: no copy), and the weighted sums back."""

    def __init__(self, transport, experts: int, top_k: int):
        super().__init__()
        self.g = transport.group.size
        self.per_rank = experts // self.g
        self.top_k = top_k
        self.exchange = AllToAllV(transport)
        self.back = AllToAll(transport)

    def dispatch(self, x, experts, weights):
        """x [R, h]; experts, weights [R, k] (experts -1 where no copy) -> (tokens for this rank's experts sorted
        by expert, group sizes [experts per rank], state)."""
        rows, h = x.shape
        k = experts.shape[1]
        capacity = rows * min(self.top_k, self.per_rank)
        flat = experts.reshape(-1)
        valid = flat >= 0
        dest = ops.where(valid, flat // self.per_rank, self.g)
        slot, counts = _slots(dest, self.g, capacity)
        token = ops.arange(0, rows * k, dtype=ms.int32) // k
        # the copy's local expert travels with it (+1: the padding's zeros read as "no expert")
        tag = ops.where(valid, flat % self.per_rank + 1, 0).astype(x.dtype)
        payload = ops.concat((ops.gather(x, token, 0), ops.expand_dims(tag, -1)), 1)
        send = ops.unsorted_segment_sum(payload, slot, self.g * capacity + 1)[:self.g * capacity]
        received, _ = self.exchange(send, counts)
        local = ops.stop_gradient(received[:, h]).astype(ms.int32) - 1
        key = ops.where(local >= 0, local, self.per_rank)
        order = stable_order(key)
        sizes = expert_group_sizes(key, self.per_rank + 1)[:self.per_rank]
        return ops.gather(received[:, :h], order, 0), sizes, (order, slot, token, weights.reshape(-1), rows)

    def combine(self, expert_out, state):
        order, slot, token, weights, rows = state
        unsorted = ops.unsorted_segment_sum(expert_out, order, expert_out.shape[0])
        returned = self.back(unsorted)
        padded = ops.concat((returned, ops.zeros((1, returned.shape[1]), returned.dtype)), 0)
        copies = ops.gather(padded, slot, 0) * ops.expand_dims(weights.astype(returned.dtype), -1)
        return ops.unsorted_segment_sum(copies, token, rows)


class AllToAllDispatcher(nn.Cell):
    def __init__(self, num_experts: int, top_k: int, ep_transport):
        super().__init__()
        self.exchange = _ExpertExchange(ep_transport, num_experts, top_k)

    def dispatch(self, x, indices, weights):
        return self.exchange.dispatch(x, indices, weights)

    def combine(self, expert_out, state):
        return self.exchange.combine(expert_out, state)


class HierarchicalDispatcher(nn.Cell):
    def __init__(self, num_experts: int, top_k: int, across_nodes, in_node):
        super().__init__()
        self.nodes = across_nodes.group.size
        self.per_node = num_experts // self.nodes
        self.top_k = top_k
        self.to_nodes = AllToAll(across_nodes)
        self.from_nodes = AllToAll(across_nodes)
        self.inside = _ExpertExchange(in_node, self.per_node, top_k)

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
    and the dispatcher kind (`alltoall` or `hierarchical`) used when ep > 1."""
    ep: int = 1
    index: int = 0
    kind: str = "alltoall"
    ranks_per_node: int = 1        # EP ranks in each node (the traffic counts' topology)
    group: object = None           # transport on the EP group
    in_node: object = None         # hierarchical: the EP ranks of this node
    across_nodes: object = None    # hierarchical: this rank's counterparts in the other nodes

    @classmethod
    def of(cls, layout: ParallelLayout, rank: int, kind: str, device_target: str) -> "ExpertParallel":
        if layout.ep == 1:
            return cls()
        groups = ProcessGroups(layout, rank)
        ep_index = layout.coords(rank)[Axis.EP]
        per_node = ProcessGroups(layout, rank, create=False).ep_in_node().size
        if kind == "hierarchical":
            return cls(layout.ep, ep_index, kind, per_node, None, transport_for(groups.ep_in_node(), device_target),
                       transport_for(groups.ep_across_nodes(), device_target))
        return cls(layout.ep, ep_index, kind, per_node, transport_for(groups.axis(Axis.EP), device_target))

    def experts(self, num_experts: int) -> tuple[int, int]:
        """The routed experts [first, last) this rank holds."""
        per = num_experts // self.ep
        return self.index * per, (self.index + 1) * per


def make_dispatcher(num_experts: int, top_k: int, ep: ExpertParallel):
    if ep.ep == 1:
        return LocalDispatcher(num_experts, top_k)
    if ep.kind == "hierarchical":
        return HierarchicalDispatcher(num_experts, top_k, ep.across_nodes, ep.in_node)
    return AllToAllDispatcher(num_experts, top_k, ep.group)
