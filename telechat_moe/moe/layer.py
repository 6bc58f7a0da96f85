"""The MoE layer: router -> dispatcher -> routed experts -> combine, plus one always-on shared expert."""
from __future__ import annotations

from mindspore import nn

from telechat_moe.config import ModelConfig
from telechat_moe.layers import SwiGLU, ms_dtype
from telechat_moe.moe.dispatch import make_dispatcher
from telechat_moe.moe.experts import GroupedExperts
from telechat_moe.moe.router import TopKRouter


class MoELayer(nn.Cell):
    def __init__(self, cfg: ModelConfig, grouped_matmul):
        super().__init__()
        cdt = ms_dtype(cfg.compute_dtype)
        self.gate = TopKRouter(cfg)
        self.dispatcher = make_dispatcher(cfg.moe_token_dispatcher_type, cfg.n_routed_experts,
                                          cfg.num_experts_per_tok)
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                      cfg.initializer_range, grouped_matmul, cdt)
        self.shared_experts = SwiGLU(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size * cfg.n_shared_experts,
                                     cfg.initializer_range, cdt)

    def construct(self, x):
        """x [b, s, h] -> (y [b, s, h], aux loss, z loss, expert load [E])."""
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        indices, weights, aux, z, load = self.gate(flat, b)
        tokens, group_sizes, state = self.dispatcher.dispatch(flat, indices)
        routed = self.dispatcher.combine(self.experts(tokens, group_sizes), weights, state)
        return routed.astype(x.dtype).reshape(b, s, h) + self.shared_experts(x), aux, z, load
