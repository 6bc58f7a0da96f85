"""Expert-parallel dispatch traffic (parallel/ep/traffic.py): exact counts on hand-built routings, the vectorised
counts against a per-copy reference of the definitions, per-rank sums, the reduction against its analytic value, and
the routing recorder (telechat_moe/routing_trace.py) against the model's own forward."""
from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest

from parallel.ep.traffic import (STEP_MULTIPLIER, EpTopology, Traffic, expected_reduction, outgoing, split_by_rank,
                                 token_bytes, total, uniform_expected_reduction)

# 16 experts, 8 ranks of 2 experts, 2 nodes of 4 ranks: node 0 = ranks 0-3 (experts 0-7), node 1 = ranks 4-7
TOPO = EpTopology(16, 8, 4)


def reference(indices, source: int, topo: EpTopology) -> Traffic:
    """The definitions, one copy and one token at a time."""
    d, per = topo.devices_per_node, topo.experts_per_rank
    fi = fa = hi = ha = 0
    for token in np.asarray(indices).tolist():
        remote_nodes = set()
        for e in token:
            dest = e // per
            if dest // d != source // d:
                fi += 1
                remote_nodes.add(dest // d)
                holder = (dest // d) * d + source % d       # where stage 1 delivered the token on that node
            else:
                fa += dest != source
                holder = source
            ha += dest != holder
        hi += len(remote_nodes)
    return Traffic(fi, fa, hi, ha)


def random_routing(rng, shape, experts, k, weights=None):
    """Distinct experts per token, uniform or ~ weights (Gumbel top-k)."""
    logw = np.zeros(experts) if weights is None else np.log(weights)
    keys = logw - np.log(-np.log(rng.random((*shape, experts))))
    return np.argpartition(-keys, k - 1, axis=-1)[..., :k]


# ---- hand-built cases -----------------------------------------------------------------------------------------
def test_all_experts_on_one_remote_node():
    # source rank 1 (node 0, local 1); experts 8, 10, 12, 14 live on ranks 4, 5, 6, 7 = all of node 1
    t = outgoing(np.array([[8, 10, 12, 14]]), 1, TOPO)
    # flat: 4 inter-node copies; hierarchical: 1 inter-node send to rank 5 = (node 1, local 1), which holds expert
    # 10 itself and forwards 3 copies inside node 1
    assert t == Traffic(flat_inter=4, flat_intra=0, hier_inter=1, hier_intra=3)
    assert t.ratio == 4.0
    assert expected_reduction(np.array([[8, 10, 12, 14]]), TOPO, source_rank=1) == 4.0


def test_experts_on_the_source_rank_move_nothing():
    assert outgoing(np.array([[2, 3], [3, 2]]), 1, TOPO) == Traffic(0, 0, 0, 0)
    assert np.isnan(expected_reduction(np.array([[2, 3]]), TOPO, source_rank=1))
    assert np.isnan(Traffic().ratio)


def test_mixed_token_and_the_matching_local_index():
    # expert 2: own rank; 4: rank 2 (same node); 9, 15: ranks 4, 7 (node 1, stage 1 delivers to rank 5)
    assert outgoing(np.array([[2, 4, 9, 15]]), 1, TOPO) == Traffic(2, 1, 1, 3)
    # expert 10 sits on rank 5 = (node 1, local 1): one inter-node copy either way, no stage-2 copy
    assert outgoing(np.array([[10]]), 1, TOPO) == Traffic(1, 0, 1, 0)
    # experts 0, 1 on rank 0 and 6, 7 on rank 3 (node 0). From rank 5 (node 1, local 1): one stage-1 send to rank 1,
    # which holds none of them: 4 stage-2 copies. From rank 0: two copies stay, two go to rank 3 either way.
    assert outgoing(np.array([[0, 1, 6, 7]]), 5, TOPO) == Traffic(4, 0, 1, 4)
    assert outgoing(np.array([[0, 1, 6, 7]]), 0, TOPO) == Traffic(0, 2, 0, 2)


def test_hierarchical_stage_two_counts_copies_whose_local_index_differs():
    rng = np.random.default_rng(3)
    topo = EpTopology(64, 16, 4)
    idx = random_routing(rng, (50,), 64, 6)
    for s in range(topo.ranks):
        assert outgoing(idx, s, topo) == reference(idx, s, topo)


@pytest.mark.parametrize("topo,k", [(EpTopology(16, 8, 4), 4), (EpTopology(32, 32, 8), 8), (EpTopology(24, 6, 3), 5),
                                    (EpTopology(8, 8, 8), 2), (EpTopology(12, 12, 1), 3)])
def test_vectorised_counts_equal_the_reference(topo, k):
    rng = np.random.default_rng(topo.ranks * 100 + k)
    idx = random_routing(rng, (topo.ranks, 40), topo.num_experts, k)
    ref = sum(reference(idx[r], r, topo) for r in range(topo.ranks))
    assert total(idx, topo) == ref
    assert total(idx, topo) == sum(outgoing(idx[r], r, topo) for r in range(topo.ranks))


def test_total_accepts_ranks_of_different_lengths():
    rng = np.random.default_rng(1)
    parts = [random_routing(rng, (n,), 16, 4) for n in (3, 0, 7, 1, 5, 2, 9, 4)]
    assert total(parts, TOPO) == sum(reference(p, r, TOPO) for r, p in enumerate(parts))


# ---- the reduction --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("skew", [None, "zipf", "own"])
def test_ratio_is_the_mean_experts_per_touched_remote_node(skew):
    rng = np.random.default_rng(7)
    topo = EpTopology(64, 32, 8)
    if skew == "zipf":
        idx = random_routing(rng, (32, 300), 64, 8, 1.0 / np.arange(1, 65) ** 1.2)
    else:
        idx = random_routing(rng, (32, 300), 64, 8)
        if skew == "own":    # half the tokens keep their first expert on their own rank
            idx[:, ::2, 0] = (np.arange(32) * topo.experts_per_rank)[:, None]
    t = total(idx, topo)
    assert expected_reduction(idx, topo) == pytest.approx(t.flat_inter / t.hier_inter, rel=1e-12)
    # the same, counted by hand: experts per (token, remote node) pair
    counts = [c for r in range(32) for token in idx[r] for node, c in
              zip(*np.unique(topo.node_of_rank(topo.rank_of(token)), return_counts=True)) if node != r // 8]
    assert expected_reduction(idx, topo) == pytest.approx(np.mean(counts), rel=1e-12)


def test_uniform_analytic_value_is_exact_by_enumeration():
    experts, nodes, k = 12, 3, 4
    per_node = experts // nodes
    hits = [sum(1 for e in combo if e // per_node == 0) for combo in combinations(range(experts), k)]
    touched = [h for h in hits if h]
    assert uniform_expected_reduction(k, nodes, experts) == pytest.approx(np.mean(touched), rel=1e-12)
    assert uniform_expected_reduction(1, 4, 16) == 1.0
    assert uniform_expected_reduction(8, 1, 256) == 8.0          # one node: it holds all k
    assert uniform_expected_reduction(8, 32, 256, ranks=256) == uniform_expected_reduction(8, 32, 256)


def test_uniform_analytic_value_within_sampling_error_of_a_big_random_trace():
    rng = np.random.default_rng(11)
    topo = EpTopology(128, 32, 4)             # 8 nodes of 16 experts
    k = 8
    idx = random_routing(rng, (32, 2000), 128, k)
    measured = expected_reduction(idx, topo)
    analytic = uniform_expected_reduction(k, topo.nodes, topo.num_experts, topo.ranks)
    t = total(idx, topo)
    # per-pair counts have variance <= k^2/4; pairs of one token are dependent, so take tokens as the sample size
    tokens = idx.shape[0] * idx.shape[1]
    se = np.sqrt(k * k / 4) / np.sqrt(tokens)
    assert abs(measured - analytic) < 4 * se, (measured, analytic, se)
    assert abs(t.ratio - analytic) < 4 * se
    # and the flat inter-node share: k (1 - 1/nodes) copies per token
    assert t.flat_inter / tokens == pytest.approx(k * (1 - 1 / topo.nodes), rel=0.01)


# ---- the result type -----------------------------------------------------------------------------------------
def test_traffic_sums_converts_and_round_trips():
    a, b = Traffic(1, 2, 3, 4), Traffic(10, 20, 30, 40)
    assert a + b == Traffic(11, 22, 33, 44) and sum([a, b]) == a + b and sum([]) == 0
    assert a.per_step() == a * STEP_MULTIPLIER == Traffic(4, 8, 12, 16) and 2 * a == a * 2
    bpt = token_bytes(4096, 2)
    assert bpt == 8192
    assert a.to_bytes(bpt) == {"flat_inter": 8192, "flat_intra": 16384, "hier_inter": 24576, "hier_intra": 32768}
    assert Traffic.from_array(a.as_array().astype(np.float32)) == a
    with pytest.raises(ValueError, match="expected 4 values"):
        Traffic.from_array([1, 2, 3])
    with pytest.raises(TypeError):
        a + 1


def test_split_by_rank_deals_contiguous_runs():
    idx = np.arange(2 * 17).reshape(17, 2) % 16
    parts = split_by_rank(idx, TOPO)
    assert parts.shape == (8, 2, 2) and np.array_equal(parts.reshape(-1, 2), idx[:16])
    with pytest.raises(ValueError, match="cannot give each of 8 ranks"):
        split_by_rank(idx[:7], TOPO)


# ---- bad input -----------------------------------------------------------------------------------------------
def test_topology_validation():
    with pytest.raises(ValueError, match="6 ranks do not divide 16 experts"):
        EpTopology(16, 6, 2)
    with pytest.raises(ValueError, match="devices_per_node=3 does not divide 8 ranks"):
        EpTopology(16, 8, 3)
    with pytest.raises(ValueError, match="ranks: expected a positive integer"):
        EpTopology(16, 0, 1)
    with pytest.raises(ValueError, match="devices_per_node: expected a positive integer"):
        EpTopology(16, 8, 2.0)
    t = EpTopology(512, 512, 8)
    assert (t.nodes, t.experts_per_rank, t.experts_per_node) == (64, 1, 8)
    with pytest.raises(ValueError, match="expert ids must lie in"):
        outgoing(np.array([[16]]), 0, TOPO)
    with pytest.raises(ValueError, match="source_rank"):
        outgoing(np.array([[1]]), 8, TOPO)
    with pytest.raises(ValueError, match="expected \\[ranks=8"):
        total(np.zeros((4, 3, 2), np.int64), TOPO)
    with pytest.raises(ValueError, match="integer expert ids"):
        outgoing(np.array([[1.0]]), 0, TOPO)
    with pytest.raises(ValueError, match="nodes do not divide"):
        uniform_expected_reduction(4, 3, 16)


# ---- recorded routing ----------------------------------------------------------------------------------------
def test_record_routing_matches_the_models_own_expert_load():
    """A freshly initialised tiny-shaped model: the recorded choices are distinct valid experts per token, and their
    counts per layer are the expert load the model's forward reports for its MoE layers."""
    import mindspore as ms
    from mindspore import Tensor
    from telechat_moe.model import TeleChatMoE
    from telechat_moe.recipe import load_recipe
    from telechat_moe.routing_trace import moe_layer_indices, record_routing
    from telechat_moe.batches import position_ids
    cfg = load_recipe("tiny", ["model.seq_length=32", "model.max_position_embeddings=32",
                               "model.original_max_position_embeddings=32"]).model
    ms.set_seed(0)
    model = TeleChatMoE(cfg)
    rng = np.random.default_rng(0)
    batches = [{"input_ids": rng.integers(0, cfg.vocab_size, (2, 32)).astype(np.int32),
                "segment_ids": np.repeat(np.repeat([[0, 1]], 16, axis=1), 2, axis=0).astype(np.int32)}
               for _ in range(2)]
    mode = ms.get_context("mode")
    routing = record_routing(model, batches)
    assert ms.get_context("mode") == mode
    layers = moe_layer_indices(model)
    assert list(routing) == layers == [i for i in range(cfg.num_hidden_layers) if i >= cfg.first_k_dense_replace]
    for idx in routing.values():
        assert idx.shape == (2 * 2 * 32, cfg.num_experts_per_tok) and idx.dtype == np.int32
        assert idx.min() >= 0 and idx.max() < cfg.n_routed_experts
        assert all(len(set(row)) == cfg.num_experts_per_tok for row in idx.tolist())
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        model.set_train(False)
        for b, batch in enumerate(batches):
            ids = batch["input_ids"]
            out = model(Tensor(ids), Tensor(ids), Tensor(np.ones(ids.shape, np.float32)),
                        Tensor(batch["segment_ids"]), Tensor(position_ids(*ids.shape)))
            loads = out[5].asnumpy()                            # MoE layers, then MTP
            for j, layer in enumerate(layers):
                mine = routing[layer][b * 64:(b + 1) * 64]
                np.testing.assert_array_equal(np.bincount(mine.ravel(), minlength=cfg.n_routed_experts), loads[j][:cfg.n_routed_experts])
    finally:
        ms.set_context(mode=mode)


@pytest.mark.parametrize("ranks, devices_per_node", [(4, 2), (8, 4), (8, 8), (16, 4)])
def test_step_graph_counts_equal_the_numpy_reference(ranks, devices_per_node):
    """parallel/ep/counts.py, which the trainer logs from, counts what `outgoing` counts, for every source rank, on
    skewed routing (distinct top-4 experts drawn with Zipf-like popularity)."""
    import mindspore as ms
    from mindspore import Tensor
    from parallel.ep.counts import dispatch_counts
    experts, k = 32, 4
    topo = EpTopology(experts, ranks, devices_per_node)
    rng = np.random.default_rng(ranks * 10 + devices_per_node)
    popularity = 1.0 / np.arange(1, experts + 1)
    for source in range(ranks):
        idx = np.stack([rng.choice(experts, k, replace=False, p=popularity / popularity.sum())
                        for _ in range(64)]).astype(np.int32)
        got = dispatch_counts(Tensor(idx), source, experts // ranks, devices_per_node, ranks // devices_per_node)
        np.testing.assert_array_equal(got.asnumpy().astype(np.int64), outgoing(idx, source, topo).as_array())
        assert got.dtype == ms.float32
