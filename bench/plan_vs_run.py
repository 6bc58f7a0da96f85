"""The planner's figures beside a run's, per rank: parameters, the bytes held between steps (weights, optimizer
state, gradient buffers), and each kind of collective's bytes in a step, as the comm layer's counters saw them.

    .venv/bin/python -m bench.plan_vs_run [--layout "dp2" --layout "tp2 sp" ...] [--recipe tiny] [--steps 3]
        [--set KEY=VALUE] [--out DIR] [--markdown FILE]

Each layout (bench.layout_agreement's tokens: dpN tpN ppN vppN epN etpN mN sp ...) trains `--steps` steps under msrun
with `profile.collectives: true` (parallel/comm/counters.py: each collective counted as it runs, kind, group and the
bytes of its input) and no held-out evaluation. Measured, per rank: its start-up `[memory]` line (the bytes its
weights, optimizer state and gradient buffers hold as allocated, and its trainable parameters) and its
logs/collectives line of step 2 (the step's own collectives). The planner's, per rank: `cost_model.stage_memory`
(parameters; weights + optimizer + gradient buffers, model_shape.rank_static_bytes) and
`step_traffic.step_collective_bytes` (the cost model's communication terms as bytes) for the rank's pipeline stage
as the trainer cuts the model (dry_run.stage_holdings), the same micro-batches and the same optimizer. A row agrees
within 1%; a kind the planner leaves out (the gradient norm's 4-byte sums) is named. One row per pipeline stage, the
mean over its ranks (each rank's expert exchange receives what routing sends it; together they receive what they
sent). Runs go one at a time through
the tests' machine-wide msrun lock.

Matmul FLOPs per rank and step, within 5%: measured, the FLOPs of the matmul kernels the rank ran in step 2
(`profile.steps=2` and `fusion.save_graphs=true`; telechat_moe/executed_flops.py joins the profiler's kernels to the
IR's shapes by full scope name; under ep, the grouped matmuls at the routed rows the step log's ep_rows_sent
counts); the planner's, the forward FLOPs of every GEMM the cost model prices for a micro-batch
(parallel/planner/blocks.py, counted as it prices them: attention projections as tp splits or replicates them, dense
FFN, router, routed experts at their expected rows, shared expert, head, MTP), 3 x forward (4 x for the decoder layers, MTP's
included, under full recompute), for the layers of the rank's stage and its micro-batches. The attention core (FlashAttention
kernels) is in neither.
"""
from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.layout_agreement import parse_layout
from oneline import OneLineParser
from parallel.layout import Axis
from parallel.planner.blocks import BlockCosting
from parallel.planner.workload import Layouts
from tests.helpers import msrun, run_cli

LAYOUTS = ("dp2", "tp2 sp", "dp2 ep2", "pp2 m2", "pp2 vpp2 m4", "dp2 tp2 sp", "pp2 dp2 m2", "dp2 tp2 sp ep2 etp2")
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p")
MEMORY = re.compile(r"\[memory\] rank (\d+) holds ([\d,]+) bytes .* ([\d,]+) trainable parameters")
WITHIN = 0.01
FLOPS_WITHIN = 0.05
SCALARS = 64        # bytes: a kind whose only difference is this small is the gradient norm's scalar sums


def planner_figures(recipe, rank: int) -> dict:
    """The planner's figures for world rank `rank` of the recipe's layout (module docstring)."""
    from parallel.planner.blocks import block_costs
    from parallel.planner.cost_model import StagePlan, even_stage, stage_memory
    from parallel.planner.step_traffic import step_collective_bytes
    from parallel.planner.workload import Layouts
    from telechat_moe.dry_run import distributed_optimizer, stage_holdings
    from telechat_moe.workload import recipe_layout, recipe_workload
    w = recipe_workload(recipe, "ascend910b")   # bytes only: any cluster whose runtime frees buffers
    lay = Layouts.of(recipe_layout(recipe, w))
    stage = recipe.layout.coords(rank)[Axis.PP]
    holdings = stage_holdings(recipe)
    if holdings is None:
        st = even_stage(w, lay, np.array([stage]))
    else:
        held = holdings[stage]
        dense = sum(1 for layer in held.layers if layer < w.shape.first_k_dense)
        onehot = (np.arange(3)[:, None] == lay.recompute[None]).astype(np.float64)
        st = StagePlan(stage=np.array([stage]), dense_by_mode=onehot * dense,
                       moe_by_mode=onehot * (len(held.layers) - dense), embedding=np.array([float(held.first)]),
                       last=np.array([float(held.last)]), mtp_mode=lay.recompute)
    mem = stage_memory(w, lay, block_costs(w, lay), st)
    out = {"stage": stage, "params": float((mem["dense_params"] + mem["expert_params"])[0]),
           "held": float((mem["weights"] + mem["optimizer"] + mem["grad_buffers"])[0])}
    traffic = step_collective_bytes(w, lay, st, distributed_optimizer(recipe))
    return {**out, **{k: float(np.asarray(v).reshape(-1)[0]) for k, v in traffic.items()}}


