"""The work a pipeline executes, measured from MindSpore's profiler: the matmul kernels of one training step summed
over a pipeline run's ranks against the one-process run's, with recompute off and with full recompute.

    .venv/bin/python -m bench.pipeline_work [--recipe tiny] [--micro 4] [--step 3] [--layout "pp2" ...] [--out DIR]

Each run trains `--step` steps with `profile.steps` at that step (telechat_moe/profiling.py: the kernels that start
inside the step's window, MindSpore's "CPU OP" trace); a kernel is a matmul when its operator type names MatMul
(MatMul, BatchMatMul) or is a hand kernel (ops.Custom: the grouped experts' matmuls), listed per type. The pipeline runs each forward once per micro-batch, so with recompute off its matmul
count equals one process's (the gradient accumulation over micro-batches cuts the same matmuls into m pieces);
with full recompute each layer's forward runs again in its backward, in both runs alike. One process runs the same
micro-batches (`micro_batch_num`) so that both do the same cuts. Runs go one at a time through the tests'
machine-wide msrun lock.

Beside the kernel counts, the matmul FLOPs of the same step summed over the ranks (`fusion.save_graphs`: the
profiler's kernels joined to the IR's shapes, telechat_moe/executed_flops.py) and the planner's figure for the same
layout summed over its stages (bench.plan_vs_run.planner_matmul_flops: 3 x the layers' forward, 4 x under full
recompute: one extra forward of every decoder layer, the MTP blocks' included).
"""
from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.layout_agreement import parse_layout
from bench.plan_vs_run import planner_matmul_flops
from oneline import OneLineParser
from telechat_moe.executed_flops import run_executed_flops
from telechat_moe.profiling import load_steps
from telechat_moe.recipe import load_recipe
from tests.helpers import msrun, run_cli


def matmul_kernels(profile_dir: Path, ranks: int, step: int) -> tuple[int, float, Counter]:
    """(matmul kernels of `step` summed over the ranks, their kernel milliseconds, count per operator type)."""
    count, ms, kinds = 0, 0.0, Counter()
    for rank in range(ranks):
        (prof,) = load_steps(profile_dir, rank, frozenset({step}))
        for k in prof.kernels:
            if "MatMul" in k.op_type or k.op_type.startswith("Custom["):
                count += 1
                ms += k.dur_us / 1e3
                kinds[k.op_type] += 1
    return count, ms, kinds


@dataclass(frozen=True)
class Work:
    """One run's executed work in the profiled step, summed over its ranks, beside the planner's figure."""
    kernels: int
    kernel_ms: float
    kinds: Counter
    flops: float
    planned_flops: float


def run(recipe: str, sets: list[str], world: int, out: Path, step: int) -> Work:
    args = ["run_train.py", "--recipe", recipe]
    for s in [*sets, f"training.train_steps={step}", f"profile.steps={step}", "training.eval_interval=0",
              "training.save_interval=0", "training.log_interval=1", "fusion.save_graphs=true", f"output_dir={out}"]:
        args += ["--set", s]
    if world == 1:
        proc = run_cli(*args, timeout=3600)
        logs = proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        proc, logs = msrun(world, out.parent / f"{out.name}_logs", *args, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"bench.pipeline_work: {out.name} failed (exit {proc.returncode}):\n{logs}")
    resolved = load_recipe(recipe, sets)
    planned = sum(planner_matmul_flops(resolved, stage) for stage in range(resolved.layout.pp))
    return Work(*matmul_kernels(out / "profile", world, step),
                sum(r.flops for r in run_executed_flops(out, world, step)), planned)


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m bench.pipeline_work", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--step", type=int, default=3)
    ap.add_argument("--layout", action="append", help="a pipeline layout, bench.layout_agreement's tokens "
                    "(repeatable; default 'pp2'), e.g. 'pp2 vpp2 parallel_config.pipeline_scheduler=dualpipev'")
    ap.add_argument("--set", action="append", default=[], help="a recipe assignment for every run (repeatable)")
    ap.add_argument("--out", help="keep the runs here (default: a temporary folder, removed)")
    args = ap.parse_args(argv)
    try:
        layouts = [parse_layout(text) for text in args.layout or ["pp2"]]
    except ValueError as e:
        ap.error(str(e))
    root = Path(args.out or tempfile.mkdtemp(prefix="pipeline_work."))
    common = [f"parallel_config.micro_batch_num={args.micro}", *args.set]
    lines = [f"{args.recipe}, {args.micro} micro-batches, step {args.step}: matmul kernels (their kernel ms) and "
             f"matmul GFLOPs per step, summed over the ranks; the planner's matmul GFLOPs for the same layout", "",
             "| recompute | run | kernels | / one process | GFLOPs | / one process | planner | / planner |",
             "|" + " --- |" * 8]
    try:
        for mode, extra in (("none", []), ("full", ["recompute_config.recompute=true"])):
            one = run(args.recipe, common + extra, 1, root / f"one_{mode}", args.step)
            runs = [("one process", one)] + [
                (layout.name, run(args.recipe, common + extra + layout.assignments, layout.world,
                                  root / f"{layout.name.replace(' ', '_').replace('=', '-')}_{mode}", args.step))
                for layout in layouts]
            for name, work in runs:
                lines.append(f"| {mode} | {name} | {work.kernels} ({work.kernel_ms:.0f} ms) | "
                             f"{work.kernels / one.kernels:.3f} | {work.flops / 1e9:.3f} | "
                             f"{work.flops / one.flops:.4f} | {work.planned_flops / 1e9:.3f} | "
                             f"{work.flops / work.planned_flops:.4f} |")
            lines.append("")
            lines += [f"{mode}, {name}: {dict(work.kinds)}" for name, work in runs]
            lines.append("")
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
