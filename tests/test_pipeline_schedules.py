"""Schedules, validator and simulator against pipeline theory.

Formulas the tests hold the simulator to (uniform stages, free communication):
- 1F1B bubble = (p-1) / (m + p-1)
- interleaved 1F1B with v chunks per stage: bubble = (p-1) / (v*m + p-1)
- activations in flight on stage s: 1F1B min(p-s, m); interleaved 2(p-s-1) + (v-1)p + 1 when m > p (its warm-up
  plus the one in steady state).
"""
from __future__ import annotations

import os

import pytest

from parallel.pipeline.schedules import (Action, Kind, Schedule, ScheduleError, build, dependencies, gpipe,
                                         interleaved_1f1b, one_f_one_b, overlapped_1f1b, validate)
from parallel.pipeline.simulator import StageCosts, gantt, simulate, theoretical_bubble

GRID = [(p, v, m) for p in (2, 4, 8) for v in (2, 3, 4) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("p,v,m", GRID)
def test_bubble_matches_theory(p, v, m):
    for forward, backward in ((1.0, 2.0), (1.0, 1.0)):
        r1 = simulate(one_f_one_b(p, m), StageCosts.uniform(p, 1, forward, backward))
        assert abs(r1.bubble_ratio - (p - 1) / (m + p - 1)) < 0.005
        ri = simulate(interleaved_1f1b(p, v, m), StageCosts.uniform(p, v, forward, backward))
        assert abs(ri.bubble_ratio - (p - 1) / (v * m + p - 1)) < 0.005
        assert ri.bubble_ratio == pytest.approx(theoretical_bubble(p, m, v), abs=0.005)
        # the overlapped variant only reorders when communication is free: same bubble as interleaved
        ro = simulate(overlapped_1f1b(p, v, m), StageCosts.uniform(p, v, forward, backward))
        assert abs(ro.bubble_ratio - (p - 1) / (v * m + p - 1)) < 0.005


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "overlapped"])
def test_every_schedule_valid_over_a_grid(name):
    for p in range(1, 7):
        for v in (1, 2, 3):
            for k in (1, 2, 3):
                validate(build(name, p, v, k * p))


def test_activations_in_flight():
    p, v, m = 4, 2, 8
    assert validate(one_f_one_b(p, m)).peak_in_flight == tuple(min(p - s, m) for s in range(p))
    assert validate(gpipe(p, m)).peak_in_flight == (m,) * p
    assert validate(interleaved_1f1b(p, v, m)).peak_in_flight == tuple(2 * (p - s - 1) + (v - 1) * p + 1
                                                                       for s in range(p))
    # the overlapped schedule holds one more: the extra warm-up forward that frees its pairs from each other
    assert validate(overlapped_1f1b(p, v, m)).peak_in_flight == tuple(2 * (p - s - 1) + (v - 1) * p + 2
                                                                      for s in range(p))
    # memory from the simulator agrees with the count when each chunk holds 1/v of a stage's activations
    r = simulate(interleaved_1f1b(p, v, m), StageCosts.uniform(p, v, activation=1.0))
    assert r.peak_activation == pytest.approx([n / v for n in validate(r.schedule).peak_in_flight])


def steady_steps(schedule, stage):
    """Adjacent (forward, backward) of the steady state: the candidates for fusing."""
    acts = schedule.actions[stage]
    first_b = next(i for i, a in enumerate(acts) if a.kind is Kind.B)
    return [i for i in range(first_b - 1, len(acts) - 1, 2) if acts[i].kind is Kind.F and acts[i + 1].kind is Kind.B]


@pytest.mark.parametrize("p,v,m", [(4, 2, 8), (4, 3, 8), (4, 4, 16), (8, 2, 16), (3, 2, 6), (4, 1, 8)])
def test_overlapped_fuses_every_steady_step_of_different_microbatches(p, v, m):
    s = overlapped_1f1b(p, v, m)
    for stage in range(p):
        assert sorted(s.pairs[stage]) == steady_steps(s, stage), stage
        for f, b in (slot for slot in s.slots(stage) if len(slot) == 2):
            assert f.kind is Kind.F and b.kind is Kind.B and f.microbatch != b.microbatch


def test_overlapped_pairs_of_two_chunks_on_four_stages():
    # Megatron's runs of p passes of one chunk, their offset shifted by two passes per stage: 16 of the 32
    # steady-state pairs hold two different chunks (counted by hand from the stage lists), the rest one chunk
    s = overlapped_1f1b(4, 2, 8)
    assert [len(s.pairs[stage]) for stage in range(4)] == [5, 7, 9, 11]
    assert [sum(s.actions[stage][i].chunk != s.actions[stage][i + 1].chunk for i in s.pairs[stage])
            for stage in range(4)] == [2, 6, 6, 2]


def test_overlap_hides_communication():
    p, v, m = 4, 2, 8
    step = {}
    for n in ("1f1b", "interleaved", "overlapped"):
        s = build(n, p, v, m)  # the same work per stage, split over the schedule's chunks
        step[n] = simulate(s, StageCosts.uniform(p, s.chunks, p2p=0.05, comm_fraction=0.3)).step_time
    assert step["overlapped"] < step["interleaved"] < step["1f1b"]
    no_comm = StageCosts.uniform(p, v)
    assert simulate(build("overlapped", p, v, m), no_comm).step_time == pytest.approx(
        simulate(build("interleaved", p, v, m), no_comm).step_time)


