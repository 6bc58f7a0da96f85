"""Float64 NumPy references of the model's core operators: the ground truth the operator checker compares to.

Written from the operators' definitions (DeepSeek-V3 / TeleChat3 conventions), independently of any MindSpore
code, so that a shared mistake cannot hide. Every function takes and returns float64 arrays (integers for
indices and labels).
"""
from __future__ import annotations

import math

import numpy as np


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x @ w


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return z / np.sum(z, axis=axis, keepdims=True)


# ---- RoPE with YaRN scaling ----------------------------------------------------------------------------
def yarn_inv_freq(dim: int, base: float = 10000.0, factor: float = 1.0, original_max_position: int = 4096,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> np.ndarray:
    """Per-pair inverse frequencies (dim/2,) of YaRN: interpolate low frequencies by `factor`, keep the high
    ones, with a linear ramp between the wavelengths that turn beta_fast and beta_slow times in the original
    context. factor == 1 is plain RoPE."""
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    extrapolated = 1.0 / base ** exponents
    if factor == 1.0:
        return extrapolated
    interpolated = extrapolated / factor

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1 where the frequency is high enough to extrapolate
    return interpolated * (1.0 - keep) + extrapolated * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: scales cos/sin (and, squared, the softmax scale in MLA)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray, mscale: float = 1.0,
                interleaved: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables (len(positions), 2*len(inv_freq)) in the layout `apply_rope` expects."""
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    pair = (lambda t: np.repeat(t, 2, axis=-1)) if interleaved else (lambda t: np.concatenate([t, t], axis=-1))
    return pair(np.cos(angles)) * mscale, pair(np.sin(angles)) * mscale


def rotate(x: np.ndarray, interleaved: bool = False) -> np.ndarray:
    """The 90-degree turn of each (even, odd) pair (interleaved) or of the two halves (rotate-half)."""
    if interleaved:
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = -x[..., 1::2], x[..., 0::2]
        return out
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool = False) -> np.ndarray:
    """x: (batch, seq, heads, dim); cos/sin: (seq, dim)."""
    return x * cos[None, :, None, :] + rotate(x, interleaved) * sin[None, :, None, :]


# ---- attention ---------------------------------------------------------------------------------------
def mla_attention(q_nope: np.ndarray, q_pe: np.ndarray, k_nope: np.ndarray, k_pe: np.ndarray, v: np.ndarray,
                  scale: float) -> np.ndarray:
    """Causal MLA attention core. q_nope/k_nope (b,s,h,dn), q_pe (b,s,h,dr), k_pe (b,s,dr) shared by all heads,
    v (b,s,h,dv); returns (b,s,h,dv)."""
    scores = (np.einsum("bshd,bthd->bhst", q_nope, k_nope) + np.einsum("bshd,btd->bhst", q_pe, k_pe)) * scale
    seq = scores.shape[-1]
    scores = np.where(np.triu(np.ones((seq, seq), dtype=bool), 1), -np.inf, scores)
    return np.einsum("bhst,bthd->bshd", softmax(scores), v)


# ---- MoE ---------------------------------------------------------------------------------------------
def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def choose_experts(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    """(t, k) experts of each token: the top-k of score + bias, in descending order (ties by expert index)."""
    return np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :top_k]


def router_topk(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, top_k: int,
                routed_scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """Sigmoid scores, top-k selection on score + bias (the aux-loss-free balancing bias picks experts but does
    not weight them), weights normalised over the selection and multiplied by the routed scaling.
    Returns (indices (t,k), weights (t,k)), experts in descending order of score + bias."""
    scores = sigmoid(x @ weight.T)
    indices = choose_experts(scores, bias, top_k)
    picked = np.take_along_axis(scores, indices, axis=-1)
    return indices, picked / np.sum(picked, axis=-1, keepdims=True) * routed_scaling


def dense_routing_weights(indices: np.ndarray, weights: np.ndarray, num_experts: int) -> np.ndarray:
    """(t, experts) matrix with each token's weights at its chosen experts: selection and weights in one array."""
    dense = np.zeros((indices.shape[0], num_experts))
    np.put_along_axis(dense, indices, weights, axis=-1)
    return dense


def router(x, weight, bias, top_k: int, routed_scaling: float) -> np.ndarray:
    indices, weights = router_topk(x, weight, bias, top_k, routed_scaling)
    return dense_routing_weights(indices, weights, weight.shape[0])


def sequence_aux_loss(scores: np.ndarray, indices: np.ndarray, batch: int, alpha: float) -> float:
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20), averaged over the batch's sequences.
    scores (t, experts): the gating scores s (sigmoid or softmax), rows sequence-major, t = batch * seq;
    indices (t, k): the experts each token was routed to. Per sequence of T tokens:
    f_i = N_r / (K_r T) * #{t : i chosen by t}, P_i = mean_t s_it / sum_j s_jt, loss = alpha * sum_i f_i P_i."""
    t, experts = scores.shape
    seq, k = t // batch, indices.shape[1]
    chosen = np.zeros((t, experts))
    np.put_along_axis(chosen, indices, 1.0, axis=-1)
    f = chosen.reshape(batch, seq, experts).sum(1) * experts / (k * seq)
    p = (scores / scores.sum(-1, keepdims=True)).reshape(batch, seq, experts).mean(1)
    return float(alpha * np.mean(np.sum(f * p, axis=-1)))


def router_z_loss(logits: np.ndarray, coeff: float) -> float:
    """ST-MoE's router z-loss: coeff * mean over tokens of logsumexp(logits)^2."""
    return float(coeff * np.mean(np.logaddexp.reduce(logits, axis=-1) ** 2))


def dispatch_combine(x: np.ndarray, indices: np.ndarray, weights: np.ndarray, expert_scale: np.ndarray) -> np.ndarray:
    """Each token goes to its k experts (here: expert e multiplies by expert_scale[e], enough to tell experts
    apart) and comes back as the routing-weighted sum, in token order."""
    return np.einsum("tk,tkh->th", weights, x[:, None, :] * expert_scale[indices])


def swiglu_ffn(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    gate = x @ w_gate
    return (gate * sigmoid(gate) * (x @ w_up)) @ w_down


def cross_entropy(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Mean token cross-entropy."""
    peak = np.max(logits, axis=-1, keepdims=True)
    logsumexp = np.log(np.sum(np.exp(logits - peak), axis=-1)) + peak[:, 0]
    return np.mean(logsumexp - np.take_along_axis(logits, labels[:, None].astype(np.int64), axis=-1)[:, 0])


def adamw(param, grad, exp_avg, exp_avg_sq, lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float, step: int, bias_correction: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One AdamW step with decoupled weight decay (Loshchilov & Hutter; torch.optim.AdamW). MindSpore's
    nn.AdamWeightDecay omits the bias correction: bias_correction=False is its definition."""
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    m_hat = exp_avg / (1 - beta1 ** step) if bias_correction else exp_avg
    v_hat = exp_avg_sq / (1 - beta2 ** step) if bias_correction else exp_avg_sq
    param = param * (1 - lr * weight_decay) - lr * m_hat / (np.sqrt(v_hat) + eps)
    return param, exp_avg, exp_avg_sq
