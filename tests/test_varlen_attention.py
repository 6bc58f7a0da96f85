"""Variable-length causal attention: the CPU kernel (forward and its backward, in graph mode) against a float64
dense-masked reference for several segmentations and dtypes; the tiling and batching of the NumPy kernel; and the
Ascend binding's arguments (TND layout, cumulative document ends) by shape and by emulating their semantics; and
the model's own per-document masking: its dense bias against the same reference, and MultiLatentAttention on packed
documents (dense and varlen) against each document run alone."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from data_sched.packing import doc_lens_to_actual_seq_len
from dvm_fusion import varlen_attention as va
from precision.tolerance import assert_close, chain_tolerance, relative_error, round_to

SCALE = 0.2


def segment_ids(samples_doc_lens) -> np.ndarray:
    return np.stack([np.repeat(np.arange(len(l), dtype=np.int32), l) for l in samples_doc_lens])


def reference(q, k, v, seg, scale, dout):
    """float64 dense attention under the per-document causal mask: (out, dq, dk, dv)."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    s = q.shape[2]
    visible = (seg[:, None, :, None] == seg[:, None, None, :]) & np.tril(np.ones((s, s), dtype=bool))
    scores = np.where(visible, q @ k.swapaxes(-1, -2) * scale, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = dout @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return p @ v, ds @ k * scale, ds.swapaxes(-1, -2) @ q * scale, p.swapaxes(-1, -2) @ dout


def inputs(rng, b, h, s, dq, dv, dtype):
    """q, k, v, dout in `dtype` (scaled so softmax is neither flat nor one-hot)."""
    return [(rng.standard_normal(shape) * scale).astype(dtype)
            for shape, scale in (((b, h, s, dq), 1.0), ((b, h, s, dq), 1.0), ((b, h, s, dv), 1.0),
                                 ((b, h, s, dv), 1.0))]


def tolerances(dtype, dq, dv, longest):
    """Forward: q.k over dq, the softmax sum over the document, p.v over the document. Backward: the recomputed
    probabilities (dq, document), dout.v over dv, then the sum over the document's keys (dq) or queries (dk, dv)."""
    return (chain_tolerance(dtype, (dq, longest, longest)),
            chain_tolerance(dtype, (dq, longest, dv, longest)))


SEGMENTATIONS = {
    "one document": [[300], [300]],
    "many short": [[3] * 100, [5] * 60],
    "length one": [[1] * 300, [1, 298, 1]],
    "mixed": [[1, 130, 2, 167], [257, 43]],
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(SEGMENTATIONS))
def test_graph_mode_forward_and_gradients_match_reference(name, dtype):
    import mindspore as ms
    from mindspore import Tensor, nn

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    lens = SEGMENTATIONS[name]
    seg = segment_ids(lens)
    b, h, s, dq, dv = len(lens), 3, seg.shape[1], 24, 16
    q, k, v, dout = inputs(np.random.default_rng(len(name)), b, h, s, dq, dv, dtype)

    class Loss(nn.Cell):
        def construct(self, q, k, v, seg, dout):
            return (va.varlen_causal_attention_cpu(q, k, v, seg, SCALE) * dout).sum()

    grad = ms.grad(Loss(), grad_position=(0, 1, 2))
    args = [Tensor(x) for x in (q, k, v, seg, dout)]
    out = va.varlen_causal_attention_cpu(*args[:4], SCALE).asnumpy()
    grads = [g.asnumpy() for g in grad(*args)]
    assert out.dtype == np.dtype(dtype) and all(g.dtype == np.dtype(dtype) for g in grads)
    want = reference(*(round_to(x, dtype) for x in (q, k, v)), seg, SCALE, round_to(dout, dtype))
    tol_fwd, tol_bwd = tolerances(dtype, dq, dv, max(max(x) for x in lens))
    assert_close(out, want[0], tol_fwd, f"{name} {dtype} out")
    for got, ref, what in zip(grads, want[1:], ("dq", "dk", "dv")):
        assert_close(got, ref, tol_bwd, f"{name} {dtype} {what}")


@pytest.mark.parametrize("query_tile, tile_elements", [(4, 64), (16, 1 << 12), (7, 1 << 20)])
def test_numpy_kernel_tiles_and_batches_documents_exactly(monkeypatch, query_tile, tile_elements):
    """Small tiles: long documents cross many query tiles, equal-length documents are split across batches."""
    monkeypatch.setattr(va, "QUERY_TILE", query_tile)
    monkeypatch.setattr(va, "TILE_ELEMENTS", tile_elements)
    rng = np.random.default_rng(7)
    lens = [[2, 2, 2, 40, 2, 2, 50], [33, 2, 2, 2, 2, 2, 57], [100]]
    seg = segment_ids(lens)
    q, k, v, dout = inputs(rng, len(lens), 2, seg.shape[1], 8, 5, "float32")
    out = va.varlen_attention_numpy(q, k, v, seg, SCALE)
    grads = va.varlen_attention_grad_numpy(q, k, v, seg, SCALE, out, dout)
    want = reference(q, k, v, seg, SCALE, dout)
    tol_fwd, tol_bwd = tolerances("float32", 8, 5, 100)
    assert_close(out, want[0], tol_fwd, "out")
    for got, ref, what in zip(grads, want[1:], ("dq", "dk", "dv")):
        assert_close(got, ref, tol_bwd, what)


def test_documents_are_runs_of_equal_ids():
    seg = np.array([[0, 0, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5], [0, 1, 2, 3, 4, 5]], dtype=np.int32)
    sample, start, length = va.document_runs(seg)
    assert sample.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2, 2]
    assert start.tolist() == [0, 2, 3, 0, 0, 1, 2, 3, 4, 5]
    assert length.tolist() == [2, 1, 3, 6, 1, 1, 1, 1, 1, 1]


