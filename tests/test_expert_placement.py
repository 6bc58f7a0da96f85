"""Dynamic expert placement (parallel/ep/placement.py): load window and heatmap, the predictor on a linear trend,
the planner's invariants (slots, every expert placed, replicas only in spare slots, one copy per device), its
max load against a brute-force optimum, the node level kept by the device level, the dispatcher maps, the move
cost, the trigger's verdict both ways, moves that are exactly the change, and the planning time."""
from __future__ import annotations

import itertools
import statistics
import time

import numpy as np
import pytest

from parallel.ep.load import LoadPredictor, LoadWindow
from parallel.ep.migration_plan import MoveCost, align_placement, migration_moves, plan_migration
from parallel.ep.placement import Placement, greedy_placement, load_bound, plan_placement, replica_counts
from parallel.planner.cluster import load_cluster
import parallel.ep.placement as placement_module


def zipf_load(rng, experts: int, s: float = 1.0, scale: float = 1e6) -> np.ndarray:
    pop = 1.0 / np.arange(1, experts + 1) ** s
    return pop[rng.permutation(experts)] / pop.sum() * scale


def check_valid(p: Placement, experts: int, devices: int, slots: int) -> None:
    se = p.slot_expert
    assert se.shape == (devices, slots)
    held = se[se >= 0]
    assert np.array_equal(np.bincount(held, minlength=experts), p.replicas)
    assert p.replicas.min() >= 1                                    # every expert placed at least once
    for row in se:                                                  # copies of an expert on distinct devices
        kept = row[row >= 0]
        assert kept.size == np.unique(kept).size
    assert np.allclose(p.device_load, p.device_loads(p.load))
    assert np.isclose(p.device_load.sum(), p.load.sum())


# ---- load statistics and predictor ------------------------------------------------------------------------------
def test_load_window_keeps_the_last_steps_in_order():
    win = LoadWindow(2, 3, window=4)
    done = [win.append(np.full((2, 3), t, float), step=100 + t) for t in range(6)]
    assert done == [False, False, False, True, False, False]
    assert win.full and win.size == 4
    assert win.steps().tolist() == [102, 103, 104, 105]
    assert win.counts(1)[:, 0].tolist() == [2, 3, 4, 5]
    assert np.array_equal(win.total(), np.full((2, 3), 14.0))
    assert np.array_equal(win.mean(), np.full((2, 3), 3.5))
    with pytest.raises(ValueError, match="shape"):
        win.append(np.zeros(3))
    with pytest.raises(ValueError, match="non-negative"):
        win.append(-np.ones((2, 3)))


def test_heatmap_png(tmp_path):
    pytest.importorskip("matplotlib")
    win = LoadWindow(1, 16, window=10)
    rng = np.random.default_rng(0)
    for _ in range(7):
        win.append(rng.integers(0, 50, 16))
    out = win.heatmap_png(tmp_path / "layer0.png", 0)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="layer"):
        win.heatmap_png(tmp_path / "x.png", 1)


def test_predictor_is_exact_on_a_linear_trend():
    rng = np.random.default_rng(1)
    base, slope = rng.uniform(100, 1000, (3, 16)), rng.uniform(-5, 20, (3, 16))
    pred = LoadPredictor()
    assert pred.error() is None
    for t in range(8):
        pred.observe(base + slope * t)
        if t >= 3:                                       # forecasts made from the third window on are exact
            assert pred.error() < 1e-12
            assert np.all(pred.error(per_layer=True) < 1e-12)
    assert np.allclose(pred.predict(), base + slope * 8)


def test_predictor_error_is_relative_l1():
    pred = LoadPredictor(alpha=1.0, beta=0.0)             # forecast = last window
    pred.observe([10.0, 30.0])
    pred.observe([20.0, 20.0])
    assert pred.error() == pytest.approx((10 + 10) / 40)
    assert np.allclose(pred.predict(), [20, 20])


# ---- planner invariants ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("experts,devices,spare,dpn", [(256, 64, 1, 8), (256, 16, 2, 8), (64, 16, 0, 4),
                                                      (16, 8, 1, 4), (20, 6, 2, 3)])
