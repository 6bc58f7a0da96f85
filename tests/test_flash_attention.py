"""Flash attention (dvm_fusion/flash_attention.py): the CPU kernel (forward and its backward, in graph mode) against
a float64 dense-masked reference for several segmentations, dtypes and MLA's unequal head sizes; query rows at other
positions (a context-parallel shard); threads; the Ascend binding's arguments (TND layout, padded value heads, one
cumulative end per document) by the installed signature and by emulating the op's documented semantics; and the
model's own per-document masking: its dense bias against the same reference, MultiLatentAttention on packed documents
(dense and flash) against each document run alone, and MLA's flash path against its dense one, forward and every
gradient."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from data_sched.packing import doc_lens_to_actual_seq_len
from dvm_fusion import flash_attention as fa
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


@pytest.mark.parametrize("name, heads, dtype", [(name, (24, 16), "float32") for name in SEGMENTATIONS]
                         + [("mixed", (24, 16), "float16"), ("mixed", (192, 128), "float32")])
def test_graph_mode_forward_and_gradients_match_reference(name, heads, dtype):
    import mindspore as ms
    from mindspore import Tensor, nn

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    lens = SEGMENTATIONS[name]
    seg = segment_ids(lens)
    (b, h, s), (dq, dv) = (len(lens), 3, seg.shape[1]), heads
    q, k, v, dout = inputs(np.random.default_rng(len(name)), b, h, s, dq, dv, dtype)
    attention = fa.FlashAttentionCPU(SCALE)

    class Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.attention = attention

        def construct(self, q, k, v, seg, dout):
            return (self.attention(q, k, v, seg) * dout).sum()

    grad = ms.grad(Loss(), grad_position=(0, 1, 2))
    args = [Tensor(x) for x in (q, k, v, seg, dout)]
    out = ms.jit(attention)(*args[:4]).asnumpy()
    grads = [g.asnumpy() for g in grad(*args)]
    assert out.dtype == np.dtype(dtype) and all(g.dtype == np.dtype(dtype) for g in grads)
    want = reference(*(round_to(x, dtype) for x in (q, k, v)), seg, SCALE, round_to(dout, dtype))
    tol_fwd, tol_bwd = tolerances(dtype, dq, dv, max(max(x) for x in lens))
    assert_close(out, want[0], tol_fwd, f"{name} {dtype} out")
    for got, ref, what in zip(grads, want[1:], ("dq", "dk", "dv")):
        assert_close(got, ref, tol_bwd, f"{name} {dtype} {what}")


def flash(q, k, v, seg, positions=None, threads=None):
    """The CPU kernel in graph mode: (out, dq, dk, dv) for the loss sum(out * dout) with dout = ones."""
    import mindspore as ms
    from mindspore import Tensor, nn

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    hyper = fa.flash_attention_hyper(SCALE, threads)
    pos = Tensor(np.arange(q.shape[2], dtype=np.int32) if positions is None else positions)

    class Loss(nn.Cell):
        def construct(self, q, k, v, seg, pos, hyper):
            out = fa.flash_attention_cpu(q, k, v, seg, pos, hyper)
            return out.sum(), out

    args = [Tensor(x) for x in (q, k, v, seg)] + [pos, hyper]
    (_, out), grads = ms.value_and_grad(Loss(), grad_position=(0, 1, 2), has_aux=True)(*args)
    return [out.asnumpy()] + [g.asnumpy() for g in grads]


def test_query_rows_at_other_positions_see_the_keys_their_positions_see():
    """A context-parallel shard: the front and the back block of the rows (positions into the whole key sequence)
    give the whole sequence's rows at those positions, and the two shards' key gradients add up to the whole's."""
    lens = [[70, 150, 36], [256]]
    seg = segment_ids(lens)
    q, k, v, _ = inputs(np.random.default_rng(11), 2, 2, 256, 24, 16, "float32")
    ones = np.ones_like(v)
    whole = reference(q, k, v, seg, SCALE, ones)
    shards = [np.r_[0:64, 192:256], np.r_[64:192]]
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    tol_fwd, tol_bwd = tolerances("float32", 24, 16, 256)
    for rows in shards:
        out, dq, dk_part, dv_part = flash(q[:, :, rows], k, v, seg, rows.astype(np.int32))
        assert_close(out, whole[0][:, :, rows], tol_fwd, "shard out")
        assert_close(dq, whole[1][:, :, rows], tol_bwd, "shard dq")
        dk, dv = dk + dk_part, dv + dv_part
    assert_close(dk, whole[2], tol_bwd, "dk summed over shards")
    assert_close(dv, whole[3], tol_bwd, "dv summed over shards")


