"""Token drop to an expert's capacity (parallel/ep/permute.drop_over_capacity, sized by parallel/ep/capacity.py) in
graph mode against a NumPy reference of Megatron's two policies, and an MoE layer whose capacity drops nothing
equal to the dropless layer. (Across real EP ranks: tests/test_expert_parallel.py's capacity cases.)"""
from __future__ import annotations

import numpy as np
import mindspore as ms
import pytest
from mindspore import Tensor, nn, ops

from dvm_fusion.grouped_matmul import grouped_matmul_cpu
from parallel.ep.capacity import expert_capacity, routed_copies, sent_rows
from parallel.ep.permute import drop_over_capacity, segment_sum
from telechat_moe.config import ModelConfig
from telechat_moe.moe.layer import MoELayer


class Drop(nn.Cell):
    def __init__(self, experts, capacity, policy):
        super().__init__()
        self.experts, self.capacity, self.policy = experts, capacity, policy

    def construct(self, indices, weights):
        return drop_over_capacity(indices, weights, self.experts, self.capacity, self.policy)


class SegmentSquares(nn.Cell):
    """sum(segment_sum(x * 2)^2): a loss through the combine's segment sum, ours or MindSpore's."""

    def __init__(self, ours: bool, segments: int):
        super().__init__()
        self.ours, self.segments = ours, segments

    def construct(self, x, ids):
        y = x * 2.0
        out = segment_sum(y, ids, self.segments) if self.ours else ops.unsorted_segment_sum(y, ids, self.segments)
        return (out * out).sum()


def test_segment_sum_equals_mindspores_and_its_gradient_is_the_gather():
    """The dispatchers' segment sum (ids in range, a plain gather for its gradient): value and input gradient
    equal MindSpore's unsorted_segment_sum, whose gradient also masks ids out of range; rows no id names are 0."""
    rng = np.random.default_rng(3)
    x = Tensor(rng.normal(size=(24, 5)).astype(np.float32))
    ids = Tensor(rng.integers(0, 6, 24).astype(np.int32))        # segment 6 of 7 gets nothing
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        values, grads = [], []
        for ours in (True, False):
            net = SegmentSquares(ours, 7)
            values.append(float(net(x, ids).asnumpy()))
            grads.append(ms.grad(net)(x, ids).asnumpy())
    finally:
        ms.set_context(mode=mode)
    assert values[0] == values[1] and np.array_equal(grads[0], grads[1])
    expected = 8.0 * np.stack([x.asnumpy()[ids.asnumpy() == s].sum(0) for s in range(7)])[ids.asnumpy()]
    assert np.allclose(grads[0], expected, rtol=1e-6, atol=1e-6)


def reference_keep(indices, weights, experts, capacity, policy):
    """Per expert, its copies in token order (position) or by falling weight (probs); the first `capacity` kept."""
    flat, w = indices.reshape(-1), weights.reshape(-1)
    keep = np.zeros(flat.size, bool)
    for e in range(experts):
        copies = np.flatnonzero(flat == e)
        if policy == "probs":
            copies = copies[np.argsort(-w[copies], kind="stable")]
        keep[copies[:capacity]] = True
    return keep.reshape(indices.shape)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_drop_keeps_each_experts_first_copies_by_policy(policy):
    rng = np.random.default_rng(3)
    tokens, k, experts = 96, 4, 16
    skew = np.r_[8.0, 4.0, 2.0, np.ones(experts - 3)]
    indices = np.stack([rng.choice(experts, k, replace=False, p=skew / skew.sum())
                        for _ in range(tokens)]).astype(np.int32)
    weights = rng.random((tokens, k)).astype(np.float32)
    capacity = int(expert_capacity(tokens, k, experts, 1.0))
    assert capacity == 24
    dropped_i, dropped_w = (t.asnumpy() for t in Drop(experts, capacity, policy)(Tensor(indices), Tensor(weights)))
    keep = reference_keep(indices, weights, experts, capacity, policy)
    assert (~keep).sum() > 0                                     # the skew overflows expert 0's capacity
    np.testing.assert_array_equal(dropped_i, np.where(keep, indices, -1))
    np.testing.assert_array_equal(dropped_w, np.where(keep, weights, 0.0))
    assert np.bincount(dropped_i[dropped_i >= 0], minlength=experts).max() == capacity


