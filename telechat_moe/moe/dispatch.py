"""Token dispatchers: move routed token copies to their experts and bring the results back.

Every dispatcher has the two methods of Megatron-Core's: `dispatch(x, indices, weights)` returns the token copies
this rank's experts compute, sorted by (local) expert, with the size of each expert's group and a state;
`combine(expert_out, state)` returns the weighted sum per token of the rank's own tokens; `sent_rows(state)` the
rows this rank's exchanges sent (the step log's measure of what travelled). All three carry every copy
the routing gives them, whatever its skew (a copy dropped to capacity comes as expert -1 and is skipped):

- `LocalDispatcher`: every expert on this device (expert_parallel=1).
- `AllToAllDispatcher` (`alltoall`): rank r of the EP group holds experts [r*E/ep, (r+1)*E/ep); each copy goes to
  its expert's rank in one all-to-all, the results come back by the reverse one.
- `HierarchicalDispatcher` (`hierarchical`): a token crosses to another node once per node that holds any of its
  experts (to the rank at its own position there), not once per expert; inside each node an all-to-all then moves
  the copies to their experts' ranks. Combine runs the reverse: each node sums its experts' weighted outputs of a
  token, and the token's home rank adds the nodes' sums.

The exchanges are exact (dropless without padding), as Megatron-Core's and MindFormers' `alltoall` dispatchers:
the copies per (destination, expert) are counted and exchanged first (a fixed-shape all-to-all of E/ep counts per
member), then the uneven all-to-all (`AllToAllV`) moves exactly the routed copies, sorted by destination and expert.
The receiver regroups the rows it gets from source-major to expert-major by those counts, so the grouped matmul
runs on the real rows only (its last group ends at its last row). The rows a rank receives are known only at run
time: graph mode's dynamic shape (docs/expert-exchange.md says what was measured). Token rows travel in the
compute dtype (the experts compute in it); the hierarchical form sends each token's experts in a node and their
weights beside it (as node-local expert + 1, 0 for none, and the weights: no gradient through the labels).
"""
from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
from mindspore import nn, ops

from dvm_fusion.rowwise import WeightedCombineCPU
from parallel.comm import AllToAllV, ProcessGroups, transport_for
from parallel.comm.transport import row_index
from parallel.ep.permute import expert_group_sizes, key_places, regroup, segment_sum, stable_order
from parallel.layout import Axis, ParallelLayout
from parallel.tp.expert import ExpertTensorParallel


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

    def sent_rows(self, state):
        return ops.zeros((), ms.float32)

    def combine(self, expert_out, state):
        """expert_out [T*k, h] in dispatch order -> [T, h]."""
        token_of_sorted, w_sorted, t = state
        if self.fused_combine is not None:
            return self.fused_combine(expert_out, w_sorted, token_of_sorted)
        return segment_sum(expert_out * ops.expand_dims(w_sorted.astype(expert_out.dtype), -1),
                                        token_of_sorted, t)


