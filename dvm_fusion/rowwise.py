"""Row-wise chains of small operators as one kernel each way on CPU: SwiGLU, RMSNorm, attention's masked softmax, the
cross-entropy and the MoE combine.

- `swiglu_packed(gate_up)`: silu(gate) * up from the experts' fused first GEMM output [N, 2I] (gate | up per row),
  without slicing the halves out (on CPU the slices, SiLU, its expansion into Sigmoid and Mul, the product and their
  backward were about ten kernels per MoE layer).
- `swiglu(gate, up)`: the same product of two tensors (the dense FFN and the shared expert).
- `RmsNormCPU(eps)`: RMSNorm of float32 rows (the composition is about eight kernels forward and twenty backward).
- `BiasSoftmaxCPU(scale)`: attention's softmax(scores * scale + mask) (a Mul, an Add and a Softmax forward; the
  softmax gradient's expansion, the mask's broadcast gradient and a Mul backward).
- `rope_cpu(x, cos, sin)`: rotary embedding, x * cos + rotate_half(x) * sin (two slices, a Neg, a Concat, two Muls
  and an Add forward, about ten kernels backward; two per attention layer).
- `CrossEntropyCPU()`: the language-model loss per position, -log softmax(logits)[label] times the loss mask (a
  LogSoftmax, a gather and their gradients, the gather's a scatter into a zeroed [N, V] tensor).
- `WeightedCombineCPU(top_k)`: the local dispatcher's combine, out[token[r]] += weight[r] * y[r] over the expert
  outputs in dispatch order (a broadcast Mul and a segment sum before, and their backward).

CPU: `ops.Custom` AOT kernels (kernels/rowwise.cc, built by `native.py`) with their own backward, computing in
float32 (other dtypes are cast to it and back). Ascend keeps the plain composition of MindSpore operators, which DVM
fuses (see this package's docstring): the `*_reference` functions here for SwiGLU, the model's own for the others.
`tests/test_rowwise.py` checks the kernels against those compositions, forward and backward.
"""
from __future__ import annotations

from functools import cache

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from dvm_fusion.native import aot_kernel, library


def _float32(*dtypes):
    return ms.float32


@cache
def _swiglu_cpu():
    lib = library("rowwise")
    grad = aot_kernel(lib, "SwigluPackedGrad", _float32)

    def bprop(gate_up, out, dout):
        return (grad(gate_up, dout),)

    return aot_kernel(lib, "SwigluPacked", _float32, bprop)


def swiglu_packed_reference(gate_up):
    half = gate_up.shape[-1] // 2
    return ops.silu(gate_up[:, :half]) * gate_up[:, half:]


def swiglu_packed_cpu(gate_up):
    """gate_up [N, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:] [N, I]."""
    if gate_up.dtype == ms.float32:
        return _swiglu_cpu()(gate_up)
    return _swiglu_cpu()(gate_up.astype(ms.float32)).astype(gate_up.dtype)


def swiglu_packed_for(device_target: str):
    return swiglu_packed_reference if device_target == "Ascend" else swiglu_packed_cpu


@cache
def _swiglu_split_cpu():
    lib = library("rowwise")
    grad = ops.Custom(f"{lib}:SwigluGrad", out_shape=lambda gate, up, dact: (gate, up),
                      out_dtype=lambda *dtypes: (ms.float32, ms.float32), func_type="aot")

    def bprop(gate, up, out, dout):
        return grad(gate, up, dout)

    return ops.Custom(f"{lib}:Swiglu", out_shape=lambda gate, up: gate, out_dtype=_float32, func_type="aot",
                      bprop=bprop)


def swiglu_reference(gate, up):
    return ops.silu(gate) * up


def swiglu_cpu(gate, up):
    """silu(gate) * up, gate and up of one shape."""
    if gate.dtype == ms.float32 and up.dtype == ms.float32:
        return _swiglu_split_cpu()(gate, up)
    return _swiglu_split_cpu()(gate.astype(ms.float32), up.astype(ms.float32)).astype(gate.dtype)


def swiglu_for(device_target: str):
    return swiglu_reference if device_target == "Ascend" else swiglu_cpu


@cache
def _rms_norm_cpu():
    lib = library("rowwise")
    grad = ops.Custom(f"{lib}:RmsNormGrad", out_shape=lambda x, w, eps, dy: (x, w),
                      out_dtype=lambda *dtypes: (ms.float32, ms.float32), func_type="aot")

    def bprop(x, w, eps, out, dout):
        dx, dw = grad(x, w, eps, dout)
        return dx, dw, ops.zeros_like(eps)

    return ops.Custom(f"{lib}:RmsNorm", out_shape=lambda x, w, eps: x, out_dtype=_float32, func_type="aot",
                      bprop=bprop)


