"""The router's losses and its expert bias against float64 references (precision.reference_ops): the sequence-level
auxiliary loss per sequence of a batch (sigmoid and softmax scores), the device-level (EP-group) balance loss and its
gradient, the z-loss, and the bias that picks experts without weighting them. PyNative: one router call per case,
nothing to compile, except one graph-mode check of the device-level loss."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from precision import reference_ops as ref
from precision.tolerance import Tolerance, assert_close, chain_tolerance, relative_error
from telechat_moe.config import ModelConfig
from telechat_moe.errors import RecipeError
from telechat_moe.moe.router import TopKRouter

HIDDEN, EXPERTS, TOP_K, BATCH, SEQ = 32, 16, 4, 3, 40


def make_router(rng, top_k=TOP_K, expert_groups=1, mode=ms.PYNATIVE_MODE, **overrides):
    """A router with unit-scale weights, so that scores are spread and the top-k has no near-ties."""
    ms.set_context(mode=mode)
    cfg = ModelConfig(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=top_k, **overrides)
    router = TopKRouter(cfg, expert_groups=expert_groups)
    weight = (rng.standard_normal((EXPERTS, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
    router.weight.set_data(Tensor(weight))
    return router, weight.astype(np.float64)


def batch_tokens(rng):
    """BATCH sequences whose tokens lean towards different experts (a per-sequence offset), so that averaging the
    loss per sequence differs from computing it over the whole batch."""
    offsets = 2.0 * rng.standard_normal((BATCH, 1, HIDDEN))
    x = (rng.standard_normal((BATCH, SEQ, HIDDEN)) + offsets).reshape(BATCH * SEQ, HIDDEN).astype(np.float32)
    return x, x.astype(np.float64)


def float64_choice(scores, bias, top_k=TOP_K):
    """Each token's chosen experts as sets: the order inside the top-k does not matter to any loss."""
    return np.sort(ref.choose_experts(scores, bias, top_k), axis=-1)


def device_aux_loss(scores, indices, groups, coeff, group_of=None):
    """DeepSeek-V2's device-level balance loss (eq. 15-17) over all T tokens, in float64: f_e = E / (k T) * #{t : e
    chosen by t}, P_e = mean_t s_te / sum_j s_tj; f'_d = mean of f_e over group d, P'_d = sum of P_e over group d,
    loss = coeff * sum_d f'_d P'_d. Group d holds experts [d E/D, (d+1) E/D) unless `group_of` (expert -> group)
    says otherwise."""
    t, experts = scores.shape
    k = indices.shape[1]
    chosen = np.zeros((t, experts))
    np.put_along_axis(chosen, indices, 1.0, axis=-1)
    f = chosen.sum(0) * experts / (k * t)
    p = (scores / scores.sum(-1, keepdims=True)).mean(0)
    group_of = np.arange(experts) // (experts // groups) if group_of is None else group_of
    f_group = np.array([f[group_of == d].mean() for d in range(groups)])
    p_group = np.array([p[group_of == d].sum() for d in range(groups)])
    return float(coeff * np.sum(f_group * p_group))


