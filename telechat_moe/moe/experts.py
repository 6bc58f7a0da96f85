"""Routed experts: SwiGLU per expert over token groups sorted by expert, through one grouped-matmul kernel.

Weights are stacked per expert, gate and up fused: w1 [E, h, 2*I], w2 [E, I, h]. The kernel is injected
(CPU hand-written kernel or Ascend GroupedMatmul, both dropless with the same contract), so fused or
communication-overlapped expert kernels can replace it without touching routing or dispatch.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import Normal, initializer


class GroupedExperts(nn.Cell):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, init_std: float, grouped_matmul,
                 compute_dtype=ms.float32):
        super().__init__()
        self.intermediate = intermediate
        self.w1 = Parameter(initializer(Normal(init_std), (num_experts, hidden, 2 * intermediate), ms.float32),
                            name="w1")
        self.w2 = Parameter(initializer(Normal(init_std), (num_experts, intermediate, hidden), ms.float32),
                            name="w2")
        self.grouped_matmul = grouped_matmul
        self.compute_dtype = compute_dtype

    def construct(self, tokens, group_sizes):
        cdt = self.compute_dtype
        gate_up = self.grouped_matmul(tokens.astype(cdt), self.w1.astype(cdt), group_sizes)
        act = ops.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:]
        return self.grouped_matmul(act, self.w2.astype(cdt), group_sizes)
