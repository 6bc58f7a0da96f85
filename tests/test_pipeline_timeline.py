"""A measured pipeline step and its simulations (parallel/pipeline/timeline.py), without processes: the executor
programs' simulation agrees with the planner's simulator where their transports agree and with theory on uniform
stages; records of two stages become one timeline whose compute, idle share and chunk costs are what the records say;
the command draws a run's step and refuses bad input in one line."""
from __future__ import annotations

import json

import pytest

from parallel.pipeline.schedules import build
from parallel.pipeline.simulator import StageCosts, simulate, theoretical_bubble
from parallel.pipeline.timeline import StageTimeline, compare, idle_share, measured, measured_costs, \
    simulate_programs
from tests.helpers import assert_one_line_error, run_cli


@pytest.mark.parametrize("name,p,v,m", [("1f1b", 4, 1, 8), ("1f1b", 2, 1, 8), ("interleaved", 4, 2, 8),
                                        ("gpipe", 2, 1, 4), ("gpipe", 2, 2, 4)])
def test_rendezvous_programs_equal_the_simulator_without_transfer_cost(name, p, v, m):
    """With free transfers and the durations the executor orders its programs by (forward 1, backward 2 per
    action), these schedules never find a receiver busy when its input is ready: both simulations give one step,
    and 1F1B's and interleaved 1F1B's bubble is theory's."""
    schedule = build(name, p, v, m)
    costs = StageCosts.uniform(p, v, forward=v, backward=2 * v)
    programs, eager = simulate_programs(schedule, costs), simulate(schedule, costs)
    assert programs.step_time == pytest.approx(eager.step_time)
    if name != "gpipe":
        assert programs.bubble_ratio == pytest.approx(theoretical_bubble(p, m, v))


def test_interleaving_two_stages_pays_for_rendezvous_transfers():
    """At p=2, v=2 each stage sends to the other both ways, and a send waits for the receiver's running action to
    end: on uniform chunks the executor's programs take 63 units where eager sends take 51 (theory's bubble):
    a bubble of 23.8% instead of 5.9%, measured on the real executor too (README)."""
    schedule = build("interleaved", 2, 2, 8)
    costs = StageCosts.uniform(2, 2, forward=2, backward=4)
    programs, eager = simulate_programs(schedule, costs), simulate(schedule, costs)
    assert (programs.step_time, eager.step_time) == (pytest.approx(63.0), pytest.approx(51.0))
    assert eager.bubble_ratio == pytest.approx(theoretical_bubble(2, 8, 2))
    assert programs.bubble_ratio == pytest.approx(1 - 48 / 63)


def test_a_rendezvous_holds_the_sender_where_an_eager_send_does_not():
    """Stage 1's backward is slow: under 1F1B stage 0's second forward output waits for stage 1 to take it."""
    schedule = build("1f1b", 2, 1, 4)
    costs = StageCosts(((1.0,), (1.0,)), ((1.0,), (5.0,)), p2p=0.1)
    programs, eager = simulate_programs(schedule, costs), simulate(schedule, costs)
    assert programs.step_time > eager.step_time
    assert sum(programs.compute) == pytest.approx(sum(eager.compute)) == pytest.approx(4 * (1 + 1 + 1 + 5))


@pytest.mark.parametrize("name,p,v,m", [("1f1b", 4, 1, 8), ("interleaved", 2, 2, 8), ("dualpipev", 2, 2, 4)])
def test_programs_count_activations_and_in_pass_communication_as_the_simulator(name, p, v, m):
    """Activation memory is held from a forward's start to its backward's end in both simulations; with free
    transfers, a chunk's in-pass communication is exposed time of its stage in both (DualPipeV's paired actions
    excepted: the eager simulator overlaps a pair's communication, the executor runs them one after the other)."""
    schedule = build(name, p, v, m)
    costs = StageCosts.uniform(p, v, forward=v, backward=2 * v, comm_fraction=0.25)
    programs, eager = simulate_programs(schedule, costs), simulate(schedule, costs)
    assert programs.peak_activation == eager.peak_activation
    assert sum(programs.exposed_comm) == pytest.approx(m * p * v * 0.25 * 3)
    if name != "dualpipev":
        assert programs.exposed_comm == pytest.approx(eager.exposed_comm)