class _CountedGemms(BlockCosting):
    """The cost model's block costing, each GEMM's forward FLOPs (2 M K N per group) added up as it is priced: the
    shapes the planner times, tp's split and replicated projections and the experts' routed rows included."""

    def __init__(self, w, lay):
        super().__init__(w, lay)
        self.forward_flops = 0.0

    def gemm(self, M, K, N, groups=1.0):
        self.forward_flops = self.forward_flops + 2.0 * M * K * N * groups
        return super().gemm(M, K, N, groups)


def _block_flops(w, lay, block: str) -> float:
    counted = _CountedGemms(w, lay)
    getattr(counted, block)()
    return float(np.asarray(counted.forward_flops).ravel()[0])


def planner_matmul_flops(recipe, stage: int) -> float:
    """The planner's matmul FLOPs per rank and step on pipeline stage `stage` (module docstring)."""
    from telechat_moe.dry_run import stage_holdings
    from telechat_moe.workload import recipe_layout, recipe_workload
    w = recipe_workload(recipe, "ascend910b")
    lay = Layouts.of(recipe_layout(recipe, w))
    s = w.shape
    holdings = stage_holdings(recipe)
    layers = range(s.num_layers) if holdings is None else sorted(holdings[stage].layers)
    last = holdings is None or holdings[stage].last
    dense = sum(layer < s.first_k_dense for layer in layers)
    moe = _block_flops(w, lay, "moe_layer")
    forward = dense * _block_flops(w, lay, "dense_layer") + (len(layers) - dense) * moe
    tail = _block_flops(w, lay, "head") + (s.mtp_depth * _block_flops(w, lay, "mtp") if s.mtp_depth else 0.0)
    # full recompute reruns every decoder layer's forward in its backward, the MTP blocks' layers too
    # (model.set_recompute; the cost model's mtp_mode)
    full = recipe.recompute_config.mode == "full"
    rerun = forward + (s.mtp_depth * moe if last else 0.0)
    micro_batches = w.global_batch // (recipe.layout.dp * int(lay.mbs[0]))
    return micro_batches * (3 * forward + (3 * tail if last else 0.0) + (rerun if full else 0.0))


def measured_figures(out: Path, logs: str, world: int, step: int, etp: int = 1) -> list[dict]:
    """Each rank's measured figures; "matmul_flops" only where the run was profiled (`profile.steps` and
    `fusion.save_graphs`, as this bench trains), else None."""
    from telechat_moe.collectives_log import read_step
    from telechat_moe.executed_flops import run_executed_flops
    held = {int(r): (int(b.replace(",", "")), int(p.replace(",", ""))) for r, b, p in MEMORY.findall(logs)}
    flops = run_executed_flops(out, world, step, etp) if (out / "profile").is_dir() else None
    rows = []
    for rank in range(world):
        line = read_step(out, rank, step)
        rows.append({"held": held[rank][0], "params": held[rank][1], **{k: line["bytes_by_kind"].get(k, 0)
                                                                       for k in KINDS},
                     "calls": {k: sum(c["calls"] for c in line["collectives"] if c["kind"] == k) for k in KINDS},
                     "matmul_flops": flops[rank].flops if flops else None})
    return rows


def verdict(planned: float, measured: float) -> str:
    if planned == measured:
        return "="
    error = (measured - planned) / planned if planned else float("inf")
    if abs(error) <= WITHIN:
        return f"{100 * error:+.2f}%"
    if abs(measured - planned) <= SCALARS:
        return f"{measured - planned:+.0f} B (norm sums)"
    return f"{100 * error:+.1f}% DIFFERS" if planned else "DIFFERS"


def train(layout, common: list[str], out: Path, steps: int, tokenizer: Path | None) -> str:
    args = ["run_train.py", "--recipe", common[0]]
    for s in [*layout.assignments, *common[1:], f"training.train_steps={steps}", "training.eval_interval=0",
              "training.eval_batches=0", "training.save_interval=0", "training.log_interval=1",
              "profile.collectives=true", "profile.steps=2", "fusion.save_graphs=true", f"output_dir={out}",
              *([f"data.tokenizer={tokenizer}"] if tokenizer else [])]:
        args += ["--set", s]
    if layout.world == 1:
        proc = run_cli(*args, timeout=3600)
        logs = proc.stdout + proc.stderr
    else:
        proc, logs = msrun(layout.world, out.parent / f"{out.name}_logs", *args, cluster_time_out=120, timeout=3600)
        logs = "".join(p.read_text(errors="replace") for p in (out.parent / f"{out.name}_logs").glob("worker_*.log"))
    if proc.returncode != 0:
        raise SystemExit(f"bench.plan_vs_run: {layout.name} failed (exit {proc.returncode}):\n{logs[-4000:]}")
    return logs


