"""Attention at length: the trainer with `model.attention_kernel` flash against dense, side by side on this CPU.

Each kernel trains the same recipe (tiny by default) at a long sequence, one sequence a step, in a child process of
its own (`run_train.py`, the same seed and batches); per kernel: the child's peak resident set (wait4's ru_maxrss,
the whole run: data, compile, steps, held-out loss, checkpoint), its steady tokens/s, and its losses, which must
agree between the kernels (the same model, only the attention's summation order differs). Dense builds fp32
[heads, s, s] scores per layer; flash never does.

    .venv/bin/python -m bench.attention_memory [--recipe tiny] [--seq 8192] [--steps 3] [--kernels flash,dense]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from oneline import OneLineParser

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"step\s+(\d+)/\d+ \| loss ([\d.]+).*?\| ([\d.]+) tok/s")
HELD_OUT = re.compile(r"held-out lm_loss ([\d.]+)")


def run(recipe: str, kernel: str, seq: int, steps: int, out: Path) -> dict:
    """One training run in a child; its peak RSS (GiB), last tokens/s, losses and held-out loss."""
    sets = {"model.attention_kernel": kernel, "model.seq_length": seq, "model.max_position_embeddings": seq,
            "model.original_max_position_embeddings": seq, "training.global_batch_size": 1,
            "training.train_steps": steps, "training.log_interval": 1, "training.eval_interval": 0,
            "training.save_interval": 0, "output_dir": out / kernel}
    cmd = [sys.executable, "run_train.py", "--recipe", recipe]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if status != 0:
        sys.exit(f"bench.attention_memory: {kernel} failed:\n{text[-3000:]}")
    steps_seen = STEP.findall(text)
    return {"peak_gib": usage.ru_maxrss / 2**20, "tok_s": float(steps_seen[-1][2]),
            "losses": [float(loss) for _, loss, _ in steps_seen], "held_out": float(HELD_OUT.findall(text)[-1])}


def main(argv=None) -> None:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kernels", default="flash,dense")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="attention_memory.") as tmp:
        results = {k: run(args.recipe, k, args.seq, args.steps, Path(tmp)) for k in args.kernels.split(",")}
    print(f"{args.recipe} at seq {args.seq}, global batch 1, {args.steps} steps")
    print(f"{'kernel':8} {'peak RSS GiB':>12} {'tok/s':>7}  losses; held-out")
    for kernel, r in results.items():
        losses = " ".join(f"{x:.4f}" for x in r["losses"])
        print(f"{kernel:8} {r['peak_gib']:12.2f} {r['tok_s']:7.0f}  {losses}; {r['held_out']:.4f}")


if __name__ == "__main__":
    main()
