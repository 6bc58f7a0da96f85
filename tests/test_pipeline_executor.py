"""The multi-process pipeline executor (parallel/pipeline/executor.py) under msrun with 2 processes (CPU transport):
1F1B at pp=2, interleaved 1F1B at pp=2 x v=2 and GPipe at pp=2, m=4, on a tiny MLP. The losses and every chunk's
accumulated gradients equal the one-process model's, each rank runs exactly its stage's actions in the schedule's
order, and it never holds more activations than the validator allows (GPipe all m, 1F1B p - stage: the bytes
measured follow); the two stages' recorded timelines make one measured timeline and its simulation
(parallel/pipeline/timeline.py). Plus the pure check of the transfer order: on every pair of stages both ends issue
the same transfers in the same order."""
from __future__ import annotations


import pytest

from parallel.pipeline.executor import Compute, Transfer, program
from parallel.pipeline.schedules import build
from parallel.pipeline.timeline import StageTimeline, compare
from tests.helpers import run_workers


@pytest.mark.parametrize("name,p,v,m", [("1f1b", 2, 1, 4), ("interleaved", 2, 2, 4), ("1f1b", 4, 1, 8),
                                        ("interleaved", 4, 2, 8), ("overlapped", 4, 2, 8), ("gpipe", 3, 2, 3)])
def test_every_pair_issues_its_transfers_in_one_order(name, p, v, m):
    schedule = build(name, p, v, m)
    programs = [program(schedule, s) for s in range(p)]
    for s in range(p):
        assert [e.action for e in programs[s] if isinstance(e, Compute)] == list(schedule.actions[s])
        for t in range(s + 1, p):
            mine = [e for e in programs[s] if isinstance(e, Transfer) and {e.src, e.dst} == {s, t}]
            theirs = [e for e in programs[t] if isinstance(e, Transfer) and {e.src, e.dst} == {s, t}]
            assert mine == theirs


def test_pipeline_over_two_processes_equals_one_process(tmp_path):
    ranks = run_workers(tmp_path, "pipeline_worker.py", 2)
    for rank, results in enumerate(ranks):
        assert [c["case"] for c in results] == ["1f1b", "interleaved", "gpipe", "dualpipev"]
        for case in results:
            tag = (rank, case["case"])
            assert case["stage"] == rank, tag
            assert case["order"] == case["schedule_order"] and case["order_rerun_equal"], tag
            assert case["peak_in_flight"] <= case["validator_peak"], tag
            assert case["params_checked"] == 4, tag   # 2 of the 4 layers (weight, bias) on each stage
            assert case["sensitivity"] > 100 * case["tolerance"], tag   # a wrong micro-batch set would show
            for pname, err in case["errors"].items():
                print(f"rank {rank} {case['case']}: {pname} {err:.2e} (tolerance {case['tolerance']:.1e})")
                assert err <= case["tolerance"], (tag, pname, err)
            print(f"rank {rank} {case['case']}: peak {case['peak_in_flight']} (validator {case['validator_peak']}), "
                  f"buffered {case['peak_buffered']}, warm step {case['warm_step_s']:.3f}s")
    # the loss sits on the last chunk's stage: stage 1, but stage 0 under DualPipeV's V
    for case in [c for c in ranks[1] if c["case"] != "dualpipev"] + [ranks[0][3]]:
        assert set(case["losses"]) == {"0", "1", "2", "3"}
        assert case["loss_error"] <= case["tolerance"], case["case"]
        assert abs(case["loss_sum"] - case["ref_loss_sum"]) <= case["tolerance"] * abs(case["ref_loss_sum"])
        print(f"{case['case']}: summed loss {case['loss_sum']:.7f} vs one process {case['ref_loss_sum']:.7f}")
    assert not any(c["losses"] for c in ranks[0][:3]) and not ranks[1][3]["losses"]
    activation = 3 * 8 * 4      # one micro-batch's chunk input [B, H] = [3, 8] in float32 (the worker's sizes)
    one_f_one_b, _, gpipe, _ = ranks[0]
    assert (gpipe["peak_in_flight"], one_f_one_b["peak_in_flight"]) == (4, 2)
    for case in [c for r in ranks for c in r]:     # every schedule holds what its validator counts, in bytes too
        assert case["peak_in_flight"] == case["validator_peak"], (case["case"], case["stage"])
        assert case["peak_in_flight_bytes"] == case["peak_in_flight"] * activation, case["case"]
        print(f"stage {case['stage']} {case['case']}: held {case['peak_in_flight_bytes']} B "
              f"= {case['validator_peak']} x {activation} B")
    for i, name in enumerate(("1f1b", "interleaved", "gpipe", "dualpipev")):
        result = compare([StageTimeline.from_json(ranks[s][i]["timeline"]) for s in range(2)])
        actions = [iv for iv in result.measured.intervals if iv.kind in ("F", "B")]
        v = 2 if name in ("interleaved", "dualpipev") else 1
        assert len(actions) == 2 * 4 * v * 2 and all(iv.end >= iv.start >= 0 for iv in actions), name
        assert result.measured.step_time >= max(iv.end for iv in actions) - 1e-9
        assert 0 < result.measured_idle < 1 and 0 <= result.simulated_idle < 1, name
        # the simulation runs the measured chunk times: its compute per stage is theirs, up to the median
        assert result.simulated.step_time >= max(sum(c) for c in result.costs.forward), name
        print(f"{name}: step measured {result.measured.step_time * 1e3:.1f} ms, simulated "
              f"{result.simulated.step_time * 1e3:.1f} ms; idle {100 * result.measured_idle:.0f}% vs "
              f"{100 * result.simulated_idle:.0f}%")
