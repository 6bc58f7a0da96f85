"""The MoE layer: router -> dispatcher -> routed experts -> combine, plus one always-on shared expert.

`moe_comm_chunks: c` runs dispatch, experts and combine on c slices of the tokens one after another: the slices
are independent branches of one graph, so on Ascend one slice's exchange can overlap another's expert compute; the
result equals the unsliced layer's."""
from __future__ import annotations

from mindspore import nn, ops

from telechat_moe.config import ModelConfig
from telechat_moe.layers import SwiGLU, ms_dtype
from telechat_moe.moe.dispatch import ExpertParallel, make_dispatcher
from telechat_moe.moe.experts import GroupedExperts
from telechat_moe.moe.router import TopKRouter


class MoELayer(nn.Cell):
    def __init__(self, cfg: ModelConfig, grouped_matmul, layer: int = 0, ep: ExpertParallel = ExpertParallel()):
        super().__init__()
        cdt = ms_dtype(cfg.compute_dtype)
        self.gate = TopKRouter(cfg, expert_groups=ep.ep)
        self.dispatcher = make_dispatcher(cfg.n_routed_experts, cfg.num_experts_per_tok, ep)
        self.experts = GroupedExperts(ep.experts(cfg.n_routed_experts), cfg.hidden_size, cfg.moe_intermediate_size,
                                      cfg.initializer_range, grouped_matmul, cdt, layer)
        self.shared_experts = SwiGLU(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size * cfg.n_shared_experts,
                                     cfg.initializer_range, cdt)
        self.chunks = cfg.moe_comm_chunks

    def routed(self, x, indices, weights):
        tokens, group_sizes, state = self.dispatcher.dispatch(x, indices, weights)
        return self.dispatcher.combine(self.experts(tokens, group_sizes), state)

    def construct(self, x):
        """x [b, s, h] -> (y [b, s, h], aux loss, z loss, expert load [E])."""
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        indices, weights, aux, z, load = self.gate(flat, b)
        if self.chunks == 1:
            routed = self.routed(flat, indices, weights)
        else:
            n = b * s // self.chunks
            parts = ()
            for i in range(self.chunks):
                parts = parts + (self.routed(flat[i * n:(i + 1) * n], indices[i * n:(i + 1) * n],
                                             weights[i * n:(i + 1) * n]),)
            routed = ops.concat(parts, 0)
        return routed.astype(x.dtype).reshape(b, s, h) + self.shared_experts(x), aux, z, load
