"""The model's own operators (telechat_moe) registered in the operator checker in place of the defaults:
they pass for fp32 and fp16, and the checker finds where the model's optimizer is not torch's AdamW.

The wrappers adapt each Cell or function to the checker's plain tensor-in, tensor-out form (PyNative: they build
a Cell per call). The attention core is the model's dense_causal_attention, fed as MultiLatentAttention feeds it.
"""
import dataclasses

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops

from precision import op_check
from precision import reference_ops as ref
from precision.tolerance import tolerance
from telechat_moe.config import ModelConfig
from telechat_moe.layers import RMSNorm, SwiGLU
from telechat_moe.mla import apply_rope, attention_bias, dense_causal_attention, rope_tables
from telechat_moe.optim import build_adamw
from telechat_moe.model import TeleChatMoE
from parallel.ep.permute import stable_order
from telechat_moe.moe.dispatch import LocalDispatcher
from telechat_moe.moe.router import TopKRouter

ms.set_context(mode=ms.PYNATIVE_MODE)
EPS = 1e-6


def model_rms_norm(x, weight):
    cell = RMSNorm(x.shape[-1], EPS)
    cell.weight.set_data(weight)
    return cell(x)


def model_rope(x, cos, sin):
    """The model rotates [b, heads, s, d] in float32 with tables [b, 1, s, d] (MultiLatentAttention)."""
    rotated = apply_rope(x.astype(ms.float32).transpose(0, 2, 1, 3), cos.reshape((1, 1) + cos.shape),
                         sin.reshape((1, 1) + sin.shape))
    return rotated.transpose(0, 2, 1, 3).astype(x.dtype)


