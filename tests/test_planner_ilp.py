"""The per-chunk layers/recompute ILP: equal to brute force where brute force is possible, memory identical to the
event-driven simulator's, never worse than the even split."""
import dataclasses

import numpy as np
import pytest

from parallel.layout import ParallelLayout
from parallel.pipeline.schedules import build, validate
from parallel.planner.cluster import load_cluster
from parallel.planner.simulate import simulate_layout
from parallel.planner.stage_ilp import (CHUNKINGS, assess, brute_force, chunk_layout, chunk_plans, even_assignment,
                                       held_profiles, solve_ilp)
from parallel.planner.workload import Workload
from tests.test_planner_model_shape import TELECHAT3_105B

SMALL = dataclasses.replace(TELECHAT3_105B, num_layers=6, first_k_dense=1)
W = Workload(SMALL, load_cluster("ascend910b"), devices=64, seq_length=4096, global_batch=64)
LAYOUTS = [
    ParallelLayout(tp=2, pp=3, vpp=1, dp=8, ep=8, etp=1, micro_batch_size=1, micro_batch_num=8, recompute="none",
                   ep_scheme="flat", ep_overlap=False),
    ParallelLayout(tp=1, pp=2, vpp=2, dp=32, ep=8, etp=1, micro_batch_size=1, micro_batch_num=2, recompute="none",
                   ep_scheme="flat", ep_overlap=True),
]
DUALPIPEV = ParallelLayout(tp=1, pp=2, vpp=2, dp=32, ep=8, etp=1, micro_batch_size=1, micro_batch_num=4,
                           recompute="none", ep_scheme="flat", ep_overlap=True)


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("layout, schedule", [(LAYOUTS[0], None), (LAYOUTS[1], None), (DUALPIPEV, "dualpipev")],
                         ids=["1f1b-p3", "interleaved-p2v2", "dualpipev-p2"])
def test_ilp_optimum_equals_brute_force(layout, schedule, chunking):
    even = assess(W, layout, [even_assignment(W, layout, chunk_layout(layout, schedule))], schedule)["memory"].max()
    outcomes = set()
    for scale in (0.3, 0.85, 0.95, 1.0, 1.2, 3.0):
        limit = even * scale
        ilp = solve_ilp(W, layout, memory_limit=limit, chunking=chunking, schedule=schedule)
        brute = brute_force(W, layout, memory_limit=limit, chunking=chunking, schedule=schedule)
        assert (ilp is None) == (brute is None), scale
        outcomes.add(ilp is None)
        if ilp is not None:
            assert ilp.objective == pytest.approx(brute.objective, rel=1e-9), scale
            assert assess(W, layout, [ilp], schedule)["memory"].max() <= limit
    assert outcomes == {True, False}  # the limits reach both infeasible and feasible cases


def test_dualpipev_places_embedding_and_head_on_stage_0_and_memory_is_the_simulators():
    """Under DualPipeV's V the embedding is in virtual stage 0 (chunk 0 of stage 0) and head, loss and MTP in
    virtual stage 2p-1 (chunk 1 of stage 0); the ILP's memory per stage is the event simulator's."""
    big = Workload(TELECHAT3_105B, load_cluster("ascend910b"), devices=512, seq_length=4096, global_batch=1024)
    layout = ParallelLayout(tp=4, pp=4, vpp=2, dp=32, ep=16, etp=1, micro_batch_size=1, micro_batch_num=16,
                            recompute="selective", ep_scheme="flat", ep_overlap=True)
    a = solve_ilp(big, layout, schedule="dualpipev")
    plan = chunk_plans(layout, [a], chunk_layout(layout, "dualpipev"))  # ordered stage, chunk
    assert list(np.flatnonzero(plan.embedding)) == [0] and list(np.flatnonzero(plan.last)) == [1]
    sim = simulate_layout(big, layout, a, schedule="dualpipev")
    np.testing.assert_allclose(sim.memory_per_stage, assess(big, layout, [a], "dualpipev")["memory"][0], rtol=1e-9)
    assert max(sim.memory_per_stage) <= big.cluster.usable_memory
    even = even_assignment(big, layout, chunk_layout(layout, "dualpipev"))
    assert a.objective <= assess(big, layout, [even], "dualpipev")["objective"][0] + 1e-9
    assert sum(a.layers_per_stage) == TELECHAT3_105B.num_layers


def test_ilp_memory_is_the_simulators_and_beats_the_even_split():
    big = Workload(TELECHAT3_105B, load_cluster("ascend910b"), devices=512, seq_length=4096, global_batch=1024)
    layout = ParallelLayout(tp=4, pp=8, vpp=3, dp=16, ep=16, etp=1, micro_batch_size=1, micro_batch_num=64,
                            recompute="selective", ep_scheme="flat", ep_overlap=True)
    a = solve_ilp(big, layout)
    sim = simulate_layout(big, layout, a)
    np.testing.assert_allclose(sim.memory_per_stage, assess(big, layout, [a])["memory"][0], rtol=1e-9)
    assert max(sim.memory_per_stage) <= big.cluster.usable_memory
    assert a.objective <= assess(big, layout, [even_assignment(big, layout)])["objective"][0] + 1e-9
    assert a.objective <= solve_ilp(big, layout, chunking="even").objective + 1e-9  # free chunking holds even's
    assert sum(a.layers_per_stage) == TELECHAT3_105B.num_layers


@pytest.mark.parametrize("p, v, m", [(4, 1, 6), (4, 2, 8), (3, 3, 6)])
def test_held_profiles_reach_the_schedule_peak(p, v, m):
    name = "interleaved" if v > 1 else "1f1b"
    report = validate(build(name, p, v, m))
    for s, rows in enumerate(held_profiles(p, v, m, name)):
        assert rows.sum(axis=1).max() == report.peak_in_flight[s]
        assert (rows <= np.array(report.peak_in_flight_by_chunk[s])).all()