# ---- the Ascend binding -------------------------------------------------------------------------------------------

def flash_attention_tnd(q, k, v, seq_len, scale):
    """What FlashAttentionScore(TND, sparse_mode=3) computes: causal attention inside each [end_{i-1}, end_i)."""
    out = np.zeros(q.shape[:2] + (v.shape[2],))
    start = 0
    for end in seq_len.tolist():
        if end > start:
            qs, ks, vs = (x[start:end].transpose(1, 0, 2).astype(np.float64) for x in (q, k, v))
            scores = qs @ ks.swapaxes(-1, -2) * scale + np.triu(np.full((end - start,) * 2, -np.inf), 1)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[start:end] = ((p / p.sum(-1, keepdims=True)) @ vs).transpose(1, 0, 2)
        start = end
    return out


def test_flash_attention_arguments_are_tnd_with_cumulative_document_ends():
    import mindspore as ms
    from mindspore import Tensor

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    lens = [[1, 130, 2, 167], [257, 43], [300]]
    seg = segment_ids(lens)
    b, h, s, dq, dv = len(lens), 4, seg.shape[1], 16, 8
    q, k, v, _ = inputs(np.random.default_rng(3), b, h, s, dq, dv, "float32")

    args = ms.jit(va.flash_attention_arguments)(Tensor(q), Tensor(k), Tensor(v), Tensor(seg))
    tq, tk, tv, seq_len = (x.asnumpy() for x in args)
    assert tq.shape == (b * s, h, dq) and tk.shape == (b * s, h, dq) and tv.shape == (b * s, h, dv)
    assert np.array_equal(tq[s + 5], q[1, :, 5]) and np.array_equal(tv[2 * s - 1], v[1, :, s - 1])
    # MindFormers' compressed EOD mask per sample, each shifted by the tokens before it (asl_batch_wrapper).
    pad = len(seq_len)
    assert seq_len.dtype == np.int32 and pad == min(b * s, va.MAX_DOCUMENTS)
    want = np.concatenate([doc_lens_to_actual_seq_len(x, s, len(x)) + i * s for i, x in enumerate(lens)])
    assert np.array_equal(seq_len, np.pad(want, (0, pad - len(want)), constant_values=b * s))
    # Those arguments, read the way FlashAttention reads them, give the CPU kernel's result.
    got = flash_attention_tnd(tq, tk, tv, seq_len, SCALE).reshape(b, s, h, dv).transpose(0, 2, 1, 3)
    assert_close(got, va.varlen_attention_numpy(q, k, v, seg, SCALE), chain_tolerance("float32", (dq, s, s)),
                 "TND emulation")
    assert va._FA_CAUSAL_MASK.shape == (2048, 2048) and va._FA_CAUSAL_MASK[0, 1] == 1 == 1 - va._FA_CAUSAL_MASK[1, 0]


def test_kernel_choice_follows_the_device():
    assert va.attention_kernel_for("CPU") is va.varlen_causal_attention_cpu
    assert va.attention_kernel_for("Ascend") is va.varlen_causal_attention_ascend


