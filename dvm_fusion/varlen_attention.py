"""Variable-length (per-document) causal attention over packed samples: work follows sum(l_i^2), not s^2.

query/key [b, h, s, dq], value [b, h, s, dv], segment_ids [b, s] int32 whose runs of equal ids are the documents
of each packed sample. out[b, h, i] = softmax_j(q_i . k_j * scale) v_j over the positions j <= i of i's document.

CPU: an `ops.Custom` pyfunc over NumPy with its own backward. Documents of equal length (across the whole batch)
are gathered into one stack and computed with batched matmuls; long documents are cut into query tiles that
only reach keys up to the tile's end, so a document of length l costs about l^2/2 per head, the causal half.
Softmax is in float32 whatever the input dtype. The backward recomputes the probabilities tile by tile (no
[s, s] tensor outlives a tile) and uses the forward output for the softmax correction, as FlashAttention does.

Ascend: MindSpore's FlashAttentionScore, input_layout "TND", sparse_mode 3 (causal, compressed 2048x2048 mask),
actual_seq_qlen = actual_seq_kvlen = cumulative document ends over the flattened batch: the arguments
MindFormers builds with use_eod_attn_mask_compression. They are built here from segment_ids in the graph.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, ops

# Query rows per tile. Fixed, so a document of length l costs l^2/2 + l*QUERY_TILE/2 score entries per head
# (the causal half plus the diagonal tiles): exactly the cost model's a*l^2 + b*l, as FlashAttention's blocks.
QUERY_TILE = 128
# Score entries (float32) of one tile at most, counting the documents of equal length batched into it: large
# enough that BLAS calls outweigh Python overhead, small enough to stay near the caches.
TILE_ELEMENTS = 1 << 20
# FlashAttentionScore in TND layout accepts at most this many sequences (documents) per call.
MAX_DOCUMENTS = 1024
# sparse_mode 3 (right-down causal) reads an upper-triangular 2048x2048 uint8 mask: 1 = masked.
_FA_CAUSAL_MASK = np.triu(np.ones((2048, 2048), dtype=np.uint8), k=1)


# ---- NumPy kernels -----------------------------------------------------------------------------------------------

def document_runs(segment_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sample, start, length) of every run of equal ids, in row-major order."""
    seg = np.asarray(segment_ids)
    b, s = seg.shape
    first = np.ones((b, s), dtype=bool)
    first[:, 1:] = seg[:, 1:] != seg[:, :-1]
    flat = np.flatnonzero(first)
    return flat // s, flat % s, np.diff(np.append(flat, b * s))


def _length_groups(segment_ids: np.ndarray):
    """Yield (length, sample [n], start [n]) for the documents of each distinct length."""
    sample, start, length = document_runs(segment_ids)
    order = np.argsort(length, kind="stable")
    lengths = length[order]
    cuts = np.flatnonzero(np.diff(lengths)) + 1
    for idx in np.split(order, cuts):
        yield int(length[idx[0]]), sample[idx], start[idx]


def _tile_rows(l: int) -> int:
    return min(l, QUERY_TILE)


