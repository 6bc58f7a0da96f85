"""Causal attention with per-document masks that never holds a [queries, keys] score tensor: FlashAttention.

query [b, h, sq, dq], key [b, h, sk, dq], value [b, h, sk, dv] (dq and dv may differ: MLA's 192 and 128),
segment_ids [b, sk] int32 whose runs of equal ids are the documents of each packed sample, positions [sq] int32 the
key position each query row stands at (arange(sk) for ordinary attention). out[b, h, i] = softmax_j(q_i . k_j *
scale) v_j over the keys j of i's document with j <= positions[i].

CPU: `ops.Custom` AOT kernels (kernels/flash_attention.cc, built by `native.py`), FlashAttention-2's algorithm:
query blocks against key blocks with an online softmax, only the key blocks a query block's documents reach (causal
and per-document block skipping: work follows the sum of squared document lengths), the rows' log-sum-exp saved
and the probabilities recomputed from it in the backward. float32 inside; other dtypes are cast to it and back.

Ascend: MindSpore's FlashAttentionScore (`flash_attention_ascend`), TND layout, sparse_mode 3 (causal within each
sequence, the compressed 2048x2048 mask), actual_seq_qlen = actual_seq_kvlen = the cumulative ends of the packed
documents over the flattened batch, exactly as many as there are documents (the op forbids zero-length entries);
the value heads zero-padded to the query head size (the op takes one head size; MindFormers pads MLA's so too) and
the padding cut off the output. A context-parallel shard's rows (runs of consecutive positions: the load-balanced
split's front and back block) are bound block by block in BNSD layout: each block's queries against the keys up to
its last position, sparse_mode 0 with an explicit [b, 1, rows, keys] mask of each row's document and causal
horizon (uint8, 1 = masked; a block of n rows costs n x its keys of mask, never the whole [s, s]).
"""
from __future__ import annotations

from functools import cache

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from dvm_fusion.adamw import cpu_threads
from dvm_fusion.native import library

# FlashAttentionScore in TND layout takes at most this many sequences (documents) per call.
MAX_DOCUMENTS = 1024
# sparse_mode 3 (right-down causal) reads an upper-triangular 2048x2048 uint8 mask: 1 = masked.
_FA_CAUSAL_MASK = np.triu(np.ones((2048, 2048), dtype=np.uint8), k=1)


def _float32(*dtypes):
    return ms.float32


@cache
def _cpu_kernel():
    """The forward kernel (out, lse) with its backward, built on first use (an Ascend run never needs g++)."""
    lib = library("flash_attention")
    grad = ops.Custom(f"{lib}:FlashAttentionGrad", out_shape=lambda q, k, v, *rest: (q, k, v),
                      out_dtype=lambda *dtypes: (ms.float32,) * 3, func_type="aot")

    def bprop(query, key, value, segment_ids, positions, hyper, out, dout):
        dq, dk, dv = grad(query, key, value, segment_ids, positions, hyper, out[0], out[1], dout[0])
        return dq, dk, dv, ops.zeros_like(segment_ids), ops.zeros_like(positions), ops.zeros_like(hyper)

    return ops.Custom(f"{lib}:FlashAttention", out_shape=lambda q, k, v, seg, pos, hyper: (q[:3] + v[3:], q[:3]),
                      out_dtype=lambda *dtypes: (ms.float32, ms.float32), func_type="aot", bprop=bprop)


def flash_attention_hyper(scale: float, threads: int | None = None) -> Tensor:
    """The CPU kernel's float32 [2]: the softmax scale and the threads it may use."""
    return Tensor(np.array([scale, cpu_threads() if threads is None else threads], np.float32))


def flash_attention_cpu(query, key, value, segment_ids, positions, hyper):
    """The module's contract on CPU; `hyper` from flash_attention_hyper. Returns [b, h, sq, dv] in query's dtype."""
    if query.dtype == key.dtype == value.dtype == ms.float32:
        return _cpu_kernel()(query, key, value, segment_ids, positions, hyper)[0]
    out = _cpu_kernel()(query.astype(ms.float32), key.astype(ms.float32), value.astype(ms.float32), segment_ids,
                        positions, hyper)[0]
    return out.astype(query.dtype)


def actual_seq_len(segment_ids):
    """int64 [documents] (the op's List[int64], passed as a tensor): the cumulative end of every document over the
    flattened batch (FlashAttention's actual_seq_qlen/kvlen in TND layout), one entry per document, none of length
    zero. Its length depends on the data (a dynamic shape, which Ascend's jit levels O0 and O1 take)."""
    b, s = segment_ids.shape
    ends_here = ops.cat((segment_ids[:, 1:] != segment_ids[:, :-1], ops.ones((b, 1), ms.bool_)), 1)
    position = ops.arange(1, b * s + 1, dtype=ms.int64).reshape(b, s)
    return ops.masked_select(position, ends_here)


