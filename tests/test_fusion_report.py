"""The recipe's fusion: section and `python -m dvm_fusion.report`: a tiny step with graph-kernel fusion (AKG on CPU)
and its IR dumped, the report listing its fused kernels with their operators and the intermediates removed, the
fused run's losses equal to the unfused run's within precision/'s tolerances; the section's MindSpore calls; bad
input as one line and exit code 2."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dvm_fusion.report import fused_kernels, parse_ir
from precision.tolerance import chain_tolerance, relative_error
from telechat_moe.context import fusion_environment, graph_kernel_flags
from telechat_moe.recipe import load_recipe
from telechat_moe.recipe_checks import fusion_on
from tests.helpers import ROOT, assert_one_line_error, run_cli, run_main

# tiny with 2 layers (1 dense, 1 MoE) and short sequences: AKG compiles every fused kernel at the first step
SMALL = ["model.num_hidden_layers=2", "model.seq_length=64", "model.max_position_embeddings=64",
         "model.original_max_position_embeddings=64", "training.global_batch_size=4", "training.train_steps=2",
         "training.log_interval=1", "training.eval_batches=0"]


def train(out: Path, *extra: str) -> tuple[dict[int, dict], int]:
    """(the losses logged per step, the trainable parameters). Run in `out`: AKG writes its kernels
    (akg_kernel_meta/) and logs into the working directory."""
    out.mkdir(parents=True)
    args = [x for a in SMALL + [f"output_dir={out}", *extra] for x in ("--set", a)]
    proc = run_cli(str(ROOT / "run_train.py"), "--recipe", "tiny", *args, timeout=600, cwd=out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    params = int(re.search(r"\[model\] ([\d,]+) trainable parameters", proc.stdout).group(1).replace(",", ""))
    return {r["step"]: r for r in rows if "loss" in r}, params


def test_fused_step_reported_and_equal_to_unfused(tmp_path):
    fused, params = train(tmp_path / "fused", "fusion.graph_kernel=true", "fusion.save_graphs=true")
    plain, _ = train(tmp_path / "plain")
    proc = run_cli("-m", "dvm_fusion.report", str(tmp_path / "fused" / "graphs"), "--json", str(tmp_path / "k.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout[:3000])
    kernels = [k for ks in json.loads((tmp_path / "k.json").read_text()).values() for k in ks]
    assert kernels and all(k["name"].startswith("GraphKernel_") and k["ops"] for k in kernels)
    assert any(len(k["ops"]) >= 2 and k["intermediates"] >= 1 and k["intermediate_bytes"] > 0 for k in kernels)
    assert proc.stdout.startswith(f"{len(kernels)} fused kernels")
    # the fusions change the order of roundings only: the losses within the float32 chain tolerance of the step
    # (assert_losses_match's), the gradient norm also through its sum of squares over every parameter
    tokens = 4 * 64
    for step in (1, 2):
        ks = [tokens] * step
        for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm"):
            rtol = chain_tolerance("float32", ks + ([params] if key == "grad_norm" else [])).rtol
            err = relative_error(fused[step][key], plain[step][key])
            print(f"step {step} {key}: fused {fused[step][key]:.7f} unfused {plain[step][key]:.7f} error {err:.1e} "
                  f"(rtol {rtol:.1e})")
            assert err <= rtol, (step, key, err, rtol)


# A kernel graph as MindSpore 2.9 dumps it (graph_build_*.ir), trimmed: x*y+1 fused, then exp(2*sigmoid(.)).sum()
IR = """# IR entry: @kernel_graph0
subgraph attr:
graph_kernel: Mul_Exp_ReduceSum_fusion
subgraph @seg_b(%para3_Parameter_91) {
  %0(seg_trans_CNode_87) = PrimFunc_Mul(%para3_Parameter_91, Tensor(shape=[], dtype=Float32, value=2)) primitive_attrs
      : (<Tensor[Float32], (4, 8)>, <Tensor[Float32], (), value=...>) -> (<Tensor[Float32], (4, 8)>)
      # Fullname with scope: (Expand/_Muls/Mul-op0)
  %1(seg_trans_CNode_92) = PrimFunc_Exp(%0) primitive_attrs: {IsFeatureMapOutput: Bool(1)}
      : (<Tensor[Float32], (4, 8)>) -> (<Tensor[Float32], (4, 8)>)
      # Fullname with scope: (Default/net-Net/Exp-op0)
  %2(seg_trans_CNode_88) = PrimFunc_ReduceSum(%1, Tensor(shape=[2], dtype=Int64, value=[0 1]))
      : (<Tensor[Float32], (4, 8)>, <Tensor[Int64], (2), value=...>) -> (<Tensor[Float32], ()>)
      # Fullname with scope: (Default/net-Net/ReduceSum-op0)
  Return(%2)
      : (<Tensor[Float32], ()>)
}

