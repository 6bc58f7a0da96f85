"""The recipe's profile: section on a real tiny run (MindSpore's profiler around steps 3-4) and
`python -m telechat_moe.profiling`: top operators, phases, host gaps, and each profiled step's total from the profile
within 10% of the step time the trainer measured and logged; bad input as one line and exit code 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from telechat_moe.profiling import Kernel, StepProfile, _graph_phases, phase_of, report
from tests.helpers import assert_one_line_error, run_cli, run_main


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("profiled")
    proc = run_cli("run_train.py", "--recipe", "tiny", "--set", "training.train_steps=4", "--set", "profile.steps=3-4",
                   "--set", f"output_dir={out}", "--set", "training.log_interval=1", "--set", "training.eval_batches=0",
                   "--set", "fusion.save_graphs=true", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def test_profile_report_matches_the_logged_step_time(profiled_run, tmp_path):
    numbers_file = tmp_path / "profile.json"
    proc = run_cli("-m", "telechat_moe.profiling", str(profiled_run / "profile"), "--top", "5",
                   "--json", str(numbers_file))
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    numbers = json.loads(numbers_file.read_text())
    assert [s["step"] for s in numbers["steps"]] == [3, 4]
    assert len(numbers["top_operators"]) == 5 and all(op["total_s"] > 0 for op in numbers["top_operators"])
    assert all(numbers["phases_s_per_step"][ph] > 0 for ph in ("forward", "backward",
                                                               "optimizer+gradient preparation"))
    for s in numbers["steps"]:     # the profile's own total against the trainer's measured step
        assert abs(s["total_s"] / s["trainer_step_s"] - 1) <= 0.10, s
        assert s["kernels_s"] > 0 and s["gaps_s"] >= 0
    # the trainer's times in steps.json are the ones it logged: metrics.jsonl's step_time_s is the running mean of the
    # steps after the first
    logged = {}
    for line in (profiled_run / "logs" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "step_time_s" in rec:
            logged[rec["step"]] = rec["step_time_s"]
    t2 = logged[2]
    t3, t4 = (s["trainer_step_s"] for s in numbers["steps"])
    assert logged[3] == pytest.approx((t2 + t3) / 2, rel=1e-9)
    assert logged[4] == pytest.approx((t2 + t3 + t4) / 3, rel=1e-9)


def test_executed_matmul_flops_join_the_ir_and_match_the_planner(profiled_run):
    """Each profiled step's matmul kernels joined by scope name to the IR dump's shapes (telechat_moe/
    executed_flops.py): every MatMul kernel finds its node, and the sum is the planner's matmul FLOPs for the run."""
    from bench.plan_vs_run import planner_matmul_flops
    from telechat_moe.executed_flops import executed_flops
    from telechat_moe.recipe import load_recipe
    planned = planner_matmul_flops(load_recipe("tiny", []), 0)
    for step in (3, 4):
        got = executed_flops(profiled_run / "profile", profiled_run / "graphs", 0, step)
        print(step, got)
        assert got.unmatched == 0 and got.calls > 0
        assert set(got.by_kind) == {"MatMul", "GroupedMatmul", "GroupedMatmulDx", "GroupedMatmulDw"}
        assert got.flops == pytest.approx(planned, rel=0.05)