# The planner prices tensor parallelism with sequence parallelism only (parallel/planner/workload.py, Layouts: "sp is
# on whenever tp > 1", the layouts it proposes); a run at tp > 1 without it sends all-reduces where that model has
# reduce-scatters and all-gathers, and its rows say so instead of counting as unexplained.
NOT_SP = "the planner prices tp with sequence parallelism; this run has use_seq_parallel: false"


def rows_of(name: str, recipe, measured: list[dict]) -> tuple[list[str], int]:
    """One row per pipeline stage: the planner's figures against the mean over the stage's ranks (a rank's expert
    exchange receives what routing sends it; the stage's ranks together receive what they sent)."""
    lines, differs = [], 0
    not_sp = recipe.layout.tp > 1 and not recipe.layout.sp
    stages: dict[int, list[int]] = {}
    for rank in range(len(measured)):
        stages.setdefault(recipe.layout.coords(rank)[Axis.PP], []).append(rank)
    for stage, ranks in sorted(stages.items()):
        p = planner_figures(recipe, ranks[0])
        cells = [name, str(stage), ",".join(map(str, ranks))]
        for key in ("params", "held", *KINDS):
            m = sum(measured[r][key] for r in ranks) / len(ranks)
            v = verdict(p[key], m)
            if not_sp and key in KINDS and "DIFFERS" in v:
                v = v.replace("DIFFERS", "differs: no sp, see below")
            differs += "DIFFERS" in v
            cells.append(f"{p[key]:,.0f} / {m:,.0f} ({v})" if p[key] or m else "0")
        planned, m = planner_matmul_flops(recipe, stage), sum(measured[r]["matmul_flops"] for r in ranks) / len(ranks)
        error = (m - planned) / planned
        differs += abs(error) > FLOPS_WITHIN
        cells.append(f"{planned / 1e9:.3f} / {m / 1e9:.3f} G ({100 * error:+.2f}%"
                     f"{' DIFFERS' if abs(error) > FLOPS_WITHIN else ''})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines, differs


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m bench.plan_vs_run", description=__doc__.splitlines()[0])
    ap.add_argument("--layout", action="append", help=f"a layout (repeatable; default {', '.join(LAYOUTS)})")
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the table reads step 2)")
    ap.add_argument("--set", action="append", default=[], help="a recipe assignment for every run (repeatable)")
    ap.add_argument("--out", help="keep the runs here (default: a temporary folder, removed)")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps: at least 2 (the table reads step 2)")
    layouts = [parse_layout(text) for text in (args.layout or LAYOUTS)]
    root = Path(args.out or tempfile.mkdtemp(prefix="plan_vs_run."))
    from telechat_moe.recipe import load_recipe
    header = ["layout", "stage", "ranks", "parameters", "held bytes", *KINDS, "matmul FLOPs"]
    lines = [f"{args.recipe}, step 2 of {args.steps}: planner / measured (error); bytes per rank and step, "
             f"collectives by the bytes entering them; matmul FLOPs per rank and step (attention core excluded)", "", "| " + " | ".join(header) + " |",
             "|" + " --- |" * len(header)]
    differs, tokenizer = 0, None
    try:
        for layout in layouts:
            out = root / layout.name.replace(" ", "_")
            logs = train(layout, [args.recipe, *args.set], out, args.steps, tokenizer)
            tokenizer = tokenizer or out / "tokenizer.model"
            recipe = load_recipe(args.recipe, [*args.set, *layout.assignments])
            rows, bad = rows_of(layout.name, recipe, measured_figures(out, logs, layout.world, 2, recipe.layout.etp))
            differs += bad
            lines += rows
            print(rows[-1], file=sys.stderr, flush=True)
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    named = [f"no sp: {NOT_SP}"] if any("no sp, see below" in line for line in lines) else []
    text = "\n".join(lines + ["", *named, f"{differs} figure(s) differ by more than {100 * WITHIN:.0f}% without a "
                                           f"named reason (matmul FLOPs: {100 * FLOPS_WITHIN:.0f}%)"])
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 1 if differs else 0


if __name__ == "__main__":
    raise SystemExit(main())
