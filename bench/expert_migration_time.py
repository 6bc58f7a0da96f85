"""The time dynamic expert placement gains, measured per rank on this CPU: tiny at dp=4 x ep=4 under msrun with a
skewed router, the slowest EP rank's expert kernel time before and after the experts move.

    .venv/bin/python -m bench.expert_migration_time            # about 6 minutes (three msrun jobs of 4 processes)

1. `base`: one training step at dp=4 x ep=4 (the recipe's data, seq --seq, global batch --batch), its checkpoint.
2. Every rank's copy of that checkpoint gets a skewed router: each MoE layer's expert bias (the aux-loss-free bias,
   which only selects experts) raised by --skew on experts 0 .. --hot - 1, all held by EP rank 0 under the static
   placement; bias updates are switched off (`moe_router_bias_update_rate=0`) so the skew stays.
3. Two runs resume from it for --steps steps, both with `expert_placement.interval` --interval: `moves`
   (threshold 0: any predicted gain is taken) and `static` (threshold 1e9: the same decisions planned, none taken).
Each step every rank logs its routed expert kernels' seconds (the CPU grouped-matmul kernels, forward and both
backward GEMMs: `dvm_fusion.grouped_matmul.KERNEL_CLOCK`), gathered over the EP group: the slowest rank's and the
mean (metrics.jsonl `expert_kernel_max_s`, `expert_kernel_mean_s`), beside the max/mean EP-rank load.

Printed: per run, the medians over the steps up to the first decision and over the steps after it, and the ratio;
a PNG of the slowest rank's kernel seconds per step for both runs (--png). 4 processes share 2 cores here: wall
times include waiting for a core, so compare the runs with each other, not with a quiet machine.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from oneline import OneLineParser

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msrun(world: int, logs: Path, sets: list[str], resume: bool, timeout: int) -> None:
    """run_train.py on `world` processes of this machine (the venv's python first on PATH: msrun starts its
    workers with the first python there)."""
    bin_dir = os.path.dirname(sys.executable)
    command = [shutil.which("msrun", path=bin_dir), f"--worker_num={world}", f"--local_worker_num={world}",
               f"--master_port={free_port()}", "--join=True", f"--log_dir={logs}", "--cluster_time_out=120",
               "run_train.py", "--recipe", "tiny", *(["--resume"] if resume else []),
               *[x for s in sets for x in ("--set", s)]]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GLOG_v": "3"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        tails = "".join(p.read_text(errors="replace")[-2000:] for p in sorted(Path(logs).glob("worker_*.log")))
        raise SystemExit(f"msrun failed ({proc.returncode}):\n{tails}")


def skew_checkpoint(run: Path, step: int, world: int, hot: int, skew: float) -> list[str]:
    """Raise every MoE router's expert bias on experts [0, hot) in every rank's checkpoint of `step`."""
    from safetensors.numpy import load_file, save_file
    names = []
    for rank in range(world):
        path = run / "checkpoints" / f"rank_{rank}" / f"step_{step:08d}" / "weights.safetensors"
        tensors = load_file(str(path))
        names = sorted(n for n in tensors if n.endswith("gate.expert_bias") and not n.startswith("adam_"))
        for n in names:
            tensors[n] = tensors[n].copy()
            tensors[n][:hot] += skew
        save_file(tensors, str(path))
    return names


def records(run: Path) -> list[dict]:
    lines = (run / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "expert_kernel_max_s" in r]


def summary(rows: list[dict], first_decision: int) -> dict:
    """Medians over the steps up to the first decision (before any move) and after it."""
    before = [r for r in rows if r["step"] <= first_decision]
    after = [r for r in rows if r["step"] > first_decision]
    med = lambda part, key: statistics.median(r[key] for r in part)   # noqa: E731
    return {part: {key: med(rows_, key) for key in ("expert_kernel_max_s", "expert_kernel_mean_s",
                                                      "expert_max_mean_load")}
            for part, rows_ in (("before", before), ("after", after))}


def plot(runs: dict[str, list[dict]], first_decision: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, rows in runs.items():
        steps = [r["step"] for r in rows]
        top.plot(steps, [r["expert_kernel_max_s"] * 1e3 for r in rows], marker="o", label=f"{name}: slowest rank")
        top.plot(steps, [r["expert_kernel_mean_s"] * 1e3 for r in rows], ls="--", label=f"{name}: mean of ranks")
        bottom.plot(steps, [r["expert_max_mean_load"] for r in rows], marker="o", label=name)
    for ax in (top, bottom):
        ax.axvline(first_decision + 0.5, color="grey", lw=1)
        ax.legend(fontsize=8)
    top.set_ylabel("expert kernel ms per step")
    bottom.set_ylabel("max/mean EP-rank load")
    bottom.set_xlabel("step")
    top.set_title("tiny, dp=4 x ep=4, skewed router: experts moved after the grey line (run 'moves')")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.expert_migration_time", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="output/bench_expert_migration_time", help="working folder (replaced)")
    ap.add_argument("--steps", type=int, default=12, help="steps each run trains after the skewed checkpoint")
    ap.add_argument("--interval", type=int, default=4, help="expert_placement.interval (and its window)")
    ap.add_argument("--hot", type=int, default=4, help="experts the skew favours: 0 .. hot-1 (EP rank 0's)")
    ap.add_argument("--skew", type=float, default=1.0, help="added to their expert bias")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences; 4 per rank at dp=4)")
    ap.add_argument("--png", default="docs/img/expert_migration_time.png")
    args = ap.parse_args(argv)
    out = (ROOT / args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    common = [f"model.seq_length={args.seq}", f"model.max_position_embeddings={args.seq}",
              f"model.original_max_position_embeddings={args.seq}", f"training.global_batch_size={args.batch}",
              "training.log_interval=1", "training.eval_interval=0", "training.save_interval=1",
              "parallel_config.data_parallel=4", "parallel_config.expert_parallel=4",
              "model.moe_router_bias_update_rate=0"]
    base = out / "base"
    msrun(4, out / "logs_base", [*common, "training.train_steps=1", f"output_dir={base}"], False, 900)
    names = skew_checkpoint(base, 1, 4, args.hot, args.skew)
    print(f"[bench] base step trained and its checkpoint skewed: {len(names)} routers' bias +{args.skew} on "
          f"experts 0..{args.hot - 1} ({time.perf_counter() - started:.0f}s)", flush=True)
    runs = {}
    for name, threshold in (("moves", 0), ("static", 1e9)):
        run = out / name
        shutil.copytree(base, run)
        msrun(4, out / f"logs_{name}", [*common, f"training.train_steps={1 + args.steps}",
                                        f"expert_placement.interval={args.interval}",
                                        f"expert_placement.window={args.interval}",
                                        f"expert_placement.threshold={threshold}", f"output_dir={run}"], True, 1800)
        runs[name] = records(run)
        print(f"[bench] {name}: {len(runs[name])} steps ({time.perf_counter() - started:.0f}s)", flush=True)
    first = min(s for s in range(2, 2 + args.steps) if s % args.interval == 0)
    print(f"\nSlowest EP rank's and mean expert kernel time per step (ms, medians), steps 2..{first} (before the "
          f"first decision, after step {first}) and {first + 1}..{1 + args.steps}; max/mean EP-rank load\n")
    print("| run | slowest rank before | after | after / before | mean of ranks before | after | load before "
          "| after | experts moved |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, rows in runs.items():
        s = summary(rows, first)
        b, a = s["before"], s["after"]
        print(f"| {name} | {b['expert_kernel_max_s'] * 1e3:.1f} | {a['expert_kernel_max_s'] * 1e3:.1f} "
              f"| {a['expert_kernel_max_s'] / b['expert_kernel_max_s']:.2f} | {b['expert_kernel_mean_s'] * 1e3:.1f} "
              f"| {a['expert_kernel_mean_s'] * 1e3:.1f} | {b['expert_max_mean_load']:.3f} "
              f"| {a['expert_max_mean_load']:.3f} | {int(rows[-1]['experts_moved'])} |")
    png = ROOT / args.png
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, first, png)
    per_step = {name: [round(r["expert_kernel_max_s"] * 1e3, 1) for r in rows] for name, rows in runs.items()}
    print(f"\nslowest rank's ms per step: {per_step}\n[bench] {png.relative_to(ROOT)}; total "
          f"{time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
