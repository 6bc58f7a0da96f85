"""The MoE layer: router -> dispatcher -> routed experts -> combine, plus one always-on shared expert.

`moe_comm_chunks: c` runs dispatch, experts and combine on c slices of the tokens one after another: the slices
are independent branches of one graph, so on Ascend one slice's exchange can overlap another's expert compute; the
result equals the unsliced layer's (dropless; with `moe_expert_capacity_factor` each slice has its own capacity).

Under tensor parallelism the rank routes and dispatches its own 1/tp of the sequence positions: its sequence shard
under sequence parallelism, otherwise its slice of the replicated input, the routed outputs then gathered back.
The EP group folds over the tensor-parallel ranks (ParallelLayout's expert slab), so the tp ranks of one group
exchange their token shares with each other's experts; the shared expert is a tensor-parallel SwiGLU.

With spare slots (`expert_placement.spare_slots`) the router's labels become global slots before the dispatch
(moe/replicas.py), so a replicated expert's tokens divide between its copies."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from dvm_fusion.rowwise import swiglu_packed_for
from parallel.ep.capacity import expert_capacity
from parallel.ep.counts import dispatch_counts
from parallel.ep.permute import drop_over_capacity
from parallel.tp.mappings import GatherSequenceReplicated, SplitSequence, TensorParallel
from telechat_moe.config import ModelConfig
from telechat_moe.layers import SwiGLU, ms_dtype, weight_seed
from telechat_moe.moe.dispatch import ExpertParallel, make_dispatcher
from telechat_moe.moe.experts import GroupedExperts
from telechat_moe.moe.replicas import ExpertSlots
from telechat_moe.moe.router import TopKRouter


ROUTING_STATS = 5   # after the expert load in a layer's routing statistics: the traffic counts, the rows sent


class MoELayer(nn.Cell):
    def __init__(self, cfg: ModelConfig, grouped_matmul, layer: int = 0, ep: ExpertParallel = ExpertParallel(),
                 tp: TensorParallel = TensorParallel(), seed: int = 0, name: str = "mlp", device_target: str = "CPU",
                 sequence_group: TensorParallel | None = None):
        """`sequence_group`: the ranks that share a sequence's positions, whose statistics the router's balance
        losses sum (the default: `tp`; under context parallelism tp x cp, parallel.cp.ContextParallel.tokens)."""
        super().__init__()
        cdt = ms_dtype(cfg.compute_dtype)
        self.gate = TopKRouter(cfg, ep.ep, weight_seed(seed, f"{name}.gate"), sequence_group or tp)
        # with spare slots the dispatcher sends copies to global slots (ep x (E/ep + spare)), the labels mapped
        # by `slots`
        self.slots = ExpertSlots(cfg.n_routed_experts, ep.ep, ep.spare_slots) if ep.spare_slots else None
        self.slots_per_rank = cfg.n_routed_experts // ep.ep + ep.spare_slots
        self.dispatcher = make_dispatcher(ep.ep * self.slots_per_rank, cfg.num_experts_per_tok, ep, cdt,
                                          device_target)
        self.capacity_factor, self.drop_policy = cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy
        self.num_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.experts = GroupedExperts(ep.experts(cfg.n_routed_experts), cfg.hidden_size, cfg.moe_intermediate_size,
                                      cfg.initializer_range, grouped_matmul, cdt, layer, ep.spare_slots,
                                      swiglu_packed_for(device_target), ep.tensor)
        self.shared_experts = SwiGLU(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size * cfg.n_shared_experts,
                                     cfg.initializer_range, cdt, seed, f"{name}.shared_experts", tp, device_target)
        # the rank's token share under tp without sequence parallelism: split off, and the outputs gathered back
        self.split = tp.tp > 1 and not tp.sp
        if self.split:
            self.split_tokens = SplitSequence(tp)
            self.gather_tokens = GatherSequenceReplicated(tp)
        self.chunks = cfg.moe_comm_chunks
        self.ep = ep

    def routed(self, x, indices, weights):
        """The routed experts' weighted sum per token, the routing that was sent (copies over an expert's capacity
        dropped: expert -1) and the rows the exchanges sent."""
        if self.capacity_factor is not None:     # each expert's capacity of this rank's tokens (of this slice)
            capacity = int(expert_capacity(x.shape[0], self.top_k, self.num_experts, self.capacity_factor))
            indices, weights = drop_over_capacity(indices, weights, self.num_experts, capacity, self.drop_policy)
        # Labels become slots here and again in `traffic`, not once in construct: with one mapped tensor feeding
        # both, MindSpore's CPU backend compiled the dp=4 x ep=4 replica step for over 7 minutes (a recursive walk
        # of the graph's inputs, seen in gdb; past 600 s in CI) where it takes about one.
        labels = self.slots(indices) if self.slots is not None else indices
        tokens, group_sizes, state = self.dispatcher.dispatch(x, labels, weights)
        out = self.dispatcher.combine(self.experts(tokens, group_sizes), state)
        return out, indices, ops.stop_gradient(self.dispatcher.sent_rows(state))

    def traffic(self, indices):
        """[4] token copies this rank's routing sends (flat inter/intra-node, hierarchical inter/intra-node)."""
        if self.ep.ep == 1:
            return ops.zeros(4, ms.float32)
        if self.slots is not None:
            indices = self.slots(indices)
        return dispatch_counts(indices, self.ep.index, self.slots_per_rank, self.ep.ranks_per_node,
                               self.ep.ep // self.ep.ranks_per_node)

    def construct(self, x):
        """x [b, s, h] (under sequence parallelism this rank's [b, s/tp, h]) -> (y like x, aux loss, z loss, routing
        statistics [E + 5]: the load of the copies this rank sent (after any capacity drop), their dispatch traffic
        of `traffic`, the rows its exchanges sent)."""
        mine = self.split_tokens(x) if self.split else x
        b, s, h = mine.shape
        flat = mine.reshape(b * s, h)
        indices, weights, aux, z, load = self.gate(flat, b)
        if self.chunks == 1:
            routed, sent, rows = self.routed(flat, indices, weights)
        else:
            n = b * s // self.chunks
            parts, sent, rows = (), (), 0.0
            for i in range(self.chunks):
                part, labels, slice_rows = self.routed(flat[i * n:(i + 1) * n], indices[i * n:(i + 1) * n],
                                                       weights[i * n:(i + 1) * n])
                parts, sent, rows = parts + (part,), sent + (labels,), rows + slice_rows
            routed, sent = ops.concat(parts, 0), ops.concat(sent, 0)
        if self.capacity_factor is not None:     # the load that was sent, not the demand
            load = ops.one_hot(sent, self.num_experts, ops.ones((), ms.float32),
                               ops.zeros((), ms.float32)).sum((0, 1))
        stats = ops.concat((ops.stop_gradient(load), self.traffic(sent), rows.reshape(1)))
        routed = routed.astype(x.dtype).reshape(b, s, h)
        if self.split:
            routed = self.gather_tokens(routed)
        return routed + self.shared_experts(x), aux, z, stats
