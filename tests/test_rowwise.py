"""The row-wise CPU kernels (dvm_fusion/rowwise.py) against the plain MindSpore compositions they replace, forward
and backward, within precision/'s tolerances; and a token id out of range stops the combine kernel."""
from __future__ import annotations

import numpy as np
import pytest

from precision.tolerance import assert_close, tolerance


def _graph_mode():
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE)


def _output_and_grads(fn, args, weight_of_output, grad_position):
    """fn(*args) and the gradient of sum(fn(*args) * weight_of_output) by the inputs at `grad_position`."""
    import mindspore as ms
    from mindspore import nn

    class Weighted(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fn = fn

        def construct(self, *inputs):
            return (self.fn(*inputs) * weight_of_output).sum()

    out = ms.jit(fn)(*args).asnumpy()
    grads = ms.grad(Weighted(), grad_position=grad_position)(*args)
    return [out] + [g.asnumpy() for g in (grads if isinstance(grads, tuple) else (grads,))]


def test_swiglu_packed_matches_slices_silu_and_product_forward_and_backward():
    import mindspore as ms
    from mindspore import Tensor
    from dvm_fusion.rowwise import swiglu_packed_cpu, swiglu_packed_for, swiglu_packed_reference
    _graph_mode()
    rng = np.random.default_rng(0)
    gate_up = Tensor(rng.standard_normal((37, 2 * 24)).astype(np.float32) * 3)
    dact = Tensor(rng.standard_normal((37, 24)).astype(np.float32))
    results = {name: _output_and_grads(fn, (gate_up,), dact, 0)
               for name, fn in (("kernel", swiglu_packed_cpu), ("composition", swiglu_packed_reference))}
    tol = tolerance("float32", 4)
    assert_close(results["kernel"][0], results["composition"][0].astype(np.float64), tol, "forward")
    assert_close(results["kernel"][1], results["composition"][1].astype(np.float64), tol, "backward")
    assert swiglu_packed_for("CPU") is swiglu_packed_cpu and swiglu_packed_for("Ascend") is swiglu_packed_reference
    half = ms.jit(swiglu_packed_cpu)(gate_up.astype(ms.float16))
    assert half.dtype == ms.float16 and half.shape == (37, 24)


def test_swiglu_of_two_tensors_matches_silu_and_product_forward_and_backward():
    import mindspore as ms
    from mindspore import Tensor
    from dvm_fusion.rowwise import swiglu_cpu, swiglu_for, swiglu_reference
    _graph_mode()
    rng = np.random.default_rng(2)
    gate, up = (Tensor(rng.standard_normal((2, 9, 20)).astype(np.float32) * 4) for _ in range(2))
    dact = Tensor(rng.standard_normal((2, 9, 20)).astype(np.float32))
    results = {name: _output_and_grads(fn, (gate, up), dact, (0, 1))
               for name, fn in (("kernel", swiglu_cpu), ("composition", swiglu_reference))}
    for i, what in enumerate(("forward", "d gate", "d up")):
        assert_close(results["kernel"][i], results["composition"][i].astype(np.float64), tolerance("float32", 4),
                     what)
    assert swiglu_for("CPU") is swiglu_cpu and swiglu_for("Ascend") is swiglu_reference


def test_rms_norm_matches_its_composition_forward_and_backward():
    from mindspore import Tensor, ops
    from dvm_fusion.rowwise import RmsNormCPU
    _graph_mode()
    rng = np.random.default_rng(3)
    eps = 1e-5
    x = Tensor(rng.standard_normal((13, 40)).astype(np.float32) * 3)
    w = Tensor((1 + 0.1 * rng.standard_normal(40)).astype(np.float32))
    dy = Tensor(rng.standard_normal((13, 40)).astype(np.float32))

    def composition(x, w):
        return w * (x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + eps))

    results = {name: _output_and_grads(fn, (x, w), dy, (0, 1))
               for name, fn in (("kernel", RmsNormCPU(eps)), ("composition", composition))}
    for i, what in enumerate(("forward", "dx", "d weight")):
        assert_close(results["kernel"][i], results["composition"][i].astype(np.float64),
                     tolerance("float32", 40 if i < 2 else 13), what)


def test_bias_softmax_matches_scale_mask_and_softmax_forward_and_backward():
    from mindspore import Tensor, ops
    from dvm_fusion.rowwise import BiasSoftmaxCPU
    _graph_mode()
    rng = np.random.default_rng(4)
    b, heads, s, scale = 2, 3, 12, 0.37
    scores = Tensor(rng.standard_normal((b, heads, s, s)).astype(np.float32) * 4)
    visible = np.tril(np.ones((s, s), bool)) & (rng.random((b, 1, s, s)) > 0.3) | np.eye(s, dtype=bool)
    bias = Tensor(np.where(visible, 0.0, -1e9).astype(np.float32))       # the model's document mask
    dprobs = Tensor(rng.standard_normal((b, heads, s, s)).astype(np.float32))

    def composition(scores, bias):
        return ops.softmax(scores * scale + bias, -1)

    results = {name: _output_and_grads(fn, (scores, bias), dprobs, 0)
               for name, fn in (("kernel", BiasSoftmaxCPU(scale)), ("composition", composition))}
    for i, what in enumerate(("forward", "d scores")):
        assert_close(results["kernel"][i], results["composition"][i].astype(np.float64), tolerance("float32", s),
                     what)
    assert np.all(results["kernel"][0][np.broadcast_to(~visible, (b, heads, s, s))] < 1e-30), "masked: zero"