class RmsNormCPU(nn.Cell):
    """x [N, h] float32, weight [h] float32 -> weight * x / sqrt(mean(x^2 over h) + eps) [N, h]."""

    def __init__(self, eps: float):
        super().__init__()
        self.kernel = _rms_norm_cpu()
        self.eps = Tensor(np.array([eps], np.float32))

    def construct(self, x, weight):
        return self.kernel(x, weight, self.eps)


@cache
def _bias_softmax_cpu():
    lib = library("rowwise")
    grad = ops.Custom(f"{lib}:BiasSoftmaxGrad", out_shape=lambda probs, dprobs, scale: probs, out_dtype=_float32,
                      func_type="aot")

    def bprop(scores, bias, scale, out, dout):
        # the bias is attention's document mask, built from segment ids: nothing upstream takes its gradient
        return grad(out, dout, scale), ops.zeros_like(bias), ops.zeros_like(scale)

    return ops.Custom(f"{lib}:BiasSoftmax", out_shape=lambda scores, bias, scale: scores, out_dtype=_float32,
                      func_type="aot", bprop=bprop)


class BiasSoftmaxCPU(nn.Cell):
    """scores [b, heads, s, t] float32, bias [b, 1, s, t] float32 -> softmax(scores * scale + bias, -1)."""

    def __init__(self, scale: float):
        super().__init__()
        self.kernel = _bias_softmax_cpu()
        self.scale = Tensor(np.array([scale], np.float32))

    def construct(self, scores, bias):
        return self.kernel(scores, bias, self.scale)


@cache
def _rope_cpu():
    lib = library("rowwise")
    grad = ops.Custom(f"{lib}:RopeGrad", out_shape=lambda dy, cos, sin: dy, out_dtype=_float32, func_type="aot")

    def bprop(x, cos, sin, out, dout):
        # the tables are functions of the positions: nothing upstream takes their gradient
        return grad(dout, cos, sin), ops.zeros_like(cos), ops.zeros_like(sin)

    return ops.Custom(f"{lib}:Rope", out_shape=lambda x, cos, sin: x, out_dtype=_float32, func_type="aot",
                      bprop=bprop)


def rope_cpu(x, cos, sin):
    """x [b, heads, s, d] float32, cos and sin [b or 1, 1, s, d] float32 -> x * cos + rotate_half(x) * sin, where
    rotate_half(x1 | x2) = -x2 | x1 over the halves of d."""
    return _rope_cpu()(x, cos, sin)


@cache
def _cross_entropy_cpu():
    lib = library("rowwise")
    grad = ops.Custom(f"{lib}:CrossEntropyGrad", out_shape=lambda logits, labels, mask, dnll: logits,
                      out_dtype=_float32, func_type="aot")

    def bprop(logits, labels, mask, out, dout):
        return grad(logits, labels, mask, dout), ops.zeros_like(labels), ops.zeros_like(mask)

    return ops.Custom(f"{lib}:CrossEntropy", out_shape=lambda logits, labels, mask: (logits[0],),
                      out_dtype=_float32, func_type="aot", bprop=bprop)


class CrossEntropyCPU(nn.Cell):
    """logits [N, V] float32, labels [N] int32, mask [N] float32 -> mask * -log softmax(logits)[label] [N] (a
    masked-out row's label is not read)."""

    def __init__(self):
        super().__init__()
        self.kernel = _cross_entropy_cpu()

    def construct(self, logits, labels, mask):
        return self.kernel(logits, labels, mask)


@cache
def _combine_cpu(top_k: int):
    lib = library("rowwise")
    grad = ops.Custom(f"{lib}:WeightedCombineGrad", out_shape=lambda dout, y, w, token: (y, w),
                      out_dtype=lambda dout, y, w, token: (ms.float32, ms.float32), func_type="aot")

    def bprop(y, weight, token, out, dout):
        dy, dweight = grad(dout, y, weight, token)
        return dy, dweight, ops.zeros_like(token)

    return ops.Custom(f"{lib}:WeightedCombine", out_shape=lambda y, w, token: (y[0] // top_k, y[1]),
                      out_dtype=_float32, func_type="aot", bprop=bprop)


class WeightedCombineCPU(nn.Cell):
    """y [T*top_k, h] (expert outputs in dispatch order), weight [T*top_k], token [T*top_k] int32 in [0, T) -> [T, h]:
    each token's weighted sum of its rows, in y's dtype."""

    def __init__(self, top_k: int):
        super().__init__()
        self.kernel = _combine_cpu(top_k)

    def construct(self, y, weight, token):
        if y.dtype == ms.float32:
            return self.kernel(y, weight.astype(ms.float32), token)
        return self.kernel(y.astype(ms.float32), weight.astype(ms.float32), token).astype(y.dtype)
