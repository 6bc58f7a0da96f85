"""Straightforward MindSpore implementations of the core operators, the operator checker's default entries.

They use only kernels that exist on CPU (platform-notes.md) and follow the mixed-precision policy of
MindFormers' TeleChat3 recipe: matmuls, SwiGLU and the attention products run in the compute dtype; norms, RoPE,
softmax of attention scores, the router, the combine and the loss run in float32 and cast back. Operators with
constants (eps, top-k, scaling) are built by factories so that graph mode sees plain tensor-in, tensor-out
functions. The model registers its own Cells in their place (op_check.register).
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, ops


def matmul(x: Tensor, w: Tensor) -> Tensor:
    return ops.matmul(x, w)


def make_rms_norm(eps: float = 1e-6):
    def rms_norm(x: Tensor, weight: Tensor) -> Tensor:
        h = x.astype(ms.float32)
        h = h * ops.rsqrt(ops.mean(h * h, -1, True) + eps)
        return (h * weight.astype(ms.float32)).astype(x.dtype)
    return rms_norm


def softmax(x: Tensor) -> Tensor:
    return ops.softmax(x, -1)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), -1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE of x (batch, seq, heads, dim) with float32 tables (seq, dim), computed in float32.
    The tables are built on the host in float64 (reference_ops.rope_tables): an angle position*freq formed in
    float32 is off by up to position*2^-24 radians, 2.4e-4 at position 4096 (TOLERANCES.md)."""
    h = x.astype(ms.float32)
    c = cos.astype(ms.float32).expand_dims(0).expand_dims(2)
    s = sin.astype(ms.float32).expand_dims(0).expand_dims(2)
    return (h * c + rotate_half(h) * s).astype(x.dtype)


def causal_mask(seq: int) -> Tensor:
    """True above the diagonal: the keys a query may not see."""
    rows = ops.arange(seq).reshape(seq, 1)
    cols = ops.arange(seq).reshape(1, seq)
    return cols > rows


def make_mla_attention(mscale: float = 1.0):
    """Softmax scale 1/sqrt(dn + dr) times YaRN's mscale squared, as in DeepSeek-V3's MLA."""
    def mla_attention(q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor) -> Tensor:
        """(b,s,h,dn), (b,s,h,dr), (b,s,h,dn), (b,s,dr) shared by heads, (b,s,h,dv) -> (b,s,h,dv)."""
        heads = q_nope.shape[2]
        scale = (q_nope.shape[-1] + q_pe.shape[-1]) ** -0.5 * mscale * mscale
        q = ops.cat((q_nope, q_pe), -1).transpose(0, 2, 1, 3)
        k_rope = ops.tile(k_pe.expand_dims(2), (1, 1, heads, 1))
        k = ops.cat((k_nope, k_rope), -1).transpose(0, 2, 3, 1)
        scores = ops.matmul(q, k).astype(ms.float32) * scale
        scores = ops.masked_fill(scores, causal_mask(scores.shape[-1]), float("-inf"))
        probs = ops.softmax(scores, -1).astype(v.dtype)
        return ops.matmul(probs, v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    return mla_attention


def make_router(top_k: int, routed_scaling: float):
    def router(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        """Dense (tokens, experts) routing weights: normalised sigmoid scores at the top-k of score + bias."""
        scores = ops.sigmoid(ops.matmul(x.astype(ms.float32), weight.astype(ms.float32).T))
        _, indices = ops.topk(scores + bias, top_k)
        picked = ops.gather_elements(scores, 1, indices)
        picked = picked / picked.sum(-1, keepdims=True) * routed_scaling
        onehot = ops.one_hot(indices, weight.shape[0], Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
        return (onehot * picked.expand_dims(-1)).sum(1)
    return router


def permute_by_expert(indices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Order of the flattened (token, slot) assignments grouped by expert: (order, token of each row, expert of
    each row). The sort key is exact in float32 for fewer than 2^24 experts."""
    flat = indices.reshape(-1)
    experts, order = ops.sort(flat.astype(ms.float32))
    return order, order // indices.shape[1], experts.astype(ms.int32)


def dispatch_combine(x: Tensor, indices: Tensor, weights: Tensor, expert_scale: Tensor) -> Tensor:
    """Dropless dispatch (tokens permuted into expert order), a per-expert computation, and the weighted
    un-permute back to token order (in float32, as the combine with float32 router weights is)."""
    order, tokens, experts = permute_by_expert(indices)
    expert_out = ops.gather(x, tokens, 0) * ops.gather(expert_scale, experts, 0)
    slot_weights = ops.gather(weights.reshape(-1), order, 0)
    combined = ops.unsorted_segment_sum(expert_out.astype(ms.float32) * slot_weights.expand_dims(-1),
                                        tokens, x.shape[0])
    return combined.astype(x.dtype)


def swiglu_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    return ops.matmul(ops.silu(ops.matmul(x, w_gate)) * ops.matmul(x, w_up), w_down)


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    return ops.cross_entropy(logits.astype(ms.float32), labels)


def make_adamw(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int):
    correction1 = 1 - beta1 ** step
    correction2 = 1 - beta2 ** step

    def adamw(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor):
        """One AdamW step on float32 master state; the gradient may arrive in a half format."""
        g = grad.astype(ms.float32)
        exp_avg = beta1 * exp_avg + (1 - beta1) * g
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
        denom = ops.sqrt(exp_avg_sq / correction2) + eps
        param = param * (1 - lr * weight_decay) - lr * (exp_avg / correction1) / denom
        return param, exp_avg, exp_avg_sq
    return adamw