class _ExpertExchange(nn.Cell):
    """One level of the exact expert all-to-all: copies [n] of `tokens` rows, each to local expert
    `expert % experts_per_rank` of rank `expert // experts_per_rank` in the group (expert < 0: no copy), and the
    weighted sums back. `rows` of dispatch: the rows of x, an int, or a tensor where they are known only at run time
    (the hierarchical form's second level)."""

    def __init__(self, transport, experts: int, compute_dtype):
        super().__init__()
        self.t = transport
        self.g = transport.group.size
        self.per_rank = experts // self.g
        self.compute_dtype = compute_dtype
        self.exchange = AllToAllV(transport)
        self.back = AllToAllV(transport)

    def dispatch(self, x, experts, weights, rows):
        """x [R, h]; experts, weights [R, k] (experts -1 where no copy) -> (tokens for this rank's experts sorted
        by expert, group sizes [experts per rank], state)."""
        k = experts.shape[1]
        g, per = self.g, self.per_rank
        # the copies, then one pad row to every member (token 0 at weight 0, for its expert 0): nothing is ever
        # empty (MindSpore's CPU CumSum refuses zero rows, and an Ascend rank may get no copy)
        flat = ops.concat((experts.reshape(-1), ops.arange(0, g, dtype=ms.int32) * per))
        token_of = ops.concat((ops.arange(0, flat.shape[0] - g, dtype=ms.int32) // k, ops.zeros(g, ms.int32)))
        weights = ops.concat((weights.reshape(-1), ops.zeros(g, weights.dtype)))
        valid = flat >= 0
        # every copy's place among the sent ones, by (destination, local expert) = its global expert; none last
        places, counts = key_places(ops.where(valid, flat, g * per), g * per + 1)
        order = ops.argsort(places).astype(ms.int32)
        copy = ops.gather(order, ops.nonzero(ops.gather(valid, order, 0)).reshape(-1), 0)   # sent copies, in order
        token = ops.gather(token_of, copy, 0)
        mine = counts[:g * per].reshape(g, per)                                  # copies per destination, expert
        theirs = ops.stop_gradient(self.t.all_to_all(mine.astype(ms.float32))).astype(ms.int32)   # [source, e]
        send_counts, recv_counts = mine.sum(1), theirs.sum(1)
        received = self.exchange(ops.gather(x, token, 0).astype(self.compute_dtype), send_counts, recv_counts)
        by_expert, back = regroup(theirs, row_index(received))
        state = (back, token, ops.gather(weights, copy, 0), send_counts, recv_counts, rows)
        return ops.gather(received, by_expert, 0), theirs.sum(0).astype(ms.int32), state

    def sent_rows(self, state):
        return state[3].sum().astype(ms.float32)

    def combine(self, expert_out, state):
        back, token, weights, send_counts, recv_counts, rows = state
        returned = self.back(ops.gather(expert_out, back, 0), recv_counts, send_counts)
        weighted = returned * ops.expand_dims(weights.astype(returned.dtype), -1)
        if isinstance(rows, int):
            return segment_sum(weighted, token, rows)
        return ops.unsorted_segment_sum(weighted, token, rows)


class AllToAllDispatcher(nn.Cell):
    def __init__(self, num_experts: int, ep_transport, compute_dtype):
        super().__init__()
        self.exchange = _ExpertExchange(ep_transport, num_experts, compute_dtype)

    def dispatch(self, x, indices, weights):
        return self.exchange.dispatch(x, indices, weights, x.shape[0])

    def sent_rows(self, state):
        return self.exchange.sent_rows(state)

    def combine(self, expert_out, state):
        return self.exchange.combine(expert_out, state)


class HierarchicalDispatcher(nn.Cell):
    def __init__(self, num_experts: int, across_nodes, in_node, compute_dtype):
        super().__init__()
        self.across = across_nodes
        self.nodes = across_nodes.group.size
        self.per_node = num_experts // self.nodes
        self.to_nodes = AllToAllV(across_nodes)
        self.from_nodes = AllToAllV(across_nodes)
        self.inside = _ExpertExchange(in_node, self.per_node, compute_dtype)

    def dispatch(self, x, indices, weights):
        t, h = x.shape
        k, n = indices.shape[1], self.nodes
        here = ops.equal(ops.expand_dims(indices // self.per_node, 0),
                         ops.arange(0, n, dtype=ms.int32).reshape(n, 1, 1))               # [N, T, k]
        # (node, token) pairs to send, node-major; token t (past the last) is one pad row to every node (no
        # experts there, token 0's sum gets its zero): nothing is ever empty
        touched = ops.concat((here.any(-1), ops.ones((n, 1), ms.bool_)), 1)                # [N, T + 1]
        pair = ops.stop_gradient(ops.nonzero(touched.reshape(-1)).reshape(-1).astype(ms.int32))
        token = pair % (t + 1)
        token = ops.where(token == t, 0, token)
        send_counts = ops.stop_gradient(touched.astype(ms.int32).sum(1))
        recv_counts = ops.stop_gradient(self.across.all_to_all(send_counts.astype(ms.float32))).astype(ms.int32)
        # beside each token: its experts in that node (node-local id + 1, 0 = not there) and their weights
        pad = ops.zeros((n, 1, k), ms.int32)
        tags = ops.concat((ops.where(here, indices % self.per_node + 1, 0), pad), 1).reshape(n * (t + 1), k)
        weights_there = ops.concat((ops.where(here, ops.expand_dims(weights, 0), 0.0), pad.astype(weights.dtype)),
                                   1).reshape(n * (t + 1), k)
        payload = ops.concat((ops.gather(x, token, 0), ops.gather(tags, pair, 0).astype(x.dtype),
                              ops.gather(weights_there, pair, 0).astype(x.dtype)), -1)
        received = self.to_nodes(payload, send_counts, recv_counts)
        experts = ops.stop_gradient(received[:, h:h + k]).astype(ms.int32) - 1
        tokens, sizes, inner = self.inside.dispatch(received[:, :h], experts, received[:, h + k:],
                                                    recv_counts.sum())
        return tokens, sizes, (inner, token, send_counts, recv_counts, t)

    def sent_rows(self, state):
        """The (node, token) rows sent across nodes and the copies sent inside the node."""
        return state[2].sum().astype(ms.float32) + self.inside.sent_rows(state[0])

    def combine(self, expert_out, state):
        inner, token, send_counts, recv_counts, t = state
        per_node_sums = self.inside.combine(expert_out, inner)          # [tokens received from the nodes, h]
        return segment_sum(self.from_nodes(per_node_sums, recv_counts, send_counts), token, t)


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
    tensor: ExpertTensorParallel = ExpertTensorParallel()    # expert tensor parallelism: each expert's FFN split

    @classmethod
    def of(cls, layout: ParallelLayout, rank: int, kind: str, device_target: str,
           spare_slots: int = 0) -> "ExpertParallel":
        etp = ExpertTensorParallel.of(layout, rank, device_target)
        if layout.ep == 1:
            return cls(tensor=etp)
        groups = ProcessGroups(layout, rank)
        ep_index = layout.coords(rank)[Axis.EP]
        per_node = ProcessGroups(layout, rank, create=False).ep_in_node().size
        if kind == "hierarchical":
            return cls(layout.ep, ep_index, kind, per_node, None, transport_for(groups.ep_in_node(), device_target),
                       transport_for(groups.ep_across_nodes(), device_target), tensor=etp)
        return cls(layout.ep, ep_index, kind, per_node, transport_for(groups.axis(Axis.EP), device_target),
                   spare_slots=spare_slots, tensor=etp)

    def experts(self, num_experts: int) -> tuple[int, int]:
        """The routed experts [first, last) this rank holds."""
        per = num_experts // self.ep
        return self.index * per, (self.index + 1) * per


def make_dispatcher(num_experts: int, top_k: int, ep: ExpertParallel, compute_dtype=ms.float32,
                    device_target: str = "CPU"):
    if ep.ep == 1:
        return LocalDispatcher(num_experts, top_k, device_target)
    if ep.kind == "hierarchical":
        return HierarchicalDispatcher(num_experts, ep.across_nodes, ep.in_node, compute_dtype)
    return AllToAllDispatcher(num_experts, ep.group, compute_dtype)