def test_planner_fills_slots_places_every_expert_replicas_in_spare_slots(experts, devices, spare, dpn):
    rng = np.random.default_rng(experts + devices)
    slots = -(-experts // devices) + spare
    for s in (0.0, 1.0, 1.5):
        load = zipf_load(rng, experts, s)
        for replicas in (False, True):
            p = plan_placement(load, devices, slots, dpn, replicas=replicas)
            check_valid(p, experts, devices, slots)
            extra = int(p.replicas.sum()) - experts
            assert 0 <= extra <= devices * slots - experts            # replicas only in spare slots
            if not replicas or devices * slots == experts:
                assert extra == 0
            # replicas go to the hottest experts: an expert with copies is at least as hot as any without
            if extra:
                assert load[p.replicas > 1].min() >= load[p.replicas == 1].max()
            assert p.max_load >= load_bound(load, devices, slots, p.replicas) * (1 - 1e-12)


def test_no_load_and_bad_shapes():
    p = plan_placement(np.zeros(16), 4, 5, 2)
    check_valid(p, 16, 4, 5)
    assert p.imbalance == 1.0 and p.replicas.sum() == 16
    m = plan_migration(p, np.zeros(16), cost=_cost(), seconds_per_token=1e-6)
    assert not m.accepted and m.moves == []
    with pytest.raises(ValueError, match="do not fit"):
        plan_placement(np.ones(17), 4, 4, 2)
    with pytest.raises(ValueError, match="devices_per_node"):
        plan_placement(np.ones(16), 4, 4, 3)
    with pytest.raises(ValueError, match="non-negative"):
        plan_placement(-np.ones(16), 4, 4, 2)


def test_replicas_split_the_hottest_until_below_the_limit():
    load = np.array([80.0, 10, 5, 5])                      # mean device load over 4 devices: 25
    copies = replica_counts(load, spare_slots=10, num_devices=4, split_above=0.5)
    assert copies.tolist() == [4, 1, 1, 1]                 # 80/4 = 20 > 12.5 but a fifth copy has no device
    assert replica_counts(load, 1, 4).tolist() == [2, 1, 1, 1]
    assert replica_counts(load, 0, 4).tolist() == [1, 1, 1, 1]


def test_greedy_and_static_placements():
    load = np.arange(1.0, 17.0)
    st = Placement.static(16, 4, 5, 2, load)
    assert st.slot_expert[1, :4].tolist() == [4, 5, 6, 7] and np.all(st.slot_expert[:, 4] == -1)
    assert np.allclose(st.device_load, [10, 26, 42, 58])
    g = greedy_placement(load, 4, 5, 2)
    check_valid(g, 16, 4, 5)
    assert g.max_load <= st.max_load


# ---- against the optimum ---------------------------------------------------------------------------------------------
def test_planner_against_brute_force_optimum():
    """8 experts on 4 devices, every assignment within the slots enumerated: the planner (no replicas) never exceeds
    Graham's LPT bound (4/3 - 1/(3m)) x optimum, and after refinement it is optimal (within its 0.2% stopping
    tolerance) on nearly every instance."""
    experts, devices = 8, 4
    assign = np.array(list(itertools.product(range(devices), repeat=experts)))
    onehot = np.eye(devices)[assign]                                   # [assignments, experts, devices]
    count = onehot.sum(1)
    rng = np.random.default_rng(3)
    ratios = []
    for slots in (2, 3):
        feasible = onehot[(count <= slots).all(1)]
        for dpn in (4, 2):
            for t in range(40):
                load = rng.pareto(1.5, experts) + 0.1 if t % 2 else rng.integers(1, 100, experts).astype(float)
                opt = (feasible * load[None, :, None]).sum(1).max(1).min()
                p = plan_placement(load, devices, slots, dpn, replicas=False)
                check_valid(p, experts, devices, slots)
                ratios.append(p.max_load / opt)
    ratios = np.array(ratios)
    assert ratios.min() >= 1 - 1e-12
    assert ratios.max() <= 4 / 3 - 1 / (3 * devices)
    assert np.mean(ratios <= 1 + 2e-3) >= 0.95, f"optimal on {np.mean(ratios <= 1 + 2e-3):.0%} only"


# ---- two levels ----------------------------------------------------------------------------------------------------
def test_device_level_keeps_the_node_level_choice():
    """With cross_node=False every copy ends on the node the node level gave it, so each node's experts are the
    node level's and the node loads are the node level's (balanced: small copies, within 1%)."""
    rng = np.random.default_rng(5)
    experts, devices, dpn, slots = 256, 64, 8, 5
    load = rng.uniform(50, 150, experts)
    p = plan_placement(load, devices, slots, dpn, replicas=False, cross_node=False)
    copies = np.ones(experts, np.int64)
    ex, w = placement_module._items(load, copies)
    use = placement_module._node_slot_use(w, devices, slots)
    node = placement_module._lpt(w, ex, devices // dpn, dpn * slots, dpn, use)
    node = placement_module._refine(node, w, ex, devices // dpn, dpn * slots, dpn, experts, use=use)
    pres = p.presence().reshape(devices // dpn, dpn, experts).any(1)
    for n in range(devices // dpn):
        assert set(np.flatnonzero(pres[n]).tolist()) == set(ex[node == n].tolist())
    assert p.node_load.max() / p.node_load.mean() < 1.01
    # the cross-node pass only ever lowers the most loaded device
    assert plan_placement(load, devices, slots, dpn, replicas=False).max_load <= p.max_load


def test_a_hot_expert_gets_a_device_to_itself_at_the_node_level():
    """A copy heavier than the mean device load takes a device's slots at the node level, so its device holds it
    alone instead of the node's share of the other experts (16 devices of 17 slots, 256 experts)."""
    load = np.ones(256)
    load[7] = 40.0                                                     # mean device load (295/16) x 2.2
    p = plan_placement(load, 16, 17, 8, replicas=False)
    (d, _), = p.expert_to_slots()[7]
    assert (p.slot_expert[d] >= 0).sum() == 1 and p.max_load == 40.0


# ---- dispatcher maps ------------------------------------------------------------------------------------------------
def test_expert_to_slots_and_slot_table_agree():
    rng = np.random.default_rng(2)
    p = plan_placement(zipf_load(rng, 64), 16, 5, 4, replicas=True)
    maps = p.expert_to_slots()
    offsets, dev, slot = p.slot_table()
    for e, copies in enumerate(maps):
        assert len(copies) == p.replicas[e]
        assert all(p.slot_expert[d, s] == e for d, s in copies)
        assert list(zip(dev[offsets[e]:offsets[e + 1]].tolist(), slot[offsets[e]:offsets[e + 1]].tolist())) == copies


# ---- cost -----------------------------------------------------------------------------------------------------------
def test_move_cost_from_cluster_and_link_times():
    c = load_cluster("ascend910b")
    cost = MoveCost.from_cluster("ascend910b", expert_params=1000, weight_bytes=2, moment_bytes=4)
    assert cost.expert_bytes == 1000 * (2 + 2 * 4)
    assert cost.intra_bandwidth == c.intra_bandwidth * c.network_efficiency
    assert cost.inter_bandwidth == c.inter_bandwidth * c.network_efficiency
    cost = MoveCost(expert_bytes=100.0, intra_bandwidth=100.0, inter_bandwidth=10.0, inter_latency=1.0)
    # dpn 4: devices 0-3 node 0. Device 0 sends two copies across nodes (2 x (10 + 1) s) and one inside (1 s)
    moves = [(0, 0, 0, 4, 0), (1, 0, 1, 5, 0), (2, 0, 2, 1, 3), (3, 2, 0, 2, 1)]   # the last stays on device 2
    assert cost.seconds(moves, 4) == pytest.approx(22.0)
    assert cost.split(moves, 4) == (100.0, 200.0)
    assert cost.seconds([], 4) == 0.0


# ---- migration ------------------------------------------------------------------------------------------------------
def apply(current: Placement, moves, drops) -> np.ndarray:
    """The slots after a migration: every move reads the current slots (all at once)."""
    se = current.slot_expert.copy()
    for e, d, s in drops:
        se[d, s] = -1
    for e, fd, fs, td, ts in moves:
        assert current.slot_expert[fd, fs] == e                       # the source holds the expert now
        se[td, ts] = e
    return se


def _cost():
    return MoveCost.from_cluster("ascend910b", expert_params=3 * 4096 * 2304)


def test_trigger_accepts_when_gain_exceeds_cost_and_refuses_otherwise():
    rng = np.random.default_rng(7)
    load = zipf_load(rng, 256, 1.0, scale=65536 * 8 * 64 * 50)
    static = Placement.static(256, 64, 5, 8, load)
    spt = 1e-6
    m = plan_migration(static, load, cost=_cost(), seconds_per_token=spt)
    assert m.accepted and m.predicted_gain_s > m.cost_s > 0
    assert m.predicted_gain_s == pytest.approx((static.max_load - m.proposed.max_load) * spt)
    assert m.placement is m.proposed and m.proposed.imbalance < 1.05
    assert np.array_equal(apply(m.current, m.moves, m.drops), m.proposed.slot_expert)
    assert m.bytes == pytest.approx(m.intra_bytes + m.inter_bytes)
    # the same gain against links a million times slower: refused, the current placement stays
    slow = MoveCost(_cost().expert_bytes, 1e5, 1e4)
    r = plan_migration(static, load, cost=slow, seconds_per_token=spt)
    assert not r.accepted and r.predicted_gain_s < r.cost_s and r.placement is r.current
    assert r.reason.startswith("refused")
    # a threshold per level: with inter-node moves priced out, only moves inside nodes remain
    i = plan_migration(static, load, cost=_cost(), seconds_per_token=spt, threshold_inter=float("inf"))
    assert i.accepted and i.level == "intra"
    assert all(fd // 8 == td // 8 for _, fd, _, td, _ in i.moves)
    assert np.array_equal(i.proposed.presence().reshape(8, 8, 256).any(1),
                          static.presence().reshape(8, 8, 256).any(1))      # every node keeps its experts


def test_migration_moves_only_what_changed():
    rng = np.random.default_rng(11)
    load = zipf_load(rng, 256, 0.6, scale=1e9)
    current = plan_placement(load, 64, 5, 8, replicas=True)
    same = plan_migration(current, load, cost=_cost(), seconds_per_token=1e-6)
    assert same.moves == [] and not same.accepted and same.reason.startswith("nothing to move")
    # two single-copy experts swap their loads: the migration swaps the two experts back, nothing else
    single = np.flatnonzero(current.replicas == 1)
    order = single[np.argsort(load[single])]
    a, b = int(order[-1]), int(order[len(order) // 4])
    swapped = load.copy()
    swapped[[a, b]] = load[[b, a]]
    m = plan_migration(current, swapped, cost=_cost(), seconds_per_token=1e-6)
    assert m.accepted and current.evaluate(swapped).imbalance > 1.3
    assert sorted(x[0] for x in m.moves) == sorted([a, b])
    assert m.proposed.imbalance == pytest.approx(current.imbalance)
    # one cold expert turns hot (and the total grows 2%): moves touch exactly the slots that change, and fewer
    # than re-placing from scratch
    hot = load.copy()
    hot[int(np.argmin(load))] = load.max() * 0.5
    m = plan_migration(current, hot, cost=_cost(), seconds_per_token=1e-6)
    assert m.accepted and m.proposed.imbalance < 1.05
    assert np.array_equal(apply(current, m.moves, m.drops), m.proposed.slot_expert)
    changed = current.slot_expert != m.proposed.slot_expert
    assert len(m.moves) == int(((m.proposed.slot_expert >= 0) & changed).sum())
    touched = {(d, s) for *_, d, s in m.moves} | {(d, s) for _, d, s in m.drops}
    assert touched == set(zip(*np.nonzero(changed)))
    fresh = plan_placement(hot, 64, 5, 8, replicas=True)
    assert len(m.moves) < len(migration_moves(current, align_placement(fresh, current))[0]) / 2


def test_align_recovers_a_relabelled_placement():
    """A placement with its nodes and devices permuted and slots shuffled aligns back with no move at all."""
    rng = np.random.default_rng(4)
    load = zipf_load(rng, 128, 1.0)
    p = plan_placement(load, 32, 5, 8, replicas=True)
    nodes = rng.permutation(4)
    order = np.concatenate([n * 8 + rng.permutation(8) for n in nodes])
    shuffled = np.stack([row[rng.permutation(5)] for row in p.slot_expert[order]])
    q = Placement.from_slots(shuffled, 8, load)
    back = align_placement(q, p)
    assert np.array_equal(back.slot_expert, p.slot_expert)
    assert migration_moves(p, back) == ([], [])


# ---- time ---------------------------------------------------------------------------------------------------------
def test_planning_time_256_experts_on_64_devices():
    rng = np.random.default_rng(0)
    load = zipf_load(rng, 256, 1.0)
    plan_placement(load, 64, 5, 8)                                     # warm up
    times, cpu = [], []
    for _ in range(7):
        t0, c0 = time.perf_counter(), time.process_time()
        p = plan_placement(load, 64, 5, 8, replicas=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    ms = statistics.median(times) * 1e3
    print(f"\nplan_placement 256 experts on 64 devices with replicas: median {ms:.2f} ms wall, "
          f"{statistics.median(cpu) * 1e3:.2f} ms CPU (of 7), max/mean {p.imbalance:.4f}")
    assert p.imbalance < 1.05
    assert ms < 50                                                     # target 10 ms; loose on a shared machine