def model_router(x, weight, bias):
    cfg = ModelConfig(hidden_size=x.shape[1], n_routed_experts=weight.shape[0],
                      num_experts_per_tok=op_check.ROUTER_TOP_K, routed_scaling_factor=op_check.ROUTED_SCALING)
    router = TopKRouter(cfg)
    router.weight.set_data(weight)
    router.expert_bias.set_data(bias)
    indices, weights, _, _, _ = router(x, 1)
    onehot = ops.one_hot(indices, cfg.n_routed_experts, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
    return (onehot * weights.expand_dims(-1)).sum(1)


def model_dispatch_combine(x, indices, weights, expert_scale):
    dispatcher = LocalDispatcher(expert_scale.shape[0], indices.shape[1])
    tokens, _, state = dispatcher.dispatch(x, indices, weights)
    expert_of_row = ops.gather(indices.reshape(-1), stable_order(indices.reshape(-1)), 0)
    return dispatcher.combine(tokens * ops.gather(expert_scale, expert_of_row, 0), state).astype(x.dtype)


def model_swiglu(x, w_gate, w_up, w_down):
    cell = SwiGLU(w_gate.shape[0], w_gate.shape[1], 0.02, x.dtype)
    for linear, w in ((cell.gate_proj, w_gate), (cell.up_proj, w_up), (cell.down_proj, w_down)):
        linear.weight.set_data(w.T.astype(ms.float32))  # Linear stores [out, in]
    return cell(x)


def model_cross_entropy(logits, labels):
    return TeleChatMoE.cross_entropy(logits.astype(ms.float32), labels, ops.ones(labels.shape, ms.float32))


def project_adamw(param, grad, exp_avg, exp_avg_sq):
    """The project's optimizer (telechat_moe.optim.build_adamw), one step from given moments at the checker's step.
    The parameter is viewed as [1, n] so that it lands in the weight-decayed group, as matrices do."""
    c = op_check.ADAMW_CONFIG

    def row(t):
        return Tensor(t.astype(ms.float32).asnumpy().reshape(1, -1))

    p = Parameter(row(param), name="p")
    optimizer = build_adamw([p], c["lr"], (c["beta1"], c["beta2"]), c["eps"], c["weight_decay"])
    optimizer.exp_avg[0].set_data(row(exp_avg))
    optimizer.exp_avg_sq[0].set_data(row(exp_avg_sq))
    optimizer.global_step.set_data(Tensor([c["step"] - 1], ms.int32))  # the optimizer counts this step first
    optimizer((row(grad),), Tensor(1.0, ms.float32), Tensor(True))
    return (p.value().reshape(-1), optimizer.exp_avg[0].value().reshape(-1),
            optimizer.exp_avg_sq[0].value().reshape(-1))


def model_mla_attention(q_nope, q_pe, k_nope, k_pe, v):
    """The checker's (b, s, h, d) inputs arranged as MultiLatentAttention arranges them for its attention core."""
    b, s, heads, _ = q_nope.shape
    cfg = ModelConfig(qk_nope_head_dim=q_nope.shape[-1], qk_rope_head_dim=q_pe.shape[-1],
                      rotary_scaling_factor=op_check.ROPE_CONFIG["factor"],
                      mscale_all_dim=op_check.ROPE_CONFIG["mscale_all_dim"])
    query = ops.cat((q_nope, q_pe), -1).transpose(0, 2, 1, 3)
    k_rot = ops.broadcast_to(k_pe.reshape(b, 1, s, -1), (b, heads, s, k_pe.shape[-1]))
    key = ops.cat((k_nope.transpose(0, 2, 1, 3), k_rot), -1)
    causal = Tensor(np.tril(np.ones((s, s), np.bool_)))
    bias = attention_bias(ops.zeros((b, s), ms.int32), causal)
    out = dense_causal_attention(query, key, v.transpose(0, 2, 1, 3), bias, cfg.softmax_scale(), ms.float32,
                                 q_nope.dtype)
    return out.transpose(0, 2, 1, 3)


def rms_norm_reference(x, weight):
    return ref.rms_norm(x, weight, EPS)


MODEL_OPS = {
    "rmsnorm": {"mindspore_fn": model_rms_norm, "reference_fn": rms_norm_reference},
    "rope_yarn": {"mindspore_fn": model_rope},
    "router": {"mindspore_fn": model_router},
    "dispatch_combine": {"mindspore_fn": model_dispatch_combine},
    "swiglu_ffn": {"mindspore_fn": model_swiglu},
    "cross_entropy": {"mindspore_fn": model_cross_entropy},
    "adamw": {"mindspore_fn": project_adamw},
    "mla_attention": {"mindspore_fn": model_mla_attention},
}


@pytest.fixture
def model_registry(monkeypatch):
    for name, fields in MODEL_OPS.items():
        monkeypatch.setitem(op_check.REGISTRY, name, dataclasses.replace(op_check.REGISTRY[name], **fields))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_model_operators_pass(model_registry, dtype):
    results = op_check.check_all(list(MODEL_OPS), [dtype])
    bad = [op_check.format_row(r) for r in results if r.status != "pass"]
    assert not bad, "\n".join(bad)


def test_project_optimizer_is_torch_adamw(model_registry):
    """The project's AdamW has the bias correction: the reference without it fails it by far."""
    uncorrected = dataclasses.replace(op_check.REGISTRY["adamw"], reference_fn=lambda p, g, m, v: ref.adamw(
        p, g, m, v, **op_check.ADAMW_CONFIG, bias_correction=False))
    results = op_check.check_case(uncorrected, "float32")
    assert all(r.status == "FAIL" and r.max_rel_error > 100 * r.rtol for r in results)


def test_model_yarn_tables_match_the_reference():
    cfg = ModelConfig(qk_rope_head_dim=64, rotary_scaling_factor=40.0, original_max_position_embeddings=4096,
                      max_position_embeddings=8192, mscale=1.0, mscale_all_dim=0.8)
    cos, sin = rope_tables(cfg, 8192)
    inv_freq = ref.yarn_inv_freq(64, cfg.rope_theta, 40.0, 4096, cfg.beta_fast, cfg.beta_slow)
    mscale = ref.yarn_mscale(40.0, 1.0) / ref.yarn_mscale(40.0, 0.8)
    ref_cos, ref_sin = ref.rope_tables(np.arange(8192), inv_freq, mscale)
    # tables built in float64 and rounded once: one float32 rounding (see TOLERANCES.md on float32 angles)
    np.testing.assert_allclose(cos, ref_cos, rtol=0, atol=tolerance("float32").rtol)
    np.testing.assert_allclose(sin, ref_sin, rtol=0, atol=tolerance("float32").rtol)


def test_split_last_gives_the_slices_and_their_gradient_exactly():
    from telechat_moe.mla import split_last
    rng = np.random.default_rng(3)
    x = Tensor(rng.standard_normal((2, 3, 5, 48)).astype(np.float32))
    w1, w2 = (Tensor(rng.standard_normal((2, 3, 5, n)).astype(np.float32)) for n in (32, 16))

    def through_split(x):
        first, second = split_last(x, 32)
        return (first * w1).sum() + (second * second * w2).sum()

    def through_slices(x):
        return (x[..., :32] * w1).sum() + (x[..., 32:] * x[..., 32:] * w2).sum()

    first, second = split_last(x, 32)
    assert np.array_equal(first.asnumpy(), x.asnumpy()[..., :32])
    assert np.array_equal(second.asnumpy(), x.asnumpy()[..., 32:])
    for mode in (ms.PYNATIVE_MODE, ms.GRAPH_MODE):
        ms.set_context(mode=mode)
        try:
            assert np.array_equal(ms.grad(through_split)(x).asnumpy(), ms.grad(through_slices)(x).asnumpy())
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