def test_threads_change_nothing():
    """Each task owns its output rows (forward: a query block; backward: a head): the same bits on 1 or 3 threads."""
    seg = segment_ids([[100, 200], [300]])
    q, k, v, _ = inputs(np.random.default_rng(5), 2, 3, 300, 48, 32, "float32")
    one, three = flash(q, k, v, seg, threads=1), flash(q, k, v, seg, threads=3)
    assert all(np.array_equal(a, b) for a, b in zip(one, three))


def test_a_position_outside_the_keys_stops_the_kernel():
    seg = segment_ids([[8]])
    q, k, v, _ = inputs(np.random.default_rng(2), 1, 1, 8, 16, 16, "float32")
    with pytest.raises(RuntimeError, match="function\\(FlashAttention\\) is 3"):
        flash(q, k, v, seg, np.arange(1, 9, dtype=np.int32))


# ---- the Ascend binding -------------------------------------------------------------------------------------------

def flash_attention_tnd(q, k, v, seq_len, scale):
    """What FlashAttentionScore(TND, sparse_mode=3) computes: causal attention inside each [end_{i-1}, end_i)."""
    out = np.zeros(q.shape[:2] + (v.shape[2],))
    start = 0
    for end in seq_len.tolist():
        qs, ks, vs = (x[start:end].transpose(1, 0, 2).astype(np.float64) for x in (q, k, v))
        scores = qs @ ks.swapaxes(-1, -2) * scale + np.triu(np.full((end - start,) * 2, -np.inf), 1)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[start:end] = ((p / p.sum(-1, keepdims=True)) @ vs).transpose(1, 0, 2)
        start = end
    return out


def test_flash_attention_score_takes_the_arguments_the_binding_passes():
    """The installed package's FlashAttentionScore: the keywords the binding passes, and its TND constraints."""
    import inspect
    from mindspore import ops

    params = inspect.signature(ops.flash_attention_score).parameters
    assert list(params)[:4] == ["query", "key", "value", "head_num"]
    for name in ("attn_mask", "actual_seq_qlen", "actual_seq_kvlen", "scalar_value", "pre_tokens", "next_tokens",
                 "input_layout", "sparse_mode"):
        assert name in params, name
    doc = ops.flash_attention_score.__doc__
    assert "0 should not exist in list_seq_k" in doc and "D-axis of `query`, `key` and `value` is not the same" in doc
    assert "batch is less than or equal to\n              1024" in doc and fa.MAX_DOCUMENTS == 1024


def documented_flash_attention(calls):
    """FlashAttentionScore's documented TND semantics (it runs on Ascend only), checking its documented limits."""
    from mindspore import Tensor

    def call(query, key, value, head_num, *, attn_mask, actual_seq_qlen, actual_seq_kvlen, scalar_value,
             pre_tokens, next_tokens, input_layout, sparse_mode):
        q, k, v = (x.asnumpy() for x in (query, key, value))
        ends = actual_seq_qlen.asnumpy()
        lengths = np.diff(np.concatenate([[0], ends]))
        assert (input_layout, sparse_mode, next_tokens) == ("TND", 3, 0)
        assert q.shape == k.shape == v.shape and q.shape[1] == head_num, "one head size for q, k and v"
        assert np.array_equal(ends, actual_seq_kvlen.asnumpy()) and ends[-1] == q.shape[0]
        assert lengths.min() > 0 and len(ends) <= fa.MAX_DOCUMENTS and pre_tokens >= lengths.max()
        assert attn_mask.shape == (2048, 2048) and np.array_equal(attn_mask.asnumpy(), fa._FA_CAUSAL_MASK)
        calls.append(len(ends))
        return Tensor(flash_attention_tnd(q, k, v, ends, scalar_value).astype(q.dtype))
    return call


