"""Multi-Latent Attention with decoupled RoPE (YaRN-scalable) and per-document causal masking.

Queries go through a low-rank latent (q_lora_rank), keys and values through a compressed latent (kv_lora_rank);
a small rotary part (qk_rope_head_dim) is computed beside the position-free part and shared by all heads for keys.
RoPE here is the rotate-half form; checkpoints stored with interleaved rotary channels (DeepSeek-V3 on HF) are
permuted once by the converter, not on every step.

Tensor parallelism (MindFormers' and Megatron's split of MLA): the latent down-projections q_a and kv_a and their
norms are replicated, q_b and kv_b are column-parallel over the heads (each rank computes H/tp heads), o_proj is
row-parallel. The region is entered once, on the normed input (under sequence parallelism: the sequence all-gather),
so attention runs on the whole sequence of the rank's heads with global RoPE positions and per-document masks.

Context parallelism (parallel/cp): the rank's positions of the sequence come in; after the rotary part is applied
at those positions, the normed latent and the rotated shared key ([b, s/cp, kv_lora_rank + rope]: what MLA caches,
the smallest tensor keys and values are made from) are gathered over the context-parallel group in sequence order,
the keys and values of the whole sequence made from them, and the rank's query rows attend at their positions.
"""
from __future__ import annotations

import math

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from dvm_fusion.flash_attention import flash_attention_for
from dvm_fusion.rowwise import BiasSoftmaxCPU, rope_cpu
from telechat_moe.config import ModelConfig, yarn_mscale
from parallel.cp import ContextParallel, GatherContext
from parallel.tp.mappings import EnterRegion, TensorParallel
from telechat_moe.layers import Linear, RMSNorm, column_linear, ms_dtype, row_linear, weight_seed

MASK_VALUE = -1e9