def _tiles(n: int, h: int, l: int):
    """(doc0, doc1, row0, row1) tiles of n documents of length l: each tile's scores fit in TILE_ELEMENTS."""
    rows = _tile_rows(l)
    docs = max(1, TILE_ELEMENTS // (h * rows * l))
    for d0 in range(0, n, docs):
        for r0 in range(0, l, rows):
            yield d0, min(n, d0 + docs), r0, min(l, r0 + rows)


def _causal_tri(rows: int) -> np.ndarray:
    return np.triu(np.full((rows, rows), -np.inf, dtype=np.float32), k=1)


def _probabilities(q, k, r0: int, r1: int, tri: np.ndarray) -> np.ndarray:
    """Softmax over keys 0..r1 of query rows r0..r1 (q already scaled), float32 [n, h, r1-r0, r1]."""
    p = np.matmul(q[:, :, r0:r1], k[:, :, :r1].swapaxes(-1, -2))
    p[..., r0:r1] += tri[:r1 - r0, :r1 - r0]
    p -= p.max(axis=-1, keepdims=True)
    np.exp(p, out=p)
    p /= p.sum(axis=-1, keepdims=True)
    return p


def _gather(x: np.ndarray, sample: np.ndarray, start: np.ndarray, length: int) -> np.ndarray:
    """[n, h, length, d] float32 copies of the documents starting at (sample, start) of x [b, h, s, d]."""
    pos = start[:, None] + np.arange(length)
    return np.ascontiguousarray(x[sample[:, None], :, pos].transpose(0, 2, 1, 3), dtype=np.float32)


def _scatter(dst: np.ndarray, sample: np.ndarray, start: np.ndarray, values: np.ndarray) -> None:
    pos = start[:, None] + np.arange(values.shape[2])
    dst[sample[:, None], :, pos] = values.transpose(0, 2, 1, 3)


def varlen_attention_numpy(query, key, value, segment_ids, scale) -> np.ndarray:
    """Forward: [b, h, s, dv] in the query's dtype."""
    scale = float(scale)
    out = np.empty(query.shape[:3] + (value.shape[3],), dtype=query.dtype)
    h = query.shape[1]
    for l, sample, start in _length_groups(segment_ids):
        q = _gather(query, sample, start, l)
        q *= scale
        k, v = _gather(key, sample, start, l), _gather(value, sample, start, l)
        o = np.empty(q.shape[:3] + (v.shape[3],), dtype=np.float32)
        tri = _causal_tri(_tile_rows(l))
        for d0, d1, r0, r1 in _tiles(len(sample), h, l):
            p = _probabilities(q[d0:d1], k[d0:d1], r0, r1, tri)
            np.matmul(p, v[d0:d1, :, :r1], out=o[d0:d1, :, r0:r1])
        _scatter(out, sample, start, o)
    return out


def varlen_attention_grad_numpy(query, key, value, segment_ids, scale, out, dout):
    """Backward: (dq, dk, dv) in the dtypes of query, key, value. `out` is the forward output."""
    scale = float(scale)
    dq_all, dk_all = np.empty_like(query), np.empty_like(key)
    dv_all = np.empty_like(value)
    h = query.shape[1]
    for l, sample, start in _length_groups(segment_ids):
        q = _gather(query, sample, start, l)
        q *= scale
        k, v = _gather(key, sample, start, l), _gather(value, sample, start, l)
        do = _gather(dout, sample, start, l)
        # Softmax correction: sum_j p_ij dp_ij = do_i . o_i.
        delta = np.einsum("nhld,nhld->nhl", do, _gather(out, sample, start, l))[..., None]
        dq, dk, dv = np.empty_like(q), np.zeros_like(k), np.zeros_like(v)
        tri = _causal_tri(_tile_rows(l))
        for d0, d1, r0, r1 in _tiles(len(sample), h, l):
            p = _probabilities(q[d0:d1], k[d0:d1], r0, r1, tri)
            do_t = do[d0:d1, :, r0:r1]
            dv[d0:d1, :, :r1] += np.matmul(p.swapaxes(-1, -2), do_t)
            ds = np.matmul(do_t, v[d0:d1, :, :r1].swapaxes(-1, -2))
            ds -= delta[d0:d1, :, r0:r1]
            ds *= p
            np.matmul(ds, k[d0:d1, :, :r1], out=dq[d0:d1, :, r0:r1])
            dk[d0:d1, :, :r1] += np.matmul(ds.swapaxes(-1, -2), q[d0:d1, :, r0:r1])
        dq *= scale          # q was scaled, so dk already carries its factor; dq gets it here
        _scatter(dq_all, sample, start, dq)
        _scatter(dk_all, sample, start, dk)
        _scatter(dv_all, sample, start, dv)
    return dq_all, dk_all, dv_all


# ---- MindSpore bindings ------------------------------------------------------------------------------------------

def _grad_shapes(q, k, v, seg, scale, out, dout):
    return q, k, v


def _grad_dtypes(q, k, v, seg, scale, out, dout):
    return q, k, v


_varlen_grad = ops.Custom(varlen_attention_grad_numpy, out_shape=_grad_shapes, out_dtype=_grad_dtypes,
                          func_type="pyfunc")


def _varlen_bprop(query, key, value, segment_ids, scale, out, dout):
    dq, dk, dv = _varlen_grad(query, key, value, segment_ids, scale, out, dout)
    return dq, dk, dv, ops.zeros_like(segment_ids), ops.zeros_like(scale)


def _out_shape(q, k, v, seg, scale):
    return q[:3] + v[3:]


def _out_dtype(q, k, v, seg, scale):
    return q


_varlen_cpu = ops.Custom(varlen_attention_numpy, out_shape=_out_shape, out_dtype=_out_dtype, func_type="pyfunc",
                         bprop=_varlen_bprop)


def varlen_causal_attention_cpu(query, key, value, segment_ids, scale):
    """[b, h, s, dq], [b, h, s, dq], [b, h, s, dv], [b, s] int32, float -> [b, h, s, dv]; see the module doc."""
    return _varlen_cpu(query, key, value, segment_ids, Tensor(scale, ms.float32))


def actual_seq_len(segment_ids):
    """int32 [min(b*s, MAX_DOCUMENTS)]: cumulative document ends over the flattened batch, padded with b*s.

    FlashAttention's actual_seq_qlen/kvlen in TND layout (MindFormers' compressed EOD mask after its per-sample
    offsets). A batch with more documents than the pad length cannot be expressed and loses its last ends.
    """
    b, s = segment_ids.shape
    total = b * s
    ends_here = ops.cat((segment_ids[:, 1:] != segment_ids[:, :-1], ops.ones((b, 1), ms.bool_)), 1)
    position = ops.arange(1, total + 1, dtype=ms.int32).reshape(b, s)
    ends = ops.where(ends_here, position, ops.full((b, s), total, dtype=ms.int32)).reshape(-1)
    return ops.sort(ends)[0][:min(total, MAX_DOCUMENTS)]


def flash_attention_arguments(query, key, value, segment_ids):
    """(query, key, value in TND layout [b*s, h, d], actual_seq_len) for FlashAttentionScore."""
    b, h, s, _ = query.shape

    def tnd(x):
        return x.transpose(0, 2, 1, 3).reshape(b * s, h, x.shape[3])
    return tnd(query), tnd(key), tnd(value), actual_seq_len(segment_ids)


def varlen_causal_attention_ascend(query, key, value, segment_ids, scale):
    """The same contract through FlashAttentionScore (float16/bfloat16 inputs, Ascend only)."""
    b, h, s, _ = query.shape
    q, k, v, seq_len = flash_attention_arguments(query, key, value, segment_ids)
    out = ops.flash_attention_score(q, k, v, h, attn_mask=Tensor(_FA_CAUSAL_MASK), actual_seq_qlen=seq_len,
                                    actual_seq_kvlen=seq_len, scalar_value=scale, pre_tokens=2147483647,
                                    next_tokens=0, input_layout="TND", sparse_mode=3)
    return out.reshape(b, s, h, value.shape[3]).transpose(0, 2, 1, 3)


def attention_kernel_for(device_target: str):
    """The variable-length causal attention for a device: FlashAttention on Ascend, the NumPy kernel elsewhere."""
    if device_target == "Ascend":
        return varlen_causal_attention_ascend
    return varlen_causal_attention_cpu
