"""Building blocks shared by attention, MoE and the decoder: RMSNorm, Linear, SwiGLU MLP, dtype handling."""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import Normal, One, initializer

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


def ms_dtype(name: str):
    return DTYPES[name]


def logsumexp(x, axis: int = -1):
    """log(sum(exp(x))) with the max shift outside the gradient: the same value and gradient as the textbook
    form, without differentiating through ReduceMax (which costs an argmax-mask pass over the whole vocabulary)."""
    m = ops.stop_gradient(x.max(axis, keepdims=True))
    return (m + ops.log(ops.exp(x - m).sum(axis, keepdims=True))).squeeze(axis)


class RMSNorm(nn.Cell):
    """Computed in float32 whatever the compute dtype, as in MindFormers and transformers."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = Parameter(initializer(One(), (dim,), ms.float32), name="weight")
        self.eps = eps

    def construct(self, x):
        dtype = x.dtype
        x = x.astype(ms.float32)
        x = x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.eps)
        return self.weight * x.astype(dtype)


class Linear(nn.Cell):
    """y = x W^T with W stored [out, in] (the HF/PyTorch convention, so checkpoints map without transposes)."""

    def __init__(self, in_features: int, out_features: int, init_std: float, compute_dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(initializer(Normal(init_std), (out_features, in_features), ms.float32), name="weight")
        self.matmul = ops.MatMul(transpose_b=True)
        self.compute_dtype = compute_dtype
        self.out_features = out_features

    def construct(self, x):
        shape = x.shape
        y = self.matmul(x.reshape(-1, shape[-1]).astype(self.compute_dtype), self.weight.astype(self.compute_dtype))
        return y.reshape(shape[:-1] + (self.out_features,))


class Embedding(nn.Cell):
    """Token embedding as its own Cell, so a pipeline plan can give it a stage like any layer."""

    def __init__(self, vocab_size: int, hidden: int, init_std: float):
        super().__init__()
        self.weight = Parameter(initializer(Normal(init_std), (vocab_size, hidden), ms.float32), name="weight")

    def construct(self, ids):
        return ops.gather(self.weight, ids, 0)


class SwiGLU(nn.Cell):
    """down(silu(gate(x)) * up(x)): the dense FFN and the shared expert."""

    def __init__(self, hidden: int, intermediate: int, init_std: float, compute_dtype=ms.float32):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, init_std, compute_dtype)
        self.up_proj = Linear(hidden, intermediate, init_std, compute_dtype)
        self.down_proj = Linear(intermediate, hidden, init_std, compute_dtype)

    def construct(self, x):
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))
