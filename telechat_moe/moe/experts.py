"""Routed experts: SwiGLU per expert over token groups sorted by expert, through one grouped-matmul kernel.

Weights are stacked per expert, gate and up fused: w1 [E, h, 2*I], w2 [E, I, h], where E is the experts this rank
holds (all of them, or its expert-parallel share [first, last)). Each expert's initial weights are drawn from a
generator of its own, seeded by (seed, layer, expert), so an expert starts the same whichever rank holds it and a
run at any expert_parallel computes the same function as one process. `spare` slots (w1_spare, w2_spare) hold
replicas of hot experts (telechat_moe/moe/replicas.py), zero while empty; they follow the home slots in the grouped
matmul. The kernels are injected (grouped matmul: CPU hand-written kernel or Ascend GroupedMatmul, both dropless
with the same contract; SwiGLU over the packed gate|up rows: CPU kernel or MindSpore's operators), so fused or
communication-overlapped expert kernels can replace them without touching routing or dispatch.

Under expert tensor parallelism (`etp`, parallel/tp/expert.py) a rank holds its I/etp columns of every held expert's
gate and up (w1 [E, h, 2*I/etp], its gate columns then its up columns) and the same rows of down (w2 [E, I/etp, h]),
sliced from the same per-expert draws, so any etp computes the function etp=1 computes; the rows its etp peers
received are gathered before the grouped matmuls and the partial outputs summed back after them.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from dvm_fusion.rowwise import swiglu_packed_reference
from parallel.tp.expert import ExpertRows, ExpertTensorParallel, packed_columns
from parallel.tp.layers import shard_range


def expert_init(seed: int, layer: int, first: int, last: int, shape: tuple, std: float, which: int) -> np.ndarray:
    """Normal(0, std) weights of experts [first, last), each from its own generator."""
    return np.stack([np.random.default_rng((seed, layer, e, which)).normal(0.0, std, shape).astype(np.float32)
                     for e in range(first, last)])


class GroupedExperts(nn.Cell):
    def __init__(self, experts: tuple[int, int], hidden: int, intermediate: int, init_std: float, grouped_matmul,
                 compute_dtype=ms.float32, layer: int = 0, spare: int = 0, swiglu=swiglu_packed_reference,
                 etp: ExpertTensorParallel = ExpertTensorParallel()):
        super().__init__()
        first, last = experts
        seed = ms.get_seed() or 0
        begin, end = shard_range(intermediate, etp.etp, etp.index, "moe_intermediate_size")
        self.intermediate = end - begin
        w1 = expert_init(seed, layer, first, last, (hidden, 2 * intermediate), init_std, 1)
        w2 = expert_init(seed, layer, first, last, (intermediate, hidden), init_std, 2)
        self.w1 = Parameter(Tensor(packed_columns(w1, etp.etp, etp.index)), name="w1")
        self.w2 = Parameter(Tensor(np.ascontiguousarray(w2[:, begin:end])), name="w2")
        self.spare = spare
        if spare:
            self.w1_spare = Parameter(Tensor(np.zeros((spare, hidden, 2 * self.intermediate), np.float32)),
                                      name="w1_spare")
            self.w2_spare = Parameter(Tensor(np.zeros((spare, self.intermediate, hidden), np.float32)),
                                      name="w2_spare")
        self.grouped_matmul, self.swiglu = grouped_matmul, swiglu
        self.compute_dtype = compute_dtype
        self.rows = ExpertRows(etp, last - first + spare) if etp.etp > 1 else None

    def construct(self, tokens, group_sizes):
        cdt = self.compute_dtype
        w1, w2 = self.w1, self.w2
        if self.spare:
            w1, w2 = ops.concat((w1, self.w1_spare), 0), ops.concat((w2, self.w2_spare), 0)
        if self.rows is None:
            gate_up = self.grouped_matmul(tokens.astype(cdt), w1.astype(cdt), group_sizes)
            return self.grouped_matmul(self.swiglu(gate_up), w2.astype(cdt), group_sizes)
        tokens, sizes, state = self.rows.gather(tokens.astype(cdt), group_sizes)
        gate_up = self.grouped_matmul(tokens, w1.astype(cdt), sizes)
        return self.rows.scatter(self.grouped_matmul(self.swiglu(gate_up), w2.astype(cdt), sizes), state)
