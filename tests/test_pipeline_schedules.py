"""Schedules, validator and simulator against pipeline theory.

Formulas the tests hold the simulator to (uniform stages, free communication):
- 1F1B bubble = (p-1) / (m + p-1)
- interleaved 1F1B with v chunks per stage: bubble = (p-1) / (v*m + p-1)
- activations in flight on stage s: 1F1B min(p-s, m); interleaved 2(p-s-1) + (v-1)p + 1 when m > p (its warm-up
  plus the one in steady state).
- DualPipeV (2p virtual stages in a V on p stages, per-chunk passes F and B): idle (p-1)(F + 2B) per stage, DeepSeek's
  (PP/2-1)(F&B + B - 3W) with W = 0 and F&B = F + B (see test_dualpipev_bubble); 2p + 1 chunk activations in flight
  on every stage (DeepSeek's PP + 1).
"""
from __future__ import annotations

import os

import pytest

from parallel.pipeline.schedules import (Action, ChunkLayout, Kind, Schedule, ScheduleError, build, dependencies,
                                         dualpipe_v, dualpipe_v_unfit, gpipe, interleaved_1f1b, one_f_one_b,
                                         overlapped_1f1b, validate)
from parallel.pipeline.simulator import StageCosts, dualpipe_v_bubble, gantt, simulate, theoretical_bubble

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


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "overlapped", "dualpipev"])
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


# ---- DualPipeV ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_chunk_layouts_map_virtual_stages_both_ways(p):
    interleaved, v_shape = build("interleaved", p, 2, 2 * p), build("dualpipev", p, 2, 2 * p)
    assert v_shape.chunk_layout is ChunkLayout.V
    for s in range(p):
        assert (interleaved.virtual_stage(s, 0), interleaved.virtual_stage(s, 1)) == (s, p + s)
        # down the stages with chunk 0, back up with chunk 1: stage 0 holds the first and the last slice
        assert (v_shape.virtual_stage(s, 0), v_shape.virtual_stage(s, 1)) == (s, 2 * p - 1 - s)
    for sched in (interleaved, v_shape, build("interleaved", p, 3, 3 * p)):
        assert sorted(sched.virtual_stage(s, c) for s in range(p) for c in range(sched.chunks)) == \
            list(range(p * sched.chunks))
        for s in range(p):
            for c in range(sched.chunks):
                assert sched.stage_and_chunk(sched.virtual_stage(s, c)) == (s, c)
    # the turn: chunk 1 of stage p-1 takes its input from chunk 0 of the same stage, and hands its gradient back
    assert dependencies(v_shape, p - 1, Action(Kind.F, 0, 1)) == [(p - 1, Action(Kind.F, 0, 0))]
    assert dependencies(v_shape, p - 1, Action(Kind.B, 0, 0))[0] == (p - 1, Action(Kind.B, 0, 1))
    assert dependencies(v_shape, 0, Action(Kind.B, 0, 1)) == [(0, Action(Kind.F, 0, 1))]  # the loss on stage 0


def test_dualpipev_order_is_deepseeks():
    """Devices 0 and 3 of the DualPipeV figure (github.com/deepseek-ai/DualPipe, images/dualpipev.png: 4 devices,
    10 micro-batches), their weight passes W dropped (folded into the backwards); x.1 is chunk 1, a+b one
    overlapped unit. Device 3's first F4 and B0.1 stay apart: both feed its own next unit."""
    s = dualpipe_v(4, 10)
    order = [" ".join("+".join(map(str, slot)) for slot in s.slots(stage)) for stage in (0, 3)]
    assert order[0] == ("F0 F1 F2 F3 F4 F5 F6 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 F7+B3.1 F4.1+B0 F8+B4.1 F5.1+B1 "
                        "F9+B5.1 F6.1+B2 B6.1 F7.1+B3 B7.1 F8.1+B4 B8.1 F9.1+B5 B9.1 B6 B7 B8 B9")
    assert order[1] == ("F0 F0.1 F1 F1.1 F2 F2.1 F3 F3.1 F4 B0.1 F4.1+B0 F5+B1.1 F5.1+B1 F6+B2.1 F6.1+B2 F7+B3.1 "
                        "F7.1+B3 F8+B4.1 F8.1+B4 F9+B5.1 F9.1+B5 B6.1 B6 B7.1 B7 B8.1 B8 B9.1 B9")


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_dualpipev_valid_with_every_pair_across_chunks(p):
    for m in (2 * p, 2 * p + 1, 3 * p + 2):
        s = build("dualpipev", p, 2, m)
        report = validate(s)
        assert report.peak_in_flight == (2 * p + 1,) * p  # DeepSeek's PP + 1, the same on every stage
        for stage in range(p):
            fused = [slot for slot in s.slots(stage) if len(slot) == 2]
            # steady state m - 2p + s + 1 rounds of two pairs, one round fewer at the turn, then p-1-s more pairs
            assert len(fused) == 2 * (m - 2 * p + stage + 1) - (stage == p - 1) + (p - 1 - stage)
            assert all(f.kind is Kind.F and b.kind is Kind.B and f.chunk != b.chunk for f, b in fused)


