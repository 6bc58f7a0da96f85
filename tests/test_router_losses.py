"""The router's losses and its expert bias against float64 references (precision.reference_ops): the sequence-level
auxiliary loss per sequence of a batch (sigmoid and softmax scores), the z-loss, and the bias that picks experts
without weighting them. PyNative: one router call per case, nothing to compile."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from precision import reference_ops as ref
from precision.tolerance import assert_close, chain_tolerance, relative_error
from telechat_moe.config import ModelConfig
from telechat_moe.moe.router import TopKRouter

HIDDEN, EXPERTS, TOP_K, BATCH, SEQ = 32, 16, 4, 3, 40


def make_router(rng, **overrides):
    """A router with unit-scale weights, so that scores are spread and the top-k has no near-ties."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = ModelConfig(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, **overrides)
    router = TopKRouter(cfg)
    weight = (rng.standard_normal((EXPERTS, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
    router.weight.set_data(Tensor(weight))
    return router, weight.astype(np.float64)


def batch_tokens(rng):
    """BATCH sequences whose tokens lean towards different experts (a per-sequence offset), so that averaging the
    loss per sequence differs from computing it over the whole batch."""
    offsets = 2.0 * rng.standard_normal((BATCH, 1, HIDDEN))
    x = (rng.standard_normal((BATCH, SEQ, HIDDEN)) + offsets).reshape(BATCH * SEQ, HIDDEN).astype(np.float32)
    return x, x.astype(np.float64)


def float64_choice(scores, bias):
    """Each token's chosen experts as sets: the order inside the top-k does not matter to any loss."""
    return np.sort(ref.choose_experts(scores, bias, TOP_K), axis=-1)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_sequence_aux_loss_matches_the_per_sequence_reference(scoring):
    rng = np.random.default_rng(11 if scoring == "sigmoid" else 12)
    alpha = 0.3
    router, w = make_router(rng, scoring_func=scoring, moe_aux_loss_coeff=alpha)
    bias = (0.05 * rng.standard_normal(EXPERTS)).astype(np.float32)
    router.expert_bias.set_data(Tensor(bias))
    x, x64 = batch_tokens(rng)

    indices, _, aux, _, load = router(Tensor(x), BATCH)
    logits = x64 @ w.T
    scores = ref.sigmoid(logits) if scoring == "sigmoid" else ref.softmax(logits)
    # f counts the experts the tokens were routed to, bias included (as MindFormers' and Megatron's routers do).
    chosen = float64_choice(scores, bias.astype(np.float64))
    assert np.array_equal(np.sort(indices.asnumpy(), -1), chosen)
    assert np.array_equal(load.asnumpy(), np.bincount(chosen.ravel(), minlength=EXPERTS))

    want = ref.sequence_aux_loss(scores, chosen, BATCH, alpha)
    # logits over HIDDEN, normalisation over the experts, mean over the sequence, sum over experts, mean over batch
    tol = chain_tolerance("float32", (HIDDEN, EXPERTS, EXPERTS, SEQ, EXPERTS, BATCH))
    assert_close(float(aux.asnumpy()), want, tol, f"{scoring} sequence aux loss")
    # The same tokens taken as one sequence give another loss: the test sees whether the loss is per sequence.
    whole_batch = ref.sequence_aux_loss(scores, chosen, 1, alpha)
    assert relative_error(whole_batch, want) > 100 * tol.rtol


def test_uniform_scores_give_exactly_alpha():
    """The normalisation: with P_i = 1/E, sum_i f_i P_i = 1 whichever experts are chosen (f sums to E)."""
    rng = np.random.default_rng(3)
    router, _ = make_router(rng, moe_aux_loss_coeff=0.25)
    router.weight.set_data(Tensor(np.zeros((EXPERTS, HIDDEN), np.float32)))
    _, _, aux, _, _ = router(Tensor(rng.standard_normal((BATCH * SEQ, HIDDEN)).astype(np.float32)), BATCH)
    assert_close(float(aux.asnumpy()), 0.25, chain_tolerance("float32", (EXPERTS, SEQ, EXPERTS, BATCH)), "aux")


def test_z_loss_matches_the_reference_and_is_off_by_default():
    rng = np.random.default_rng(5)
    coeff = 0.01
    router, w = make_router(rng, moe_z_loss_coeff=coeff)
    x, x64 = batch_tokens(rng)
    _, _, _, z, _ = router(Tensor(x), BATCH)
    # logits over HIDDEN, logsumexp over the experts, the square, the mean over all tokens
    tol = chain_tolerance("float32", (HIDDEN, EXPERTS, 1, BATCH * SEQ))
    assert_close(float(z.asnumpy()), ref.router_z_loss(x64 @ w.T, coeff), tol, "z loss")

    off, _ = make_router(rng)
    assert float(off(Tensor(x), BATCH)[3].asnumpy()) == 0.0


def test_expert_bias_picks_experts_but_never_weights_them():
    rng = np.random.default_rng(7)
    scaling = 2.5
    router, w = make_router(rng, routed_scaling_factor=scaling)
    forced = 5
    bias = np.zeros(EXPERTS, np.float32)
    bias[forced] = 10.0  # far above any sigmoid score: every token picks this expert
    router.expert_bias.set_data(Tensor(bias))
    x, x64 = batch_tokens(rng)

    indices, weights, _, _, _ = router(Tensor(x), BATCH)
    indices, weights = indices.asnumpy(), weights.asnumpy()
    assert np.all((indices == forced).sum(-1) == 1)
    want_idx, want_w = ref.router_topk(x64, w, bias.astype(np.float64), TOP_K, scaling)
    order, want_order = np.argsort(indices, -1), np.argsort(want_idx, -1)
    assert np.array_equal(np.take_along_axis(indices, order, -1), np.take_along_axis(want_idx, want_order, -1))
    # logits over HIDDEN, the sigmoid, the normalisation over the top-k, the routed scaling
    tol = chain_tolerance("float32", (HIDDEN, 1, TOP_K, 1))
    assert_close(np.take_along_axis(weights, order, -1), np.take_along_axis(want_w, want_order, -1), tol,
                 "combine weights")
    # Weights normalised from the biased scores would be far off: the comparison above can tell the two apart.
    scores = ref.sigmoid(x64 @ w.T)
    biased = np.take_along_axis(scores + bias, want_idx, -1)
    biased = biased / biased.sum(-1, keepdims=True) * scaling
    assert relative_error(np.take_along_axis(biased, want_order, -1), np.take_along_axis(want_w, want_order, -1)) \
        > 100 * tol.rtol
    # The bias is moved by the balancing rule only: the optimizer never sees it.
    assert not router.expert_bias.requires_grad
    assert [p.name for p in router.trainable_params()] == [router.weight.name]
