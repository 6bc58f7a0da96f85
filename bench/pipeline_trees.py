"""One pipeline layout trained by two checkouts (before and after a change), alternating, on this machine: each run's
step time (the trainer's) and its pipeline step measured against the simulator (scripts/pipeline_timeline, run from
the run's own checkout), so a before/after pair is measured side by side in one session.

    .venv/bin/python -m bench.pipeline_trees --tree BEFORE_DIR --tree . --layout "pp2 vpp2 m8" [--layout "pp4 m8"]
        [--steps 8] [--rounds 2] [--recipe tiny] [--out DIR]

A checkout is a folder with run_train.py (e.g. `git worktree add --detach DIR COMMIT`, its .venv and ../shared as
this one's); each run uses that folder's code (PYTHONPATH and working directory) and this interpreter. Layouts
are bench.layout_agreement's tokens. Rounds alternate the trees (round r: every tree once, in order), so that a
load change on the machine reaches both; runs go one at a time through the tests' machine-wide msrun lock. The
table: per layout and tree, every round's steady trainer step (the median of steps 3..--steps, each step's own time;
step 1 compiles, step 2 may still warm up and is shown apart) and the pipeline's measured step at --steps (the
schedule alone, from the timeline), the last round's measured idle share, simulated (rendezvous transfers) and
eager-send idle shares, and the ratio of the trees' median steady steps.

A step's own time comes from metrics.jsonl (every step logged): its `step_time_s` is the mean of the steps since the
first, over the last WINDOW of them (telechat_moe/metrics.py), so step n's own time is the difference of two
consecutive sums; --steps stays within the window so that no step leaves it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.layout_agreement import parse_layout
from oneline import OneLineParser
from tests.helpers import free_port, msrun_environment, one_msrun_at_a_time, run_cli

WINDOW = 20        # the steps metrics.py's step_time_s averages (after the first)
IDLE = re.compile(r"idle share: measured ([\d.]+)%, simulated ([\d.]+)%")
STEP = re.compile(r"step: measured ([\d.]+) s, simulated ([\d.]+) s")
EAGER = re.compile(r"eager sends.*?idle ([\d.]+)%")


def train(tree: Path, world: int, args: list[str], out: Path) -> None:
    """run_train.py of `tree` under msrun with `world` processes (the machine-wide lock held): tests.helpers.msrun
    with the tree's code instead of this checkout's."""
    env = {**os.environ, "GLOG_v": "3", **msrun_environment(), "PYTHONPATH": str(tree)}
    command = [shutil.which("msrun", path=os.path.dirname(sys.executable)), f"--worker_num={world}",
               f"--local_worker_num={world}", f"--master_port={free_port()}", "--join=True",
               f"--log_dir={out}_logs", "--cluster_time_out=120", "run_train.py", *args]
    with one_msrun_at_a_time():
        proc = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=str(tree), env=env)
    if proc.returncode != 0:
        logs = "".join(p.read_text(errors="replace")[-2000:] for p in Path(f"{out}_logs").glob("worker_*.log"))
        raise SystemExit(f"bench.pipeline_trees: {out.name} failed (exit {proc.returncode}):\n{logs}")


def own_step_times(records: list[dict]) -> dict[int, float]:
    """Step n (>= 2) -> its own time, from the logged means of steps 2..n (module docstring)."""
    means = {r["step"]: r["step_time_s"] for r in records if "step_time_s" in r}
    return {n: (n - 1) * means[n] - (n - 2) * means[n - 1] if n > 2 else means[2]
            for n in sorted(means) if n >= 2}


def measure(tree: Path, out: Path, step: int) -> dict:
    """The trainer's steady step and step 2's time, and the timeline report of `step` (from `tree`'s own
    scripts.pipeline_timeline)."""
    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    own = own_step_times(records)
    step_time = statistics.median(t for n, t in own.items() if n >= 3)
    report = run_cli("-m", "scripts.pipeline_timeline", str(out), "--step", str(step), "--png-dir",
                     str(out / "png"), env={"PYTHONPATH": str(tree)}, cwd=tree)
    if report.returncode != 0:
        raise SystemExit(f"bench.pipeline_trees: the timeline of {out} failed:\n{report.stderr[-2000:]}")
    idle, step_line, eager = IDLE.search(report.stdout), STEP.search(report.stdout), EAGER.search(report.stdout)
    return {"step_time": step_time, "second": own[2], "pipeline_step": float(step_line[1]), "idle": float(idle[1]),
            "simulated_idle": float(idle[2]), "eager_idle": float(eager[1])}


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m bench.pipeline_trees", description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="a checkout (repeatable; first = before)")
    ap.add_argument("--layout", action="append", required=True, help="e.g. 'pp2 vpp2 m8' (repeatable)")
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help="keep the runs here (default: a temporary folder, removed)")
    args = ap.parse_args(argv)
    if not 3 <= args.steps <= WINDOW + 1:
        ap.error(f"--steps: 3 to {WINDOW + 1} (a steady step after step 2, every step within the logged mean)")
    trees = [Path(t).resolve() for t in args.tree]
    for t in trees:
        if not (t / "run_train.py").is_file():
            ap.error(f"--tree {t}: no run_train.py there")
    layouts = [parse_layout(text) for text in args.layout]
    root = Path(args.out or tempfile.mkdtemp(prefix="pipeline_trees."))
    results: dict[tuple[int, int], list[dict]] = {}
    try:
        for r in range(args.rounds):
            for li, layout in enumerate(layouts):
                for ti, tree in enumerate(trees):
                    out = root / f"l{li}_t{ti}_r{r}"
                    shutil.rmtree(out, ignore_errors=True)
                    # every step logged: each step's own time from the logged means (own_step_times)
                    sets = [*layout.assignments, f"training.train_steps={args.steps}", "training.log_interval=1",
                            "training.eval_interval=0", "training.save_interval=0", f"output_dir={out}"]
                    print(f"[trees] round {r}, {layout.name}, {tree} ...", flush=True)
                    train(tree, layout.world, ["--recipe", args.recipe, *[x for s in sets for x in ("--set", s)]],
                          out)
                    results.setdefault((li, ti), []).append(measure(tree, out, args.steps))
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.recipe}, {args.steps} steps, {args.rounds} rounds alternating the trees\n")
    print("| layout | tree | steady step per round (s) | step 2 (s) | pipeline step (s) | idle measured | simulated "
          "(rendezvous) | eager sends |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for li, layout in enumerate(layouts):
        medians = []
        for ti, tree in enumerate(trees):
            runs = results[(li, ti)]
            last = runs[-1]
            medians.append(statistics.median(x["step_time"] for x in runs))
            times = ", ".join(f"{x['step_time']:.3f}" for x in runs)
            second = ", ".join(f"{x['second']:.3f}" for x in runs)
            pipeline = ", ".join(f"{x['pipeline_step']:.3f}" for x in runs)
            print(f"| {layout.name} | {tree.name} | {times} | {second} | {pipeline} | {last['idle']:.1f}% | "
                  f"{last['simulated_idle']:.1f}% | {last['eager_idle']:.1f}% |")
        print(f"| {layout.name} | median steady step, {trees[-1].name} / {trees[0].name} | "
              f"{medians[-1] / medians[0]:.2f}x | | | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