def test_the_planner_simulates_the_transfers_its_cluster_runs():
    """The CPU cluster's transfers are rendezvous (cluster.Runtime.rendezvous_transfers): the planner's simulation
    of a layout there is the stages' executor programs; Ascend's sends are eager: the event-driven simulator."""
    import dataclasses
    from parallel.layout import ParallelLayout
    from parallel.planner.cluster import load_cluster
    from parallel.planner.simulate import pipeline_costs, simulate_layout
    from parallel.planner.stage_ilp import even_assignment
    from telechat_moe.recipe import load_recipe
    from telechat_moe.workload import recipe_workload
    cpu = recipe_workload(load_recipe("tiny"), "cpu")
    assert cpu.cluster.runtime.rendezvous_transfers
    eager_cluster = dataclasses.replace(cpu.cluster, runtime=dataclasses.replace(cpu.cluster.runtime,
                                                                                 rendezvous_transfers=False))
    assert not load_cluster("ascend910b").runtime.rendezvous_transfers
    layout = ParallelLayout(pp=2, vpp=2, dp=1, micro_batch_num=8)
    for w, run in ((cpu, simulate_programs), (dataclasses.replace(cpu, cluster=eager_cluster), simulate)):
        costs = pipeline_costs(w, layout, even_assignment(w, layout))
        expected = run(build("interleaved", 2, 2, 8), costs)
        assert simulate_layout(w, layout).result.step_time == pytest.approx(expected.step_time)


def _two_stages() -> list[StageTimeline]:
    """1F1B at p=2, m=2 as two ranks might record it (seconds on one clock): stage 0 runs F0 F1 B0 B1, stage 1
    F0 B0 F1 B1; each transfer recorded by both ends, the later arrival's record the shorter."""
    s0 = StageTimeline("1f1b", 2, 1, 2, 0,
                       [["F", 0, 0, 10.0, 11.0], ["F", 1, 0, 11.2, 12.2], ["B", 0, 0, 15.0, 17.0],
                        ["B", 1, 0, 19.5, 21.5]],
                       [["F", 0, 0, 0, 1, True, 11.0, 11.1], ["F", 1, 0, 0, 1, True, 12.2, 14.1],
                        ["B", 0, 1, 1, 0, False, 14.1, 15.0], ["B", 1, 1, 1, 0, False, 17.0, 19.5]],
                       2, 2 * 96)
    s1 = StageTimeline("1f1b", 2, 1, 2, 1,
                       [["F", 0, 0, 11.1, 12.1], ["B", 0, 0, 12.1, 14.0], ["F", 1, 0, 14.1, 15.1],
                        ["B", 1, 0, 15.1, 17.0]],
                       [["F", 0, 0, 0, 1, False, 10.0, 11.1], ["F", 1, 0, 0, 1, False, 14.0, 14.1],
                        ["B", 0, 1, 1, 0, True, 14.0, 15.0], ["B", 1, 1, 1, 0, True, 17.0, 19.5]],
                       1, 96)
    return [s1, s0]     # in any order


def test_records_become_one_timeline_on_a_shared_clock():
    real = measured(_two_stages())
    assert real.step_time == pytest.approx(21.5 - 10.0)            # from the first start to the last end
    assert real.compute == pytest.approx((6.0, 5.8))
    first = min(iv.start for iv in real.intervals)
    assert first == pytest.approx(0.0)
    assert len([iv for iv in real.intervals if iv.kind == "p2p"]) == 8
    assert idle_share(real) == pytest.approx(1 - 11.8 / (2 * 11.5))
    costs = measured_costs(_two_stages())
    assert costs.forward == ((1.0,), (1.0,)) and costs.backward == ((2.0,), pytest.approx((1.9,)))
    # per transfer the shorter end: 0.1, 0.1, 0.9 (both waited), 2.5; the median of four
    assert costs.p2p == pytest.approx((0.1 + 0.9) / 2)
    result = compare(_two_stages())
    assert result.simulated.schedule.name == "1f1b" and result.measured_idle == pytest.approx(idle_share(real))


def test_timelines_of_another_shape_are_refused():
    with pytest.raises(ValueError, match="one per stage"):
        measured(_two_stages()[:1])


def test_the_command_draws_a_step_and_refuses_bad_input_in_one_line(tmp_path):
    folder = tmp_path / "run" / "logs" / "pipeline_timeline"
    folder.mkdir(parents=True)
    for rank, stage in enumerate(sorted(_two_stages(), key=lambda t: t.stage)):
        line = {"step": 3, "rank": rank, "pipeline": 0, **stage.to_json(), "max_rss_bytes": 2 ** 30}
        (folder / f"rank_{rank}.jsonl").write_text(json.dumps(line) + "\n")
    proc = run_cli("-m", "scripts.pipeline_timeline", str(tmp_path / "run"), "--png-dir", str(tmp_path / "png"))
    assert proc.returncode == 0, proc.stderr
    assert "idle share: measured 48.7%" in proc.stdout, proc.stdout
    assert (tmp_path / "png" / "measured.png").stat().st_size > 5000
    assert (tmp_path / "png" / "simulated.png").stat().st_size > 5000
    for args, needle in (([str(tmp_path / "nowhere")], "no pipeline timeline"),
                         ([str(tmp_path / "run"), "--step", "2"], "--step 2"),
                         ([str(tmp_path / "run"), "--pipeline", "4"], "--pipeline 4")):
        assert_one_line_error(run_cli("-m", "scripts.pipeline_timeline", *args), needle)