@pytest.mark.parametrize("lens", [[[1, 130, 2, 167], [257, 43], [300]], [[300]] * 2])
def test_ascend_binding_hands_flash_attention_its_documented_arguments(lens, monkeypatch):
    """MLA's head sizes (q/k 48, v 32 here): the value heads padded, TND rows, one cumulative end per real document
    and no zero-length entry; with FlashAttentionScore's documented semantics it gives the CPU kernel's result."""
    import mindspore as ms
    from mindspore import Tensor, ops

    ms.set_context(mode=ms.PYNATIVE_MODE)
    calls = []
    monkeypatch.setattr(ops, "flash_attention_score", documented_flash_attention(calls))
    seg = segment_ids(lens)
    b, h, s, dq, dv = len(lens), 4, seg.shape[1], 48, 32
    q, k, v, _ = inputs(np.random.default_rng(3), b, h, s, dq, dv, "float32")
    got = fa.FlashAttentionAscend(SCALE)(Tensor(q), Tensor(k), Tensor(v), Tensor(seg)).asnumpy()
    assert calls == [sum(len(x) for x in lens)] and got.shape == (b, h, s, dv)
    assert_close(got, reference(q, k, v, seg, SCALE, v)[0], chain_tolerance("float32", (dq, s, s)), "TND emulation")


def test_flash_attention_arguments_build_in_graph_mode():
    """The TND arguments as a compiled graph builds them (the document count is a dynamic shape)."""
    import mindspore as ms
    from mindspore import Tensor

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    lens = [[1, 130, 2, 167], [257, 43], [300]]
    seg = segment_ids(lens)
    b, h, s = len(lens), 2, seg.shape[1]
    q, k, v, _ = inputs(np.random.default_rng(3), b, h, s, 16, 8, "float32")
    tq, tk, tv, seq_len = (x.asnumpy() for x in ms.jit(fa.flash_attention_arguments)(*map(Tensor, (q, k, v, seg))))
    assert tq.shape == tk.shape == tv.shape == (b * s, h, 16)
    assert np.array_equal(tq[s + 5], q[1, :, 5]) and np.array_equal(tv[2 * s - 1, :, :8], v[1, :, s - 1])
    assert not tv[..., 8:].any()
    # MindFormers' compressed EOD mask per sample, each shifted by the tokens before it (asl_batch_wrapper)
    want = np.concatenate([doc_lens_to_actual_seq_len(x, s, len(x)) + i * s for i, x in enumerate(lens)])
    assert seq_len.dtype == np.int64 and np.array_equal(seq_len, want)


def test_kernel_choice_follows_the_device():
    assert isinstance(fa.flash_attention_for("CPU", SCALE), fa.FlashAttentionCPU)
    assert isinstance(fa.flash_attention_for("Ascend", SCALE), fa.FlashAttentionAscend)


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


def mla_cells(seq_length=48):
    """A small MultiLatentAttention on the dense path and the same weights on the flash kernel."""
    from telechat_moe.config import ModelConfig
    from telechat_moe.mla import MultiLatentAttention

    cfg = ModelConfig(hidden_size=48, num_attention_heads=3, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=12, seq_length=seq_length, max_position_embeddings=seq_length,
                      initializer_range=0.3, attention_kernel="dense")
    dense = MultiLatentAttention(cfg)
    flash = MultiLatentAttention(dataclasses.replace(cfg, attention_kernel="flash"))
    for dst, src in zip(flash.get_parameters(), dense.get_parameters()):
        dst.set_data(src.value())
    return cfg, dense, flash


def test_mla_on_packed_documents_equals_each_document_alone():
    """Three documents packed in a sample give, on the dense and on the flash path, what each document gives run
    alone (at the same positions, so RoPE tables are identical and only the masking can differ)."""
    import mindspore as ms
    from mindspore import Tensor

    from data_sched.packing import doc_lens_to_segment_ids
    from telechat_moe.mla import attention_bias, rope_tables

    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg, dense, flash = mla_cells()
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
    assert_close(packed(flash, seg), want, tol, "flash, packed vs alone")
    assert_close(alone(flash, lambda one: one), want, tol, "flash alone vs dense alone")
    # One causal mask over the whole sample lets documents see each other: far off, so the test can tell.
    leaky = packed(dense, attention_bias(Tensor(np.zeros((b, s), np.int32)), causal))
    assert relative_error(leaky, want) > 100 * tol.rtol