def test_p2p_latency_by_hand():
    # 2 stages, 1 micro-batch: F on s0 (1), send, F on s1 (1), B on s1 (2), send, B on s0 (2)
    costs = StageCosts(((1.0,), (1.0,)), ((2.0,), (2.0,)), p2p=0.25)
    r = simulate(gpipe(2, 1), costs)
    assert r.step_time == pytest.approx(6.5)
    assert r.bubble_ratio == pytest.approx(1 - (6.0 + 0.5) / (2 * 6.5))  # blocking sends count as exposed comm


def test_async_p2p_by_hand():
    # as above, but the sends run on their own stream: the same latency, yet the compute stream is free meanwhile,
    # and each transfer is an interval of the timeline
    acts = (Action(Kind.F, 0), Action(Kind.B, 0))
    costs = StageCosts(((1.0,), (1.0,)), ((2.0,), (2.0,)), p2p=0.25)
    r = simulate(Schedule("async", 2, 1, 1, (acts, acts), async_p2p=True), costs)
    assert r.step_time == pytest.approx(6.5)
    assert r.exposed_comm == (0.0, 0.0)
    assert r.bubble_ratio == pytest.approx(1 - 6.0 / (2 * 6.5))
    sends = [(iv.stage, iv.start, iv.end, str(iv.actions[0])) for iv in r.intervals if iv.kind == "p2p-async"]
    assert sends == [(0, 1.0, 1.25, "F0"), (1, 4.25, 4.5, "B0")]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "overlapped"])
def test_timeline_holds_every_transfer(name):
    p2p = 0.05
    s = build(name, 4, 2, 8)
    r = simulate(s, StageCosts.uniform(4, s.chunks, p2p=p2p, comm_fraction=0.3))
    units = {(iv.stage, a): iv for iv in r.intervals if not iv.kind.startswith("p2p") for a in iv.actions}
    sends = {}
    for iv in r.intervals:
        if iv.kind.startswith("p2p"):
            assert iv.kind == ("p2p-async" if s.async_p2p else "p2p")
            for a in iv.actions:
                sends[(iv.stage, a)] = iv
    received = 0
    for (stage, a), unit in units.items():
        for t, dep in dependencies(s, stage, a):
            if t == stage:
                continue
            send = sends[(t, dep)]  # a transfer for every edge between stages, after its sender, before its receiver
            assert units[(t, dep)].end <= send.start + 1e-12 and send.end <= unit.start + 1e-12
            assert send.end - send.start == pytest.approx(p2p * (1 if s.async_p2p else len(send.actions)))
            received += 1
    assert received == len(sends)  # and no transfer without a receiver
    # transfers on their own stream cost the compute stream nothing: the bubble counts compute and exposed a2a only
    busy = sum(iv.end - iv.start for iv in r.intervals if not iv.kind.startswith("p2p"))
    blocking = sum(iv.end - iv.start for iv in r.intervals if iv.kind == "p2p")
    assert r.bubble_ratio == pytest.approx(1 - (busy + blocking) / (4 * r.step_time))


def test_validator_rejects_broken_schedules():
    ok = one_f_one_b(2, 2)

    def with_stage0(acts, **kw):
        return Schedule("bad", 2, 1, 2, (tuple(acts), ok.actions[1]), **kw)

    F, B = Kind.F, Kind.B
    with pytest.raises(ScheduleError, match="twice"):
        validate(with_stage0([Action(F, 0), Action(F, 0), Action(B, 0), Action(F, 1), Action(B, 1)]))
    with pytest.raises(ScheduleError, match="missing B1"):
        validate(with_stage0([Action(F, 0), Action(F, 1), Action(B, 0)]))
    with pytest.raises(ScheduleError, match="before its forward"):
        validate(with_stage0([Action(F, 0), Action(B, 1), Action(F, 1), Action(B, 0)]))
    with pytest.raises(ScheduleError, match="outside"):
        validate(with_stage0([Action(F, 0), Action(F, 1), Action(B, 0), Action(B, 1), Action(F, 0, 1)]))
    # stage 1 starts with F1, which stage 0 sends only after B0, which needs stage 1's B0: a cycle
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(Schedule("bad", 2, 1, 2, ((Action(F, 0), Action(B, 0), Action(F, 1), Action(B, 1)),
                                           (Action(F, 1), Action(F, 0), Action(B, 0), Action(B, 1)))))
    with pytest.raises(ScheduleError, match="pair"):
        validate(with_stage0([Action(F, 0), Action(F, 1), Action(B, 0), Action(B, 1)],
                             pairs=(frozenset({0}), frozenset())))


def test_builders_reject_bad_sizes():
    with pytest.raises(ScheduleError, match="multiple of the 4 stages"):
        interleaved_1f1b(4, 2, 6)
    with pytest.raises(ScheduleError, match="microbatches: expected a positive integer"):
        one_f_one_b(4, 0)
    with pytest.raises(ScheduleError, match="schedule: expected one of"):
        build("zb", 4, 2, 8)


def test_gantt_png(tmp_path):
    r = simulate(overlapped_1f1b(4, 2, 8), StageCosts.uniform(4, 2, p2p=0.05, comm_fraction=0.3))
    path = tmp_path / "g.png"
    gantt(r, str(path))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000