def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies and cos/sin scaling; YaRN when rotary_scaling_factor > 1 (same maths as transformers)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if not cfg.yarn_enabled:
        return 1.0 / pos_freqs, 1.0
    factor = cfg.rotary_scaling_factor

    def correction_dim(rotations):
        return dim * math.log(cfg.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    if cfg.mscale and cfg.mscale_all_dim:
        attention_factor = yarn_mscale(factor, cfg.mscale) / yarn_mscale(factor, cfg.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)
    return inv_freq, attention_factor


def rope_tables(cfg: ModelConfig, length: int) -> tuple[np.ndarray, np.ndarray]:
    inv_freq, scaling = rope_inv_freq(cfg)
    freqs = np.outer(np.arange(length, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return (np.cos(emb) * scaling).astype(np.float32), (np.sin(emb) * scaling).astype(np.float32)


class _SplitLast(nn.Cell):
    """x [..., n] -> (x[..., :first], x[..., first:]), whose gradient is the two gradients concatenated. MindSpore
    differentiates each slice apart, to a zero tensor of the whole input with the slice written in, and adds the two
    (small: 60 StridedSliceGrads and 24 AddNs a step, 30 and 11 ms, where a Concat does it)."""

    def construct(self, x, first):
        return x[..., :first], x[..., first:]

    def bprop(self, x, first, out, dout):
        return ops.cat(dout, -1), 0


_SPLIT_LAST = _SplitLast()


def split_last(x, first: int):
    """(x[..., :first], x[..., first:]), differentiated as one split."""
    return _SPLIT_LAST(x, first)


def sliced(x, first: int):
    """(x[..., :first], x[..., first:]) as two slices, differentiated apart: the split of a layer under full
    recompute. Under PyNative's autograd over a compiled chunk (the pipeline executor) a cell with a bprop of its
    own (split_last) keeps its input for the backward, so recompute does not rerun the matmul that made it:
    q_b_proj, kv_a_proj_with_mqa and kv_b_proj, 3 matmuls a layer (measured, docs/pipeline.md); graph mode reruns
    them either way."""
    return x[..., :first], x[..., first:]


def rotate_half(x):
    first, second = split_last(x, x.shape[-1] // 2)
    return ops.cat((-second, first), -1)


def apply_rope(x, cos, sin):
    """x [b, heads, s, d]; cos/sin [b, 1, s, d]."""
    return x * cos + rotate_half(x) * sin


def attention_bias(segment_ids, causal: Tensor):
    """Additive mask [b, 1, s, s]: a position sees earlier positions of its own document only."""
    s = segment_ids.shape[1]
    same_doc = ops.expand_dims(segment_ids, 2) == ops.expand_dims(segment_ids, 1)
    visible = ops.logical_and(same_doc, causal[:s, :s])
    return ops.expand_dims((1.0 - visible.astype(ms.float32)) * MASK_VALUE, 1)


def dense_causal_attention(query, key, value, bias, scale: float, softmax_dtype, compute_dtype, fused_softmax=None):
    """softmax(q k^T * scale + bias) v over the full [s, s] score matrix; `bias` masks across documents.
    `fused_softmax(scores, bias)`: one kernel for the scaling, masking and softmax (dvm_fusion/rowwise.py)."""
    scores = ops.BatchMatMul(transpose_b=True)(query, key).astype(softmax_dtype)
    if fused_softmax is None:
        probs = ops.softmax(scores * scale + bias, -1)
    else:
        probs = fused_softmax(scores, bias)
    return ops.BatchMatMul()(probs.astype(compute_dtype), value.astype(compute_dtype))


class AttentionCore(nn.Cell):
    """softmax(q k^T * scale + mask) v by the configured kernel, a cell of its own so that selective recompute
    can drop just its scores (the largest activations of a layer) and recompute them in the backward.
    flash (dvm_fusion/flash_attention.py): blockwise, no [s, s] tensor, `mask` the segment ids; dense: the full
    score matrix, `mask` the additive bias."""

    def __init__(self, cfg: ModelConfig, device_target: str = "CPU", positions: np.ndarray | None = None):
        """`positions`: the key position of each query row under context parallelism (None: the whole sequence)."""
        super().__init__()
        self.scale = cfg.softmax_scale()
        self.flash = cfg.attention_kernel == "flash"
        self.positions = None if positions is None else Tensor(positions)
        if self.flash:
            self.flash_attention = flash_attention_for(device_target, self.scale, positions)
        self.softmax_dtype = ms_dtype(cfg.softmax_compute_dtype)
        self.compute_dtype = ms_dtype(cfg.compute_dtype)
        self.fused_softmax = (BiasSoftmaxCPU(self.scale) if device_target != "Ascend" and not self.flash
                              and self.softmax_dtype == ms.float32 else None)

    def construct(self, query, key, value, mask):
        if self.flash:
            if self.positions is None:
                return self.flash_attention(query, key, value, mask)
            return self.flash_attention(query, key, value, mask, self.positions)
        if self.positions is not None:      # the bias rows of this rank's query positions
            mask = ops.gather(mask, self.positions, 2)
        return dense_causal_attention(query, key, value, mask, self.scale, self.softmax_dtype, self.compute_dtype,
                                      self.fused_softmax)


class MultiLatentAttention(nn.Cell):
    def __init__(self, cfg: ModelConfig, device_target: str = "CPU", seed: int = 0, name: str = "self_attn",
                 tp: TensorParallel = TensorParallel(), cp: ContextParallel = ContextParallel()):
        """`name`: the cell's parameter prefix (e.g. layers.3.self_attn), which seeds its weights; `cp`: the
        context-parallel group whose shards of the sequence the keys and values are gathered from."""
        super().__init__()
        std, cdt = cfg.initializer_range, ms_dtype(cfg.compute_dtype)
        self.cfg = cfg
        H = cfg.num_attention_heads
        self.num_heads = tp.local(H, "num_attention_heads")    # this rank's heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim

        def seed_of(what):
            return weight_seed(seed, f"{name}.{what}")

        self.enter = EnterRegion(tp, cdt)
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, std, cdt, seed_of("q_a_proj"))
            self.q_a_layernorm = (RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, device_target) if cfg.qk_layernorm
                                  else nn.Identity())
            self.q_b_proj = column_linear(cfg.q_lora_rank, H * cfg.qk_head_dim, std, cdt, seed_of("q_b_proj"), tp,
                                          input_ready=True)
        else:
            self.q_proj = column_linear(cfg.hidden_size, H * cfg.qk_head_dim, std, cdt, seed_of("q_proj"), tp,
                                        input_ready=True)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_lora_rank + self.rope, std, cdt,
                                         seed_of("kv_a_proj_with_mqa"))
        self.kv_a_layernorm = (RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, device_target) if cfg.qk_layernorm
                               else nn.Identity())
        self.kv_b_proj = column_linear(cfg.kv_lora_rank, H * (self.nope + self.v_dim), std, cdt, seed_of("kv_b_proj"),
                                       tp, input_ready=True)
        self.o_proj = row_linear(H * self.v_dim, cfg.hidden_size, std, cdt, seed_of("o_proj"), tp)
        self.context = GatherContext(cp) if cp.cp > 1 else None
        self.core = AttentionCore(cfg, device_target, cp.positions() if cp.cp > 1 else None)
        # on CPU one kernel each way (dvm_fusion/rowwise.py) instead of about seven forward and ten backward
        self.rotary = apply_rope if device_target == "Ascend" else rope_cpu
        self.split = split_last     # `sliced` under full recompute (TeleChatMoE.set_recompute)

    def construct(self, x, cos, sin, mask):
        """`mask` is what the attention kernel needs: the segment ids [b, s] (flash) or the additive bias
        [b, 1, s, s] (dense); TeleChatMoE.attention_mask makes it. `x` is [b, s, h], or under sequence parallelism this
        rank's [b, s/tp, h] (and so is the output)."""
        x = self.enter(x)
        b, s, _ = x.shape
        h = self.num_heads
        if self.cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.reshape(b, s, h, self.nope + self.rope).transpose(0, 2, 1, 3)
        q_nope, q_rot = self.split(q, self.nope)

        latent, k_rot = self.split(self.kv_a_proj_with_mqa(x), self.cfg.kv_lora_rank)
        q_rot = self.rotary(q_rot.astype(ms.float32), cos, sin).astype(q.dtype)
        k_rot = self.rotary(k_rot.reshape(b, 1, s, self.rope).astype(ms.float32), cos, sin).astype(q.dtype)
        latent = self.kv_a_layernorm(latent)
        sk = s
        if self.context is not None:
            # the whole sequence's latent and shared key, in sequence order, in the compute dtype (kv_b_proj's
            # input dtype: the cast it would make anyway, before the gather)
            both = self.context(ops.cat((latent.astype(q.dtype), k_rot.reshape(b, s, self.rope)), -1))
            sk = both.shape[1]
            latent, k_rot = self.split(both, self.cfg.kv_lora_rank)
            k_rot = k_rot.reshape(b, 1, sk, self.rope)
        kv = self.kv_b_proj(latent)
        kv = kv.reshape(b, sk, h, self.nope + self.v_dim).transpose(0, 2, 1, 3)
        k_nope, v = self.split(kv, self.nope)

        query = ops.cat((q_nope, q_rot), -1)
        key = ops.cat((k_nope, ops.broadcast_to(k_rot, (b, h, sk, self.rope))), -1)

        out = self.core(query, key, v, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, s, h * self.v_dim))
