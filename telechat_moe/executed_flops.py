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
  buffer, an upper bound. Under expert parallelism the rows a rank receives are data-dependent (the IR's rows are
  -1): such a call counts 2 * K * N per row, times the routed rows the step's dispatches sent (the step log's
  ep_rows_sent, summed over ranks, routed copies plus one pad row per member and exchange) over the MoE layers' forward
  executions of all ranks (`with_routed_rows`): each rank's mean, since over the ranks what they receive is what they
  sent.
The attention core runs inside the FlashAttention kernels (no matmul kernel) and is not counted here.
"""
from __future__ import annotations

import json
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
    per_row: float = 0.0        # grouped-matmul calls of data-dependent rows: their FLOPs per routed row, summed
    row_layers: int = 0         # their MoE layer executions (forward GroupedMatmul calls / 2: gate-up and down)


def node_flops(node: Node, func_name: str = "") -> tuple[str, float, bool] | None:
    """(kind, FLOPs of one call, whether per routed row) of a matmul node; per row for a grouped matmul whose rows
    are data-dependent; None for any other node or one of other unknown shapes."""
    kind = node.op if node.op in MATMULS else func_name.rsplit(":", 1)[-1] if node.op == "Custom" else ""
    if kind not in (*MATMULS, *GROUPED) or len(node.inputs) < 2 or not node.outputs:
        return None
    a, b, out = node.inputs[0].shape, node.inputs[1].shape, node.outputs[0].shape
    if kind in MATMULS:
        return None if any(d < 0 for d in (*a, *b, *out)) else (kind, 2.0 * prod(out) * prod(a[-2:]) / out[-2], False)
    # x (rows, K) @ w (E, K, N) -> (rows, N); dy (rows, N) @ w^T -> (rows, K); x^T @ dy -> dw (E, K, N)
    k_n = out[-2] * out[-1] if kind == "GroupedMatmulDw" else a[1] * out[-1]
    if k_n < 0:
        return None
    return (kind, 2.0 * k_n, True) if a[0] < 0 else (kind, 2.0 * a[0] * k_n, False)


def ir_matmuls(folder: Path) -> dict[str, tuple[str, float, bool]]:
    """Full scope name -> (kind, FLOPs per call or per routed row, per row) of every matmul node of the built kernel graphs under `folder`."""
    files = sorted(folder.rglob(IR_GLOB)) if folder.is_dir() else []
    if not files:
        raise FlopsJoinError(f"{folder}: no {IR_GLOB} (train with --set fusion.save_graphs=true)")
    out: dict[str, tuple[str, float, bool]] = {}
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
    flops, calls, unmatched, by_kind, per_row, forwards = 0.0, 0, 0, {}, 0.0, 0
    for k in prof.kernels:
        got = table.get(k.name)
        if got is None:
            unmatched += k.op_type in MATMULS
            continue
        kind, value, row = got
        calls += 1
        if row:
            per_row += value
            forwards += kind == "GroupedMatmul"
        else:
            flops += value
            by_kind[kind] = by_kind.get(kind, 0.0) + value
    if not calls:
        raise FlopsJoinError(f"{profile_dir}: no kernel of step {step} joins a matmul node of {graphs_dir}")
    return ExecutedFlops(flops, calls, by_kind, unmatched, per_row, forwards // 2)


def with_routed_rows(ranks: list[ExecutedFlops], rows_sent: float, etp: int = 1) -> list[ExecutedFlops]:
    """Each rank's figure with its data-dependent grouped-matmul calls counted at the mean routed rows per MoE layer
    execution: `rows_sent` (the step's ep_rows_sent, summed over ranks) over all ranks' MoE layer executions; under
    expert tensor parallelism each rank's experts run on the rows of its whole etp group (gathered over etp before
    them, parallel/tp/expert.py), etp times what its own exchange received."""
    layers = sum(r.row_layers for r in ranks)
    if not layers:
        return ranks
    rows = rows_sent / layers * etp
    return [ExecutedFlops(r.flops + r.per_row * rows, r.calls, {**r.by_kind, "grouped (routed rows)": r.per_row * rows},
                          r.unmatched, 0.0, r.row_layers) for r in ranks]


def run_executed_flops(out: Path, world: int, step: int, etp: int = 1) -> list[ExecutedFlops]:
    """Each rank's figure of `step` in the run under `out` (trained with `profile.steps` and `fusion.save_graphs`):
    its profile/ joined to its graphs/, the grouped matmuls at the routed rows its logs/metrics.jsonl records for
    the step (`with_routed_rows`)."""
    logged = next(r for r in map(json.loads, (out / "logs" / "metrics.jsonl").read_text().splitlines())
                  if r.get("step") == step and "loss" in r)
    return with_routed_rows([executed_flops(out / "profile", out / "graphs", rank, step) for rank in range(world)],
                            logged.get("ep_rows_sent", 0.0), etp)
