"""Multi-token prediction, depth 1 (DeepSeek-V3): from the main model's last hidden state at position i and the
embedding of token i+1, one extra decoder block predicts token i+2 through the shared output head.
The projection sees [embedding | hidden], the order of DeepSeek's checkpoints, Megatron and vLLM."""
from __future__ import annotations

from mindspore import nn, ops

from parallel.comm import GatherFromGroup
from parallel.tp import ColumnParallelLinear
from parallel.tp.mappings import TensorParallel
from telechat_moe.config import ModelConfig
from telechat_moe.layers import Linear, RMSNorm, ms_dtype, weight_seed


class SequenceParallelProjection(ColumnParallelLinear):
    """eh_proj under sequence parallelism: [b, s/tp, 2h] -> [b, s/tp, h] through the column-parallel matmul
    (sequence all-gathered in, [b, s, h/tp] out), an all-gather of the hidden columns (backward: reduce-scatter,
    as each rank keeps different positions) and this rank's positions of the result."""

    def __init__(self, hidden: int, init_std: float, compute_dtype, seed, tp: TensorParallel):
        super().__init__(2 * hidden, hidden, tp.transport, init_std, compute_dtype, sequence_parallel=True,
                         seed=seed)
        self.hidden_gather = GatherFromGroup(tp.transport)
        self.me = tp.index

    def construct(self, x):
        n = x.shape[1]
        x = x.astype(self.compute_dtype)
        x = ops.transpose(self.seq_gather(ops.transpose(x, (1, 0, 2))), (1, 0, 2))        # [b, s, 2h]
        y = self._local(x)                                                                 # [b, s, h/tp]
        full = ops.transpose(self.hidden_gather(ops.transpose(y, (2, 0, 1))), (1, 2, 0))   # [b, s, h]
        return full[:, self.me * n:(self.me + 1) * n]


class MTPBlock(nn.Cell):
    def __init__(self, cfg: ModelConfig, block: nn.Cell, seed: int = 0, name: str = "mtp.0",
                 tp: TensorParallel = TensorParallel(), device_target: str = "CPU"):
        """Over tp, eh_proj is column-parallel with its output gathered (the block's input is the residual stream
        of its twin decoder layers: replicated, or the rank's sequence shard)."""
        super().__init__()
        h, std, cdt = cfg.hidden_size, cfg.initializer_range, ms_dtype(cfg.compute_dtype)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, device_target)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, device_target)
        seed = weight_seed(seed, f"{name}.eh_proj")
        if tp.tp == 1:
            self.eh_proj = Linear(2 * h, h, std, cdt, seed)
        elif tp.sp:
            self.eh_proj = SequenceParallelProjection(h, std, cdt, seed, tp)
        else:
            self.eh_proj = ColumnParallelLinear(2 * h, h, tp.transport, std, cdt, gather_output=True, seed=seed)
        self.block = block
        self.norm = RMSNorm(h, cfg.rms_norm_eps, device_target)

    def construct(self, hidden, next_embeds, cos, sin, mask):
        h = self.eh_proj(ops.cat((self.enorm(next_embeds), self.hnorm(hidden)), -1))
        h, aux, z, load = self.block(h, cos, sin, mask)
        return self.norm(h), aux, z, load