def test_mla_flash_equals_dense_forward_and_every_gradient():
    """MLA (q/k heads 24, v heads 12) on packed documents longer than the kernel's blocks, in graph mode: the flash
    kernel gives the dense composition's output and the gradients of the input and of every weight."""
    import mindspore as ms
    from mindspore import Tensor, nn

    from data_sched.packing import doc_lens_to_segment_ids
    from telechat_moe.mla import attention_bias, rope_tables

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    docs = [[70, 1, 129], [200]]
    cfg, dense, flash = mla_cells(seq_length=200)
    s, b = cfg.seq_length, len(docs)
    cos, sin = (Tensor(np.broadcast_to(t[None, None], (b, 1) + t.shape).copy()) for t in rope_tables(cfg, s))
    seg = Tensor(np.stack([doc_lens_to_segment_ids(lens, s) for lens in docs]))
    bias = attention_bias(seg, Tensor(np.tril(np.ones((s, s), dtype=np.bool_))))
    rng = np.random.default_rng(8)
    x, dout = (Tensor(rng.standard_normal((b, s, cfg.hidden_size)).astype(np.float32)) for _ in range(2))

    class Loss(nn.Cell):
        def __init__(self, mla):
            super().__init__()
            self.mla = mla

        def construct(self, x, cos, sin, mask, dout):
            out = self.mla(x, cos, sin, mask)
            return (out * dout).sum(), out

    def run(cell, mask):
        loss = Loss(cell)
        step = ms.value_and_grad(loss, grad_position=0, weights=loss.trainable_params(), has_aux=True)
        (_, out), (dx, dweights) = step(x, cos, sin, mask, dout)
        grads = [out.asnumpy(), dx.asnumpy()] + [g.asnumpy() for g in dweights]
        return grads, [p.name for p in loss.trainable_params()]

    want, names = run(dense, bias)
    got, _ = run(flash, seg)
    # forward: the projections, scores over the head dim, softmax and p.v over the document, the output projection;
    # backward: the same chain back, and each weight's sum over the b * s tokens
    forward = (cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, s, s,
               cfg.num_attention_heads * cfg.v_head_dim)
    assert_close(got[0], want[0], chain_tolerance("float32", forward), "out")
    for g, w, name in zip(got[1:], want[1:], ["x"] + names):
        assert_close(g, w, chain_tolerance("float32", forward + forward + (b * s,)), f"d {name}")


def documented_bnsd_flash_attention(calls):
    """FlashAttentionScore's documented BNSD semantics with an explicit mask (sparse_mode 0: 1 = discard), checking
    the documented shapes: one head size for q, k and v, attn_mask [B, 1, S1, S2]."""
    from mindspore import Tensor

    def call(query, key, value, head_num, *, attn_mask, scalar_value, input_layout, sparse_mode):
        q, k, v, mask = (x.asnumpy() for x in (query, key, value, attn_mask))
        assert (input_layout, sparse_mode) == ("BNSD", 0) and q.shape[1] == head_num
        assert q.shape[3] == k.shape[3] == v.shape[3] and k.shape == v.shape, "one head size for q, k and v"
        assert mask.dtype == np.uint8 and mask.shape == (q.shape[0], 1, q.shape[2], k.shape[2])
        scores = q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2) * scalar_value
        scores = np.where(mask.astype(bool), -np.inf, scores)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        calls.append(q.shape[2])
        return Tensor(((p / p.sum(-1, keepdims=True)) @ v).astype(q.dtype))
    return call


def test_ascend_binding_of_a_context_parallel_shard(monkeypatch):
    """The load-balanced shards of cp=2 (a front and a back block each, or one run where they meet), MLA's unequal head sizes: each block's
    queries against the keys up to its end with a per-document causal mask; with FlashAttentionScore's documented
    BNSD semantics every shard's rows are the whole sequence's rows at its positions."""
    import mindspore as ms
    from mindspore import Tensor, ops
    from parallel.cp import shard_positions

    ms.set_context(mode=ms.PYNATIVE_MODE)
    calls = []
    monkeypatch.setattr(ops, "flash_attention_score", documented_bnsd_flash_attention(calls))
    lens = [[70, 150, 36], [256]]
    seg = segment_ids(lens)
    b, h, s, dq, dv = 2, 2, 256, 48, 32
    q, k, v, _ = inputs(np.random.default_rng(5), b, h, s, dq, dv, "float32")
    whole = reference(q, k, v, seg, SCALE, v)[0]
    for rank in range(2):
        rows = shard_positions(s, 2, rank)
        # rank 0: blocks 0 and 3; rank 1: blocks 1 and 2, adjacent, one run of 128 rows
        assert fa.position_blocks(rows) == (((0, 0, 64), (64, 192, 64)), ((0, 64, 128),))[rank]
        got = fa.FlashAttentionAscend(SCALE, rows)(Tensor(q[:, :, rows]), Tensor(k), Tensor(v), Tensor(seg)).asnumpy()
        assert got.shape == (b, h, len(rows), dv)
        assert_close(got, whole[:, :, rows], chain_tolerance("float32", (dq, s, s)), f"shard {rank}")
    assert calls == [64, 64, 128]