def test_dualpipev_bubble():
    """The simulator's bubble for uniform stages and free communication, forward 1 and backward 2 per stage (each
    chunk half of it), against 1F1B and interleaved 1F1B (v=2) on the same p devices and m micro-batches.

    DeepSeek's DualPipeV bubble is (PP/2-1)(F&B + B - 3W) idle per device for PP = 2p virtual stages and per-chunk
    passes (README of github.com/deepseek-ai/DualPipe). It applies to the F/B model of `dualpipe_v` with W = 0 (no
    split backward, so no weight pass to defer into the bubbles) and F&B = F + B (nothing to hide when communication
    is free): (p-1)(F + 2B) beside 2m(F + B) of compute (`dualpipe_v_bubble`). The simulator gives exactly that when
    F = B, the passes of equal length DeepSeek's figure draws; when B = 2F its event-driven timeline is one chunk
    forward shorter than the formula. Against 1F1B's (p-1)(2F + 2B) DualPipeV idles (p-1)F less; interleaved 1F1B idles
    (p-1)(F + B), less again, but holds 3p-1 chunk activations on stage 0 against DualPipeV's 2p + 1."""
    measured = {}
    for p, m in ((4, 8), (8, 16)):
        for name in ("1f1b", "interleaved", "dualpipev"):
            s = build(name, p, 2, m)
            measured[(name, p, m)] = simulate(s, StageCosts.uniform(p, s.chunks, 1.0, 2.0)).bubble_ratio
    assert measured[("dualpipev", 4, 8)] == pytest.approx(7 / 31)    # 1F1B 3/11 = 27.3%, interleaved 3/19 = 15.8%
    assert measured[("dualpipev", 8, 16)] == pytest.approx(17 / 65)  # 1F1B 7/23 = 30.4%, interleaved 7/39 = 17.9%
    for p, m in ((4, 8), (8, 16)):
        assert measured[("1f1b", p, m)] == pytest.approx(theoretical_bubble(p, m))
        assert measured[("interleaved", p, m)] == pytest.approx(theoretical_bubble(p, m, 2))
        assert measured[("interleaved", p, m)] < measured[("dualpipev", p, m)] < measured[("1f1b", p, m)] - 0.04
    for p in (2, 3, 4, 8):
        for m in (2 * p, 3 * p + 1):
            equal = simulate(dualpipe_v(p, m), StageCosts.uniform(p, 2, 1.0, 1.0))
            assert equal.bubble_ratio == pytest.approx(dualpipe_v_bubble(p, m, 1.0, 1.0))
            assert equal.bubble_ratio < theoretical_bubble(p, m)
            double = simulate(dualpipe_v(p, m), StageCosts.uniform(p, 2, 1.0, 2.0))
            compute = 2 * m * (0.5 + 1.0)
            assert double.step_time - compute == pytest.approx((p - 1) * (0.5 + 2 * 1.0) - 0.5)


def test_dualpipev_pairs_hide_communication():
    """With in-pass communication (30% of compute) DualPipeV's overlapped pairs expose less of it than 1F1B and
    interleaved 1F1B, whose passes wait for all of theirs; the turn on stage p-1 sends nothing."""
    p, m, p2p = 4, 8, 0.05
    result = {}
    for name in ("1f1b", "interleaved", "dualpipev"):
        s = build(name, p, 2, m)
        result[name] = simulate(s, StageCosts.uniform(p, s.chunks, p2p=p2p, comm_fraction=0.3))
    assert result["dualpipev"].exposed_comm_ratio < result["1f1b"].exposed_comm_ratio - 0.05
    assert result["dualpipev"].exposed_comm_ratio < result["interleaved"].exposed_comm_ratio - 0.1
    assert result["dualpipev"].step_time < result["interleaved"].step_time < result["1f1b"].step_time
    sends = [iv for iv in result["dualpipev"].intervals if iv.kind.startswith("p2p")]
    assert len(sends) == 2 * m * (2 * p - 2)  # of 2p-1 hand-overs each way per micro-batch, the turn's is free


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
    with pytest.raises(ScheduleError, match=r"microbatches: DualPipeV needs m >= 2\*p = 8 micro-batches, got m=7"):
        build("dualpipev", 4, 2, 7)
    with pytest.raises(ScheduleError, match="chunks: DualPipeV runs 2 chunks per stage"):
        build("dualpipev", 4, 3, 12)
    with pytest.raises(ScheduleError, match="stages: expected a positive integer"):
        dualpipe_v(0, 8)


def test_dualpipev_rule_is_one_predicate_in_the_callers_names():
    """The builder, the planner's schedule choice and --evaluate share `dualpipe_v_unfit`; each names the sizes."""
    assert dualpipe_v_unfit(4, 2, 8) is None
    assert dualpipe_v_unfit(4, 3, 12)[0] == "chunks" and dualpipe_v_unfit(4, 2, 7)[0] == "microbatches"
    assert dualpipe_v_unfit(16, 2, 16, {"p": "pp", "v": "vpp", "m": "m"}) == (
        "microbatches", "needs m >= 2*pp = 32 micro-batches, got m=16")


def test_gantt_png(tmp_path):
    r = simulate(overlapped_1f1b(4, 2, 8), StageCosts.uniform(4, 2, p2p=0.05, comm_fraction=0.3))
    path = tmp_path / "g.png"
    gantt(r, str(path))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000