# ---- the model's per-document masks --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ["many short", "length one", "mixed"])
def test_model_dense_mask_matches_reference(name, dtype):
    """The dense path: the additive bias MultiLatentAttention gets from segment ids, with the model's attention."""
    import mindspore as ms
    from mindspore import Tensor

    from telechat_moe.mla import attention_bias, dense_causal_attention

    ms.set_context(mode=ms.PYNATIVE_MODE)
    lens = SEGMENTATIONS[name]
    seg = segment_ids(lens)
    b, h, s, dq, dv = len(lens), 3, seg.shape[1], 24, 16
    q, k, v, _ = inputs(np.random.default_rng(len(name) + 100), b, h, s, dq, dv, dtype)
    bias = attention_bias(Tensor(seg), Tensor(np.tril(np.ones((s, s), dtype=np.bool_))))
    out = dense_causal_attention(Tensor(q), Tensor(k), Tensor(v), bias, SCALE, ms.float32,
                                 ms.float16 if dtype == "float16" else ms.float32).asnumpy()
    want = reference(*(round_to(x, dtype) for x in (q, k, v)), seg, SCALE, np.zeros_like(v))[0]
    # scores and p.v run over the whole packed row here (masked entries are exact zeros but still summed)
    assert_close(out, want, chain_tolerance(dtype, (dq, s, s)), f"{name} {dtype} dense")


MLA_DOCS = [[9, 23, 16], [30, 1, 17]]  # two packed samples of three documents each


def mla_cells():
    """A small MultiLatentAttention on the dense path and the same weights on the varlen kernel."""
    from telechat_moe.config import ModelConfig
    from telechat_moe.mla import MultiLatentAttention

    cfg = ModelConfig(hidden_size=48, num_attention_heads=3, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=12, seq_length=48, max_position_embeddings=48,
                      initializer_range=0.3)
    dense = MultiLatentAttention(cfg)
    varlen = MultiLatentAttention(dataclasses.replace(cfg, attention_kernel="varlen"))
    for dst, src in zip(varlen.get_parameters(), dense.get_parameters()):
        dst.set_data(src.value())
    return cfg, dense, varlen


def test_mla_on_packed_documents_equals_each_document_alone():
    """Three documents packed in a sample give, on the dense and on the varlen path, what each document gives run
    alone (at the same positions, so RoPE tables are identical and only the masking can differ)."""
    import mindspore as ms
    from mindspore import Tensor

    from data_sched.packing import doc_lens_to_segment_ids
    from telechat_moe.mla import attention_bias, rope_tables

    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg, dense, varlen = mla_cells()
    s, b = cfg.seq_length, len(MLA_DOCS)
    cos, sin = (np.broadcast_to(t[None, None], (b, 1) + t.shape) for t in rope_tables(cfg, s))
    causal = Tensor(np.tril(np.ones((s, s), dtype=np.bool_)))
    seg = Tensor(np.stack([doc_lens_to_segment_ids(lens, s) for lens in MLA_DOCS]))
    x = np.random.default_rng(4).standard_normal((b, s, cfg.hidden_size)).astype(np.float32)

    def alone(cell, mask_of):
        """Each document on its own: a batch of one, a sequence of its length, one segment."""
        out = np.zeros(x.shape, np.float32)
        for i, lens in enumerate(MLA_DOCS):
            for start, end in zip(np.cumsum([0] + lens[:-1]), np.cumsum(lens)):
                rows = (slice(i, i + 1), slice(None), slice(start, end))
                one = Tensor(np.zeros((1, end - start), np.int32))
                out[i, start:end] = cell(Tensor(x[i:i + 1, start:end]), Tensor(cos[rows]), Tensor(sin[rows]),
                                         mask_of(one)).asnumpy()[0]
        return out

    def packed(cell, mask):
        return cell(Tensor(x), Tensor(cos), Tensor(sin), mask).asnumpy()

    want = alone(dense, lambda one: attention_bias(one, causal))
    # the projections (hidden, q latent, kv latent), scores over the head dim, softmax and p.v over the packed row,
    # the output projection over heads * v_head_dim
    tol = chain_tolerance("float32", (cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, s, s,
                                      cfg.num_attention_heads * cfg.v_head_dim))
    assert_close(packed(dense, attention_bias(seg, causal)), want, tol, "dense, packed vs alone")
    assert_close(packed(varlen, seg), want, tol, "varlen, packed vs alone")
    assert_close(alone(varlen, lambda one: one), want, tol, "varlen alone vs dense alone")
    # One causal mask over the whole sample lets documents see each other: far off, so the test can tell.
    leaky = packed(dense, attention_bias(Tensor(np.zeros((b, s), np.int32)), causal))
    assert relative_error(leaky, want) > 100 * tol.rtol