def test_grouped_matmul_of_routed_rows_counts_per_row():
    """Under ep the rows a rank receives are data-dependent (-1 in the IR): a grouped matmul's FLOPs per row, then
    the step's routed rows over the ranks' MoE layer executions."""
    from dvm_fusion.report import Node, Tensor
    from telechat_moe.executed_flops import ExecutedFlops, node_flops, with_routed_rows
    fwd = Node("1", "Custom", [], [Tensor("Float32", (-1, 384))], inputs=[Tensor("Float32", (-1, 256)),
                                                                         Tensor("Float32", (8, 256, 384))])
    assert node_flops(fwd, "k.so:GroupedMatmul") == ("GroupedMatmul", 2.0 * 256 * 384, True)
    dw = Node("2", "Custom", [], [Tensor("Float32", (8, 256, 384))], inputs=[Tensor("Float32", (4096, 256)),
                                                                           Tensor("Float32", (4096, 384))])
    assert node_flops(dw, "k.so:GroupedMatmulDw") == ("GroupedMatmulDw", 2.0 * 4096 * 256 * 384, False)
    mm = Node("3", "MatMul", [], [Tensor("Float32", (80, 256))], inputs=[Tensor("Float32", (1024, 80)),
                                                                       Tensor("Float32", (1024, 256))])
    assert node_flops(mm) == ("MatMul", 2.0 * 80 * 256 * 1024, False)       # transpose_a: K = 1024
    ranks = [ExecutedFlops(10.0, 5, {}, 0, per_row=3.0, row_layers=2), ExecutedFlops(10.0, 5, {}, 0, 3.0, 2)]
    assert [r.flops for r in with_routed_rows(ranks, 400.0)] == [10.0 + 3.0 * 100, 10.0 + 3.0 * 100]


def test_profile_report_bad_input_is_one_line(profiled_run, tmp_path):
    assert_one_line_error(run_cli("-m", "telechat_moe.profiling", str(profiled_run / "profile"), "--steps", "2"),
                          "--steps", "step 2 was not profiled", "3,4")
    assert_one_line_error(run_cli("-m", "telechat_moe.profiling", str(profiled_run / "profile"), "--steps", "x"),
                          "--steps")
    assert_one_line_error(run_cli("-m", "telechat_moe.profiling", str(tmp_path)), str(tmp_path), "no profile")
    assert_one_line_error(run_cli("-m", "telechat_moe.profiling", str(tmp_path / "none")), "no such folder")
    (tmp_path / "steps.json").write_text("{not json")
    assert_one_line_error(run_cli("-m", "telechat_moe.profiling", str(tmp_path)), "steps.json")


@pytest.mark.parametrize("value, needle", [("x", "expected step numbers"), ("5-6", "after the last training step")])
def test_profile_steps_of_the_recipe_are_checked(capfd, value, needle):
    proc = run_main(capfd, "--recipe", "tiny", "--set", "training.train_steps=4", "--set", f"profile.steps={value}")
    assert_one_line_error(proc, "profile.steps", needle)


def test_phases_from_scope_names():
    """Gradients/ is the backward, the prepare/optimizer cells and the graphs after the backward the optimizer, an
    expander's op takes the phase of the kernel before it."""
    assert phase_of("Gradients/Default/forward_backward-ForwardBackward/model-TeleChatMoE/Grad_Exp/Mul-op0") == \
        "backward"
    assert phase_of("Default/optimizer-AdamW/AdamWeightDecay-op3") == "optimizer+gradient preparation"
    assert phase_of("Default/prepare-PrepareGradients/Square-op55") == "optimizer+gradient preparation"
    assert phase_of("Default/forward_backward-ForwardBackward/model-TeleChatMoE/MatMul-op1") == "forward"
    assert phase_of("Expand/_SumExt/ReduceSum-op2") is None
    names = ["Default/forward_backward-ForwardBackward/model-M/MatMul-op0", "Expand/_SiLU/Mul-op0",
             "Gradients/Default/forward_backward-ForwardBackward/model-M/Grad_MatMul/MatMul-op0",
             "Expand/_SoftmaxBackward/Sub-op0", "Default/prepare-PrepareGradients/Square-op0",
             "Expand/_SumExt/ReduceSum-op0", "Default/AssignAdd-op0"]
    kernels = [Kernel(n, 10.0 * i, 5.0) for i, n in enumerate(names)]
    step = StepProfile(1, 70e-6, kernels)
    assert _graph_phases(step) == ["forward", "forward", "backward", "backward"] + \
        ["optimizer+gradient preparation"] * 3
    assert step.span_s == pytest.approx(65e-6) and step.busy_s == pytest.approx(35e-6)
    text, numbers = report([step], top=3)
    assert numbers["gaps_s_per_step"] == pytest.approx(30e-6) and "MatMul" in text
