"""Building blocks shared by attention, MoE and the decoder: RMSNorm, Linear, SwiGLU MLP, dtype handling, and the
choice between a plain linear layer and its tensor-parallel twin.

Every weight is drawn from a NumPy generator of its own, seeded by the run's seed and the weight's name
(`weight_seed`): a tensor-parallel layer draws the same full matrix and keeps its slice, so a model built at any
model_parallel starts from the one-process model's weights.
"""
from __future__ import annotations

import zlib

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import One, initializer

from dvm_fusion.rowwise import RmsNormCPU, swiglu_for
from parallel.tp import ColumnParallelLinear, RowParallelLinear, full_normal
from parallel.tp.mappings import EnterRegion, TensorParallel

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


def ms_dtype(name: str):
    return DTYPES[name]


def weight_seed(seed: int, name: str) -> tuple[int, int]:
    """The generator seed of the weight named `name` (its parameter name without `.weight`) in a run of `seed`."""
    return (seed, zlib.crc32(name.encode()))


def logsumexp(x, axis: int = -1):
    """log(sum(exp(x))) with the max shift outside the gradient: the same value and gradient as the textbook
    form, without differentiating through ReduceMax (which costs an argmax-mask pass over the whole vocabulary)."""
    # ArgMaxWithValue: 3.5x faster than ReduceMax (amax) on MindSpore's CPU kernels, the same maximum
    m = ops.stop_gradient(ops.max(x, axis, keepdims=True)[0])
    return (m + ops.log(ops.exp(x - m).sum(axis, keepdims=True))).squeeze(axis)


class RMSNorm(nn.Cell):
    """Computed in float32 whatever the compute dtype, as in MindFormers and transformers."""

    def __init__(self, dim: int, eps: float, device_target: str = "CPU"):
        super().__init__()
        self.weight = Parameter(initializer(One(), (dim,), ms.float32), name="weight")
        self.eps = eps
        # float32 rows on CPU: one kernel each way (dvm_fusion/rowwise.py) instead of about eight and twenty
        self.fused = RmsNormCPU(eps) if device_target != "Ascend" else None

    def construct(self, x):
        if self.fused is not None and x.dtype == ms.float32:
            shape = x.shape
            return self.fused(x.reshape(-1, shape[-1]), self.weight).reshape(shape)
        # as rows: the weight's gradient is then a sum over axis 0 of a matrix, not over the leading axes of a
        # [batch, seq, hidden] tensor, which MindSpore's CPU ReduceSum ran 6x slower (on tiny: 50 of 1400 ms a step)
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, shape[-1]).astype(ms.float32)
        x = x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.eps)
        return (self.weight * x.astype(dtype)).reshape(shape)


class Linear(nn.Cell):
    """y = x W^T with W stored [out, in] (the HF/PyTorch convention, so checkpoints map without transposes)."""

    def __init__(self, in_features: int, out_features: int, init_std: float, compute_dtype=ms.float32,
                 seed=(0, 0)):
        super().__init__()
        self.weight = Parameter(Tensor(full_normal((out_features, in_features), init_std, seed)), name="weight")
        self.matmul = ops.MatMul(transpose_b=True)
        self.compute_dtype = compute_dtype
        self.out_features = out_features

    def construct(self, x):
        shape = x.shape
        y = self.matmul(x.reshape(-1, shape[-1]).astype(self.compute_dtype), self.weight.astype(self.compute_dtype))
        return y.reshape(shape[:-1] + (self.out_features,))


class Embedding(nn.Cell):
    """Token embedding as its own Cell, so a pipeline plan can give it a stage like any layer."""

    def __init__(self, vocab_size: int, hidden: int, init_std: float, seed=(0, 0)):
        super().__init__()
        self.weight = Parameter(Tensor(full_normal((vocab_size, hidden), init_std, seed)), name="weight")

    def construct(self, ids):
        return ops.gather(self.weight, ids, 0)


def column_linear(in_features: int, out_features: int, init_std: float, compute_dtype, seed, tp: TensorParallel,
                  **kwargs):
    """A Linear, or over tp > 1 its ColumnParallelLinear (output features split; `kwargs` go to it)."""
    if tp.tp == 1:
        return Linear(in_features, out_features, init_std, compute_dtype, seed)
    return ColumnParallelLinear(in_features, out_features, tp.transport, init_std, compute_dtype, seed=seed, **kwargs)


def row_linear(in_features: int, out_features: int, init_std: float, compute_dtype, seed, tp: TensorParallel):
    """A Linear, or over tp > 1 the RowParallelLinear that closes a region (all-reduce, or reduce-scatter of the
    sequence under sequence parallelism)."""
    if tp.tp == 1:
        return Linear(in_features, out_features, init_std, compute_dtype, seed)
    return RowParallelLinear(in_features, out_features, tp.transport, init_std, compute_dtype,
                             sequence_parallel=tp.sp, seed=seed)


class SwiGLU(nn.Cell):
    """down(silu(gate(x)) * up(x)): the dense FFN and the shared expert. Over tp, gate and up are column-parallel
    (one region entry for both) and down row-parallel: one collective each way, as in Megatron's MLP."""

    def __init__(self, hidden: int, intermediate: int, init_std: float, compute_dtype=ms.float32, seed: int = 0,
                 name: str = "mlp", tp: TensorParallel = TensorParallel(), device_target: str = "CPU"):
        super().__init__()
        self.swiglu = swiglu_for(device_target)     # on CPU one kernel each way (dvm_fusion/rowwise.py)
        self.enter = EnterRegion(tp, compute_dtype)
        self.gate_proj = column_linear(hidden, intermediate, init_std, compute_dtype,
                                       weight_seed(seed, f"{name}.gate_proj"), tp, input_ready=True)
        self.up_proj = column_linear(hidden, intermediate, init_std, compute_dtype,
                                     weight_seed(seed, f"{name}.up_proj"), tp, input_ready=True)
        self.down_proj = row_linear(intermediate, hidden, init_std, compute_dtype,
                                    weight_seed(seed, f"{name}.down_proj"), tp)

    def construct(self, x):
        x = self.enter(x)
        return self.down_proj(self.swiglu(self.gate_proj(x), self.up_proj(x)))