subgraph attr:
graph_kernel: Mul_Add_fusion
subgraph @seg_a(%para4_Parameter_94, %para5_Parameter_95) {
  %0(seg_trans_CNode_93) = PrimFunc_Mul(%para4_Parameter_94, %para5_Parameter_95) primitive_attrs: {}
      : (<Tensor[Float16], (4, 8)>, <Tensor[Float16], (4, 8)>) -> (<Tensor[Float16], (4, 8)>)
      # Fullname with scope: (Default/net-Net/Mul-op0)
  %1(seg_trans_CNode_96) = PrimFunc_Add(%0, Tensor(shape=[], dtype=Float32, value=1)) primitive_attrs: {}
      : (<Tensor[Float16], (4, 8)>, <Tensor[Float32], (), value=...>) -> (<Tensor[Float16], (4, 8)>)
      # Fullname with scope: (Default/net-Net/Add-op0)
  %2(CNode_x) = MakeTuple(%0, %1)
      : (<Tensor[Float16], (4, 8)>, <Tensor[Float16], (4, 8)>) -> (<Tuple[Tensor[Float16]*2]>)
  Return(%2)
}

subgraph attr:
subgraph @kernel_graph0() {
  %0(CNode_97) = call @seg_a(%para1_x, %para2_y)
      : (<Tensor[Float16], (4, 8)>, <Tensor[Float16], (4, 8)>) -> (<Tensor[Float16], (4, 8)>)
      # Fullname with scope: (Default/GraphKernel_Mul_Add_fusion-op0)
  %1(CNode_81) = PrimFunc_Sigmoid(%0) primitive_attrs: {IsFeatureMapOutput: Bool(1)}
      : (<Tensor[Float32], (4, 8)>) -> (<Tensor[Float32], (4, 8)>)
      # Fullname with scope: (Default/Sigmoid-op0)
  %2(CNode_98) = call @seg_b(%1)
      : (<Tensor[Float32], (4, 8)>) -> (<Tensor[Float32], ()>)
      # Fullname with scope: (Default/GraphKernel_Mul_Exp_ReduceSum_fusion-op0)
  Return(%2)
}
"""


def test_fused_kernels_of_an_ir_dump():
    """Operators in order; the intermediates are the values only the kernel's own operators read: two float32
    [4, 8] in the first kernel, none in the second (both of its values are outputs)."""
    kernels = {k.name: k for k in fused_kernels(parse_ir(IR, Path("graph_build_0_1.ir")), "graph_build_0_1.ir")}
    assert set(kernels) == {"GraphKernel_Mul_Exp_ReduceSum_fusion-op0", "GraphKernel_Mul_Add_fusion-op0"}
    first = kernels["GraphKernel_Mul_Exp_ReduceSum_fusion-op0"]
    assert first.ops == ["Mul", "Exp", "ReduceSum"] and first.intermediates == 2
    assert first.intermediate_bytes == 2 * 4 * 8 * 4 and first.unknown_shapes == 0
    assert first.scope == "Default/net-Net"
    second = kernels["GraphKernel_Mul_Add_fusion-op0"]
    assert second.ops == ["Mul", "Add"] and second.intermediates == 0


def test_report_bad_input_is_one_line(tmp_path):
    assert_one_line_error(run_cli("-m", "dvm_fusion.report", str(tmp_path)), str(tmp_path), "graph_build_")
    assert_one_line_error(run_cli("-m", "dvm_fusion.report", str(tmp_path / "none")), "no such folder")
    (tmp_path / "graph_build_0_1.ir").write_text("hello\n")
    assert_one_line_error(run_cli("-m", "dvm_fusion.report", str(tmp_path)), "graph_build_0_1.ir",
                          "not a MindSpore IR file")
    (tmp_path / "graph_build_0_1.ir").write_text(IR)
    proc = run_cli("-m", "dvm_fusion.report", str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.startswith("2 fused kernels"), proc.stdout + proc.stderr


def test_fusion_section_maps_to_mindspore_settings(tmp_path):
    r = load_recipe("tiny", ["fusion.graph_kernel=true", "fusion.disable_cluster_ops=[Mul,Add]",
                             "fusion.enable_expand_ops=[SiLU]", "fusion.flags=--opt_level=2",
                             "fusion.save_graphs=true", f"output_dir={tmp_path}"])
    assert fusion_on(r)
    assert graph_kernel_flags(r) == "--enable_expand_ops=SiLU --disable_cluster_ops=Mul,Add --opt_level=2"
    assert fusion_environment(r) == {"MS_DEV_GRAPH_KERNEL_FLAGS": graph_kernel_flags(r), "MS_DEV_SAVE_GRAPHS": "1",
                                     "MS_DEV_SAVE_GRAPHS_PATH": str(tmp_path / "graphs"),
                                     "MS_DEV_DUMP_IR_PASSES": "graph_build"}
    # the defaults set nothing; Ascend's jit_level O1 is DVM's switch, and the old key still turns AKG on
    assert fusion_environment(load_recipe("tiny")) == {} and not fusion_on(load_recipe("tiny"))
    assert fusion_on(load_recipe("105b")) and fusion_on(load_recipe("tiny", ["context.enable_graph_kernel=true"]))


def test_fusion_switch_calls_on_cpu_and_ascend():
    """CPU: fusion.graph_kernel is set_context(enable_graph_kernel=True), a key MindSpore 2.9 accepts; Ascend at
    jit_level O1 makes no call beyond the defaults (O1 is DVM)."""
    from tests.test_context import EIGHT_NODES, record
    cpu = record("tiny", ["fusion.graph_kernel=true"])
    assert cpu["problems"] == [] and ["set_context", {"enable_graph_kernel": True}] in cpu["calls"]
    ascend = record("105b", EIGHT_NODES + ["fusion.graph_kernel=true", "fusion.disable_cluster_ops=[Mul]"])
    assert ascend["problems"] == [] and ascend["deprecated"] == []
    assert [name for name, _ in ascend["calls"] if name == "set_context"] == ["set_context"]


@pytest.mark.parametrize("sets, needle", [
    (["fusion.disable_cluster_ops=[Mul]"], "graph-kernel fusion is off"),
    (["fusion.graph_kernel=true", "fusion.disable_cluster_ops=[1]"], "operator names"),
    (["fusion.graph_kernel=true", "fusion.flags=opt_level"], "graph-kernel flags"),
    (["fusion.graph_kernel=true", "fusion.flags=--disable_cluster_ops=Mul"], "its own key"),
    (["context.device_target=Ascend", "fusion.graph_kernel=true"], "jit_level O1"),
])
def test_fusion_section_errors_are_one_line(capfd, sets, needle):
    proc = run_main(capfd, "--recipe", "tiny", *[x for s in sets for x in ("--set", s)])
    assert_one_line_error(proc, "fusion.", needle)