def test_exchange_rows_dropless_and_with_capacity():
    # dropless: every copy, plus one pad row per member of the group
    assert routed_copies(64, 8, 512) == 512 and sent_rows(routed_copies(64, 8, 512), 128) == 640
    # capacity 1.25 of 64 tokens top-8 over 512 experts: ceil(1.25) = 2 copies an expert, so all 512 copies fit;
    # over 16 experts: ceil(40) = 40 an expert, 640 >= 512 fit; capacity 0.5 over 16: 16 an expert, 256 of 512
    assert expert_capacity(64, 8, 512, 1.25) == 2 and routed_copies(64, 8, 512, 1.25) == 512
    assert routed_copies(64, 8, 16, 1.25) == 512 and routed_copies(64, 8, 16, 0.5) == 256
    np.testing.assert_array_equal(routed_copies(np.array([64, 64]), 8, 16, 0.5), [256, 256])


def test_layer_with_a_capacity_that_drops_nothing_equals_the_dropless_layer():
    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = ModelConfig(hidden_size=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                      moe_shared_expert_intermediate_size=16, seq_length=8, moe_aux_loss_coeff=0.0)
    x = Tensor(np.random.default_rng(0).normal(size=(2, 8, 32)).astype(np.float32))
    outputs = []
    for factor in (None, 8.0):          # 8.0: an expert takes every token, so nothing drops
        ms.set_seed(5)
        layer = MoELayer(ModelConfig(**{**cfg.__dict__, "moe_expert_capacity_factor": factor}), grouped_matmul_cpu)
        outputs.append(layer(x)[0].asnumpy())
    np.testing.assert_array_equal(outputs[0], outputs[1])


def test_routing_statistics_count_what_was_sent_after_the_drop():
    """The statistics the step log reads (MoELayer's stats: expert load, dispatch traffic, rows the exchange sent)
    count the copies left after the capacity drop, not the router's demand. One process stands in for rank 0 of an
    EP group of 4 (SelfTransport: every exchange the identity), so the rows counted are this rank's own sends."""
    from parallel.comm.groups import Group
    from parallel.comm.transport import SelfTransport
    from telechat_moe.moe.dispatch import ExpertParallel
    from telechat_moe.moe.layer import ROUTING_STATS
    ms.set_context(mode=ms.GRAPH_MODE)
    experts, k, g, tokens = 8, 2, 4, 32
    cfg = ModelConfig(hidden_size=32, n_routed_experts=experts, num_experts_per_tok=k, moe_intermediate_size=16,
                      moe_shared_expert_intermediate_size=16, seq_length=tokens, moe_aux_loss_coeff=0.0,
                      moe_expert_capacity_factor=0.5)
    ep = ExpertParallel(g, 0, "alltoall", g, SelfTransport(Group("ep_stand_in", tuple(range(g)), 0)))
    ms.set_seed(5)
    layer = MoELayer(cfg, grouped_matmul_cpu, ep=ep)
    x = Tensor(np.random.default_rng(0).normal(size=(1, tokens, 32)).astype(np.float32))
    stats = layer(x)[3].asnumpy()
    indices, weights = (t.asnumpy() for t in layer.gate(x.reshape(tokens, 32), 1)[:2])   # the demand
    keep = reference_keep(indices, weights, experts, int(expert_capacity(tokens, k, experts, 0.5)), "probs")
    sent = indices[keep]
    assert len(stats) == experts + ROUTING_STATS and 0 < sent.size < indices.size     # copies were dropped
    np.testing.assert_array_equal(stats[:experts], np.bincount(sent, minlength=experts))   # load: what was sent
    flat_inter, flat_intra = stats[experts:experts + 2]           # one node of 4 ranks; rank 0 holds experts 0, 1
    assert flat_inter == 0 and flat_intra == (sent >= experts // g).sum()
    assert stats[-1] == sent.size + g                             # rows: the kept copies and one pad per member