def device_loss_tolerance(groups):
    """logits over HIDDEN, the scores (a softmax over the experts at most), the normalisation over the experts, the
    mean over all tokens, the sums over a group's experts, the sum over the groups."""
    return chain_tolerance("float32", (HIDDEN, EXPERTS, EXPERTS, BATCH * SEQ, EXPERTS // groups, groups))


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


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize("groups", [1, 2, 4, 16])
def test_device_aux_loss_matches_the_reference(groups, top_k, scoring):
    """With the sequence-level loss off, aux is the device-level loss alone; with both on, their sum."""
    rng = np.random.default_rng(100 + 10 * groups + top_k + (scoring == "softmax"))
    coeff, alpha = 0.3, 0.2
    router, w = make_router(rng, top_k=top_k, expert_groups=groups, scoring_func=scoring, moe_aux_loss_coeff=0.0,
                            moe_device_aux_loss_coeff=coeff)
    bias = (0.05 * rng.standard_normal(EXPERTS)).astype(np.float32)
    router.expert_bias.set_data(Tensor(bias))
    x, x64 = batch_tokens(rng)

    indices, _, aux, _, _ = router(Tensor(x), BATCH)
    logits = x64 @ w.T
    scores = ref.sigmoid(logits) if scoring == "sigmoid" else ref.softmax(logits)
    chosen = float64_choice(scores, bias.astype(np.float64), top_k)
    assert np.array_equal(np.sort(indices.asnumpy(), -1), chosen)
    want = device_aux_loss(scores, chosen, groups, coeff)
    tol = device_loss_tolerance(groups)
    assert_close(float(aux.asnumpy()), want, tol, f"D={groups} top-{top_k} {scoring} device aux loss")
    if groups == 1:
        # One group: f' = mean f = 1 and P' = sum P = 1, whatever the routing.
        assert_close(want, coeff, tol, "D=1 reference")
    if groups == EXPERTS:
        # One expert a group: the expert-level loss over the whole micro-batch taken as one sequence.
        assert_close(want, ref.sequence_aux_loss(scores, chosen, 1, coeff), tol, "D=E reference")

    both, _ = make_router(rng, top_k=top_k, expert_groups=groups, scoring_func=scoring, moe_aux_loss_coeff=alpha,
                          moe_device_aux_loss_coeff=coeff)
    both.weight.set_data(Tensor(w.astype(np.float32)))
    both.expert_bias.set_data(Tensor(bias))
    aux_both = float(both(Tensor(x), BATCH)[2].asnumpy())
    seq_tol = chain_tolerance("float32", (HIDDEN, EXPERTS, EXPERTS, SEQ, EXPERTS, BATCH))
    assert_close(aux_both, want + ref.sequence_aux_loss(scores, chosen, BATCH, alpha),
                 Tolerance(tol.rtol + seq_tol.rtol, tol.atol + seq_tol.atol), "sequence + device aux loss")


def test_device_aux_loss_when_one_group_takes_most_tokens():
    """Tokens that lean towards the first of four groups' experts send most of their choices there: the loss
    rises well above its balanced value (coeff), and a grouping other than contiguous blocks (experts dealt
    round-robin to the ranks) gives another value, so the comparison sees which experts form a group."""
    rng = np.random.default_rng(21)
    groups, coeff = 4, 0.5
    router, w = make_router(rng, expert_groups=groups, moe_aux_loss_coeff=0.0, moe_device_aux_loss_coeff=coeff)
    x, _ = batch_tokens(rng)
    lean = w[: EXPERTS // groups].sum(0)
    x = (x + 12.0 * lean / np.linalg.norm(lean)).astype(np.float32)
    x64 = x.astype(np.float64)

    _, _, aux, _, load = router(Tensor(x), BATCH)
    scores = ref.sigmoid(x64 @ w.T)
    chosen = float64_choice(scores, np.zeros(EXPERTS))
    group_load = load.asnumpy().reshape(groups, -1).sum(-1)
    assert group_load[0] > 0.75 * group_load.sum()
    want = device_aux_loss(scores, chosen, groups, coeff)
    tol = device_loss_tolerance(groups)
    assert_close(float(aux.asnumpy()), want, tol, "skewed device aux loss")
    assert want > 1.5 * coeff
    strided = device_aux_loss(scores, chosen, groups, coeff, group_of=np.arange(EXPERTS) % groups)
    assert relative_error(strided, want) > 100 * tol.rtol


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_device_aux_loss_gradient_matches_finite_differences(scoring):
    """d aux / d router weight with only the device-level loss on, against float64 central differences of the
    reference with the routing held fixed (f is a count: no gradient flows through it)."""
    rng = np.random.default_rng(31 if scoring == "sigmoid" else 32)
    groups, coeff = 4, 0.3
    router, w = make_router(rng, expert_groups=groups, scoring_func=scoring, moe_aux_loss_coeff=0.0,
                            moe_device_aux_loss_coeff=coeff)
    x, x64 = batch_tokens(rng)
    grad = ms.grad(lambda inp: router(inp, BATCH)[2], grad_position=None, weights=router.weight)(Tensor(x))
    grad = grad.asnumpy()

    def activate(logits):
        return ref.sigmoid(logits) if scoring == "sigmoid" else ref.softmax(logits)

    chosen = float64_choice(activate(x64 @ w.T), np.zeros(EXPERTS))
    step = 1e-5
    want = np.zeros_like(w)
    for i, j in np.ndindex(*w.shape):
        plus, minus = w.copy(), w.copy()
        plus[i, j] += step
        minus[i, j] -= step
        want[i, j] = (device_aux_loss(activate(x64 @ plus.T), chosen, groups, coeff)
                      - device_aux_loss(activate(x64 @ minus.T), chosen, groups, coeff)) / (2 * step)
    # forward: logits over HIDDEN; backward: the group sums, the normalisation and the scores over the experts,
    # the mean over the tokens, the weight gradient summed over all tokens
    tol = chain_tolerance("float32", (HIDDEN, EXPERTS // groups, EXPERTS, EXPERTS, BATCH * SEQ, BATCH * SEQ))
    assert_close(grad, want, tol, f"{scoring} device aux loss gradient")
    # The gradient of P alone, the f counts taken as constants: a gradient through the expert-level loss instead
    # (one group per expert) would differ.
    other = np.zeros_like(w)
    for i, j in np.ndindex(*w.shape):
        plus, minus = w.copy(), w.copy()
        plus[i, j] += step
        minus[i, j] -= step
        other[i, j] = (device_aux_loss(activate(x64 @ plus.T), chosen, EXPERTS, coeff)
                       - device_aux_loss(activate(x64 @ minus.T), chosen, EXPERTS, coeff)) / (2 * step)
    assert relative_error(other, want) > 100 * tol.rtol


def test_device_aux_loss_in_graph_mode():
    """The same value compiled as a graph (the coefficient and the group count are constants of the graph)."""
    rng = np.random.default_rng(41)
    groups, coeff = 2, 0.3
    router, w = make_router(rng, expert_groups=groups, mode=ms.GRAPH_MODE, moe_aux_loss_coeff=0.0,
                            moe_device_aux_loss_coeff=coeff)
    try:
        x, x64 = batch_tokens(rng)
        aux = float(router(Tensor(x), BATCH)[2].asnumpy())
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    scores = ref.sigmoid(x64 @ w.T)
    chosen = float64_choice(scores, np.zeros(EXPERTS))
    assert_close(aux, device_aux_loss(scores, chosen, groups, coeff), device_loss_tolerance(groups),
                 "graph-mode device aux loss")


def test_device_aux_loss_off_leaves_aux_unchanged():
    """Coefficient 0 (the default) computes nothing: whatever D, every output is bit for bit that of the router
    without expert groups, and aux the sequence-level loss alone."""
    rng = np.random.default_rng(51)
    x, x64 = batch_tokens(rng)
    alpha = 0.3
    router, w = make_router(rng, moe_aux_loss_coeff=alpha)
    assert router.cfg.moe_device_aux_loss_coeff == 0.0
    base = router(Tensor(x), BATCH)
    grouped, _ = make_router(rng, expert_groups=4, moe_aux_loss_coeff=alpha, moe_device_aux_loss_coeff=0.0)
    grouped.weight.set_data(Tensor(w.astype(np.float32)))
    out = grouped(Tensor(x), BATCH)
    assert len(out) == len(base) == 5
    for got, before in zip(out, base):
        assert got.shape == before.shape and np.array_equal(got.asnumpy(), before.asnumpy())
    scores = ref.sigmoid(x64 @ w.T)
    chosen = float64_choice(scores, np.zeros(EXPERTS))
    assert_close(float(out[2].asnumpy()), ref.sequence_aux_loss(scores, chosen, BATCH, alpha),
                 chain_tolerance("float32", (HIDDEN, EXPERTS, EXPERTS, SEQ, EXPERTS, BATCH)), "aux, device loss off")


@pytest.mark.parametrize("groups", [0, 3, 5, -2, 2.0])
def test_expert_groups_must_divide_the_experts(groups):
    with pytest.raises(ValueError, match="expert_groups"):
        make_router(np.random.default_rng(0), expert_groups=groups)


def test_device_aux_loss_coeff_must_not_be_negative():
    cfg = ModelConfig(moe_device_aux_loss_coeff=-0.1)
    with pytest.raises(RecipeError, match="model.moe_device_aux_loss_coeff"):
        cfg.validate()
    ModelConfig(moe_device_aux_loss_coeff=0.0).validate()