def flash_attention_arguments(query, key, value, segment_ids):
    """(query, key, value in TND layout [b*s, h, dq], the value heads zero-padded to dq, actual_seq_len) for
    FlashAttentionScore."""
    b, h, s, dq = query.shape

    def tnd(x):
        return x.transpose(0, 2, 1, 3).reshape(b * s, h, x.shape[3])
    v = value
    if value.shape[3] < dq:
        v = ops.cat((value, ops.zeros(value.shape[:3] + (dq - value.shape[3],), value.dtype)), -1)
    return tnd(query), tnd(key), tnd(v), actual_seq_len(segment_ids)


def position_blocks(positions: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """The runs of consecutive positions of a shard's query rows: ((first row, first position, rows), ...)."""
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(positions)]])
    return tuple((int(a), int(positions[a]), int(e - a)) for a, e in zip(starts, ends))


def shard_block_mask(segment_ids, first: int, rows: int):
    """uint8 [b, 1, rows, first + rows], 1 = masked: query row i (at position first + i) sees the keys of its own
    document up to its position."""
    keys = first + rows
    seg = segment_ids[:, :keys]
    same_doc = ops.expand_dims(seg[:, first:], 2) == ops.expand_dims(seg, 1)
    causal = ops.expand_dims(ops.arange(first, keys, dtype=ms.int32), 1) >= ops.expand_dims(
        ops.arange(0, keys, dtype=ms.int32), 0)
    return ops.expand_dims(ops.logical_not(ops.logical_and(same_doc, causal)).astype(ms.uint8), 1)


class FlashAttentionAscend(nn.Cell):
    """The contract through FlashAttentionScore (float16/bfloat16 inputs, Ascend only). `positions`: a
    context-parallel shard's query positions (runs of consecutive ones), None for whole sequences."""

    def __init__(self, scale: float, positions: np.ndarray | None = None):
        super().__init__()
        self.scale = scale
        self.causal_mask = Tensor(_FA_CAUSAL_MASK)
        self.blocks = None if positions is None else position_blocks(np.asarray(positions))

    def construct(self, query, key, value, segment_ids, positions=None):
        if self.blocks is not None:
            return self.shard(query, key, value, segment_ids)
        b, h, s, _ = query.shape
        dv = value.shape[3]
        q, k, v, seq_len = flash_attention_arguments(query, key, value, segment_ids)
        out = ops.flash_attention_score(q, k, v, h, attn_mask=self.causal_mask, actual_seq_qlen=seq_len,
                                        actual_seq_kvlen=seq_len, scalar_value=self.scale, pre_tokens=2147483647,
                                        next_tokens=0, input_layout="TND", sparse_mode=3)
        return out[..., :dv].reshape(b, s, h, dv).transpose(0, 2, 1, 3)

    def shard(self, query, key, value, segment_ids):
        """Each block of consecutive query positions against the keys up to its last one (BNSD, explicit mask)."""
        h, dq, dv = query.shape[1], query.shape[3], value.shape[3]
        v = value
        if dv < dq:
            v = ops.cat((value, ops.zeros(value.shape[:3] + (dq - dv,), value.dtype)), -1)
        outs = ()
        for row, first, rows in self.blocks:
            keys = first + rows
            out = ops.flash_attention_score(query[:, :, row:row + rows], key[:, :, :keys], v[:, :, :keys], h,
                                            attn_mask=shard_block_mask(segment_ids, first, rows),
                                            scalar_value=self.scale, input_layout="BNSD", sparse_mode=0)
            outs = outs + (out[..., :dv],)
        return ops.cat(outs, 2)


class FlashAttentionCPU(nn.Cell):
    """The contract on CPU: query rows at `positions` (a context-parallel shard's), by default 0..s-1."""

    def __init__(self, scale: float):
        super().__init__()
        self.hyper = flash_attention_hyper(scale)

    def construct(self, query, key, value, segment_ids, positions=None):
        if positions is None:
            positions = ops.arange(0, query.shape[2], dtype=ms.int32)
        return flash_attention_cpu(query, key, value, segment_ids, positions, self.hyper)


def flash_attention_for(device_target: str, scale: float, positions: np.ndarray | None = None) -> nn.Cell:
    """(query, key, value, segment_ids[, positions]) -> out, per-document causal attention: FlashAttentionScore on
    Ascend (bound to a context-parallel shard's `positions` when given), the blockwise kernel elsewhere."""
    return FlashAttentionAscend(scale, positions) if device_target == "Ascend" else FlashAttentionCPU(scale)
