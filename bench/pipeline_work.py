"""The work a pipeline executes, measured from MindSpore's profiler: the matmul kernels of one training step summed
over a pipeline run's ranks against the one-process run's, with recompute off and with full recompute.

    .venv/bin/python -m bench.pipeline_work [--recipe tiny] [--micro 4] [--step 3] [--layout "pp2"] [--out DIR]

Each run trains `--step` steps with `profile.steps` at that step (telechat_moe/profiling.py: the kernels that start
inside the step's window, MindSpore's "CPU OP" trace); a kernel is a matmul when its operator type names MatMul
(MatMul, BatchMatMul) or is a hand kernel (ops.Custom: the grouped experts' matmuls), listed per type. The pipeline runs each forward once per micro-batch, so with recompute off its matmul
count equals one process's (the gradient accumulation over micro-batches cuts the same matmuls into m pieces);
with full recompute each layer's forward runs again in its backward, in both runs alike. One process runs the same
micro-batches (`micro_batch_num`) so that both do the same cuts. Runs go one at a time through the tests'
machine-wide msrun lock.
"""
from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path

from oneline import OneLineParser
from telechat_moe.profiling import load_steps
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


def run(recipe: str, sets: list[str], world: int, out: Path, step: int) -> tuple[int, float, Counter]:
    args = ["run_train.py", "--recipe", recipe]
    for s in [*sets, f"training.train_steps={step}", f"profile.steps={step}", "training.eval_interval=0",
              "training.save_interval=0", f"output_dir={out}"]:
        args += ["--set", s]
    if world == 1:
        proc = run_cli(*args, timeout=3600)
        logs = proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        proc, logs = msrun(world, out.parent / f"{out.name}_logs", *args, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"bench.pipeline_work: {out.name} failed (exit {proc.returncode}):\n{logs}")
    return matmul_kernels(out / "profile", world, step)


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m bench.pipeline_work", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--step", type=int, default=3)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="a recipe assignment for every run (repeatable)")
    ap.add_argument("--out", help="keep the runs here (default: a temporary folder, removed)")
    args = ap.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="pipeline_work."))
    common = [f"parallel_config.micro_batch_num={args.micro}", *args.set]
    lines = [f"{args.recipe}, {args.micro} micro-batches, step {args.step}: matmul kernels per step (summed over "
             f"ranks), their kernel ms", "", "| recompute | one process | pp=" + f"{args.pp} | ratio |",
             "| --- | --- | --- | --- |"]
    try:
        for mode, extra in (("none", []), ("full", ["recompute_config.recompute=true"])):
            one = run(args.recipe, common + extra, 1, root / f"one_{mode}", args.step)
            pp = run(args.recipe, common + extra + [f"parallel_config.pipeline_stage={args.pp}"], args.pp,
                     root / f"pp_{mode}", args.step)
            lines.append(f"| {mode} | {one[0]} ({one[1]:.0f} ms) | {pp[0]} ({pp[1]:.0f} ms) | "
                         f"{pp[0] / one[0]:.3f} |")
            lines.append(f"|  | {dict(one[2])} | {dict(pp[2])} | |")
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