def test_cross_entropy_matches_log_softmax_and_gather_forward_and_backward():
    import mindspore as ms
    from mindspore import Tensor, ops
    from dvm_fusion.rowwise import CrossEntropyCPU
    _graph_mode()
    rng = np.random.default_rng(5)
    n, v = 10, 300
    logits = Tensor(rng.standard_normal((n, v)).astype(np.float32) * 5)
    mask_np = np.ones(n, np.float32)
    mask_np[[2, 7]] = 0.0
    labels_np = rng.integers(0, v, n).astype(np.int32)
    labels_np[7] = -100                                      # a masked-out row's label is never read
    labels, mask = Tensor(labels_np), Tensor(mask_np)
    dnll = Tensor(rng.standard_normal(n).astype(np.float32))

    def composition(logits, labels, mask):
        picked = ops.gather_elements(ops.log_softmax(logits, -1), 1, ops.maximum(labels, 0).reshape(-1, 1))
        return -picked.squeeze(-1) * mask

    results = {name: _output_and_grads(fn, (logits, labels, mask), dnll, 0)
               for name, fn in (("kernel", CrossEntropyCPU()), ("composition", composition))}
    for i, what in enumerate(("forward", "d logits")):
        assert_close(results["kernel"][i], results["composition"][i].astype(np.float64), tolerance("float32", v),
                     what)
    with pytest.raises(RuntimeError, match="function\\(CrossEntropy\\) is 3"):
        labels_np[7] = -100
        mask_np[7] = 1.0
        ms.jit(CrossEntropyCPU())(logits, Tensor(labels_np), Tensor(mask_np)).asnumpy()


def test_weighted_combine_matches_scaled_segment_sum_forward_and_backward():
    import mindspore as ms
    from mindspore import Tensor
    from dvm_fusion.rowwise import WeightedCombineCPU
    from parallel.ep.permute import segment_sum
    _graph_mode()
    rng = np.random.default_rng(1)
    t, k, h = 11, 3, 16
    token = Tensor(rng.permutation(np.repeat(np.arange(t), k)).astype(np.int32))   # dispatch order: shuffled
    y = Tensor(rng.standard_normal((t * k, h)).astype(np.float32))
    weight = rng.random(t * k).astype(np.float32)
    weight[:4] = 0.0                                                                # dropped copies weigh 0
    weight = Tensor(weight)
    dout = Tensor(rng.standard_normal((t, h)).astype(np.float32))

    def composition(y, w, tok):
        return segment_sum(y * w.reshape(-1, 1), tok, t)

    results = {name: _output_and_grads(fn, (y, weight, token), dout, (0, 1))
               for name, fn in (("kernel", WeightedCombineCPU(k)), ("composition", composition))}
    for i, what in enumerate(("forward", "d expert outputs", "d weights")):
        assert_close(results["kernel"][i], results["composition"][i].astype(np.float64), tolerance("float32", h),
                     what)


def test_a_token_id_out_of_range_stops_the_combine_kernel():
    import mindspore as ms
    from mindspore import Tensor
    from dvm_fusion.rowwise import WeightedCombineCPU
    _graph_mode()
    y, w = Tensor(np.ones((4, 3), np.float32)), Tensor(np.ones(4, np.float32))
    with pytest.raises(RuntimeError, match="function\\(WeightedCombine\\) is 3"):
        ms.jit(WeightedCombineCPU(2))(y, w, Tensor(np.array([0, 1, 2, 1], np.int32))).asnumpy()


@pytest.mark.parametrize("tables", [2, 1])
def test_rope_matches_the_models_rotate_half_composition_forward_and_backward(tables):
    import mindspore as ms
    from mindspore import Tensor
    from dvm_fusion.rowwise import rope_cpu
    from telechat_moe.mla import apply_rope, rope_tables
    from telechat_moe.config import ModelConfig
    _graph_mode()
    rng = np.random.default_rng(6)
    b, heads, s, d = 2, 3, 11, 16
    cos, sin = rope_tables(ModelConfig(qk_rope_head_dim=d), s)
    positions = rng.integers(0, s, (tables, s))             # per-document positions, as the model gathers them
    cos, sin = (Tensor(t[positions][:, None]) for t in (cos, sin))
    x = Tensor(rng.standard_normal((b, heads, s, d)).astype(np.float32))
    dy = Tensor(rng.standard_normal((b, heads, s, d)).astype(np.float32))
    results = {name: _output_and_grads(fn, (x, cos, sin), dy, 0)
               for name, fn in (("kernel", rope_cpu), ("composition", apply_rope))}
    for i, what in enumerate(("forward", "dx")):
        assert_close(results["kernel"][i], results["composition"][i].astype(np.float64), tolerance("float32", 2),
                     what)
    with pytest.raises(RuntimeError, match="function\\(Rope\\) is 2"):
        ms.jit(rope_cpu)(Tensor(np.ones((2, 3, 11, 15), np.float32)), cos[..., :15], sin[..., :15]).asnumpy()
