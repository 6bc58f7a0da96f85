"""The matmul FLOPs a training step executed, per rank: the profiler's kernels of the step joined by their full scope
name to the compiled graphs' IR, which gives each kernel's input and output shapes.

MindSpore 2.9's CPU profiler records each kernel launch with its full scope name but no shapes
(telechat_moe/profiling.py); `fusion.save_graphs: true` dumps the built kernel graphs (`graph_build_*.ir`,
dvm_fusion/report.py parses them), where each CNode carries the same "Fullname with scope" and its inputs' and
outputs' abstract shapes. A call's FLOPs, 2 per multiply-add:
- MatMul / BatchMatMul: 2 * |output| * K, with K = |A's last two dims| / output rows: A is (.., M, K) or (.., K, M)
  whichever transpose flag is set, so the transpose flags are respected without reading them;
- our CPU grouped-matmul AOT kernels (ops.Custom `GroupedMatmul`, `GroupedMatmulDx`, `GroupedMatmulDw`): 2 * rows *
  K * N from the static shapes, rows = the routed rows' buffer (tokens * top_k). The kernel multiplies the first
  sum(group_sizes) rows only; dropless routing fills the buffer, so they agree; with capacity drops this is the
  buffer, an upper bound.
The attention core runs inside the FlashAttention kernels (no matmul kernel) and is not counted here.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from pathlib import Path

from dvm_fusion.report import IR_GLOB, Node, parse_ir
from oneline import InputError
from telechat_moe.profiling import load_steps

MATMULS = ("MatMul", "BatchMatMul")
GROUPED = ("GroupedMatmul", "GroupedMatmulDx", "GroupedMatmulDw")


class FlopsJoinError(InputError):
    """A profile and an IR dump that do not join; one line."""


@dataclass(frozen=True)
class ExecutedFlops:
    flops: float                # sum over the step's matmul kernel calls
    calls: int                  # matmul kernel calls in the step
    by_kind: dict               # MatMul / BatchMatMul / GroupedMatmul* -> FLOPs
    unmatched: int              # matmul-typed kernels of the step with no IR node of their name


def node_flops(node: Node, func_name: str = "") -> tuple[str, float] | None:
    """(kind, FLOPs of one call) of a matmul node; None for any other node or one without static shapes."""
    kind = node.op if node.op in MATMULS else func_name.rsplit(":", 1)[-1] if node.op == "Custom" else ""
    if kind not in (*MATMULS, *GROUPED) or len(node.inputs) < 2 or not node.outputs:
        return None
    a, b, out = node.inputs[0].shape, node.inputs[1].shape, node.outputs[0].shape
    if any(d < 0 for d in (*a, *b, *out)):
        return None
    if kind in MATMULS:
        return kind, 2.0 * prod(out) * prod(a[-2:]) / out[-2]
    if kind == "GroupedMatmulDw":        # x (rows, K), dy (rows, N) -> dw (E, K, N)
        return kind, 2.0 * a[0] * out[-2] * out[-1]
    return kind, 2.0 * a[0] * a[1] * out[-1]     # x (rows, K) @ w (E, K, N) / dy (rows, N) @ w^T -> (rows, *)


def ir_matmuls(folder: Path) -> dict[str, tuple[str, float]]:
    """Full scope name -> (kind, FLOPs per call) of every matmul node of the built kernel graphs under `folder`."""
    files = sorted(folder.rglob(IR_GLOB)) if folder.is_dir() else []
    if not files:
        raise FlopsJoinError(f"{folder}: no {IR_GLOB} (train with --set fusion.save_graphs=true)")
    out: dict[str, tuple[str, float]] = {}
    for path in files:
        text = path.read_text(errors="replace")
        funcs = _custom_funcs(text)
        for graph in parse_ir(text, path):
            for node in graph.nodes:
                got = node_flops(node, funcs.get(node.scope, "")) if node.scope else None
                if got is None:
                    continue
                if node.scope in out and out[node.scope] != got:
                    raise FlopsJoinError(f"{path}: {node.scope} has two shapes ({out[node.scope]} and {got})")
                out[node.scope] = got
    return out


def _custom_funcs(text: str) -> dict[str, str]:
    """Full scope name -> func_name of each ops.Custom node (parse_ir keeps nodes' types, not their attributes)."""
    out, func = {}, None
    for line in text.splitlines():
        if " = Custom(" in line and 'func_name: "' in line:
            func = line.split('func_name: "', 1)[1].split('"', 1)[0]
        elif func is not None and "# Fullname with scope: (" in line:
            out[line.split("# Fullname with scope: (", 1)[1].rstrip(")")] = func
            func = None
    return out


def executed_flops(profile_dir: Path, graphs_dir: Path, rank: int, step: int) -> ExecutedFlops:
    """The matmul FLOPs rank `rank` executed in `step`: each kernel call of the step whose name is a matmul node of
    the IR (rank_<rank>/ under `graphs_dir` where there is one), its FLOPs summed."""
    (prof,) = load_steps(profile_dir, rank, frozenset({step}))
    ranked = graphs_dir / f"rank_{rank}"
    table = ir_matmuls(ranked if ranked.is_dir() else graphs_dir)
    flops, calls, unmatched, by_kind = 0.0, 0, 0, {}
    for k in prof.kernels:
        got = table.get(k.name)
        if got is None:
            unmatched += k.op_type in MATMULS
            continue
        flops += got[1]
        calls += 1
        by_kind[got[0]] = by_kind.get(got[0], 0.0) + got[1]
    if not calls:
        raise FlopsJoinError(f"{profile_dir}: no kernel of step {step} joins a matmul node of {graphs_dir}")
    return ExecutedFlops(flops, calls, by_kind, unmatched)
