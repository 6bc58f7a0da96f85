"""Training throughput on this CPU: tokens/s and CPU-MFU for tiny.yaml and small.yaml.

MFU = achieved model FLOP/s (training FLOPs per token from the planner's counter x tokens/s) / the fp32 GEMM FLOP/s
of this machine, measured in the same run right before and after each recipe (these machines are noisy, so only
side-by-side ratios mean anything). Peak memory is the process's peak resident set.

    .venv/bin/python -m bench.train_throughput [--recipes tiny small] [--steps 8]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from oneline import OneLineParser
from parallel.planner.machine import gemm_flops
from parallel.planner.model_shape import flops_per_token
from telechat_moe.recipe import load_recipe


def measure(name: str, steps: int) -> dict:
    from telechat_moe.trainer import Trainer, configure_mindspore
    with tempfile.TemporaryDirectory() as out:
        recipe = load_recipe(name, [f"output_dir={out}"])
        configure_mindspore(recipe)
        peak_before = gemm_flops()
        trainer = Trainer(recipe, peak_flops=peak_before)
        trainer.train_step(trainer.loader.batch_at(0, 0))          # compile
        times = []
        for i in range(steps):
            start = time.perf_counter()
            trainer.train_step(trainer.loader.batch_at(0, 1 + i))
            times.append(time.perf_counter() - start)
        peak_after = gemm_flops()
    step = sorted(times)[len(times) // 2]
    tokens = recipe.training.global_batch_size * recipe.model.seq_length
    fpt = flops_per_token(recipe.model.to_model_shape())["training"]
    peak = (peak_before + peak_after) / 2
    return {"recipe": name, "tokens_per_step": tokens, "median_step_s": step, "tokens_per_s": tokens / step,
            "model_gflop_per_s": fpt * tokens / step / 1e9, "gemm_gflop_per_s": peak / 1e9,
            "mfu": fpt * tokens / step / peak, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def main() -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="+", default=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.steps)))
        return 0
    rows = []
    for name in args.recipes:
        # One process per recipe, so that peak memory is that recipe's own.
        cmd = [sys.executable, "-m", "bench.train_throughput", "--one", name, "--steps", str(args.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(line[0][len("RESULT "):]))
    print(f"{'recipe':<8}{'tok/step':>9}{'step s':>9}{'tok/s':>9}{'model GF/s':>12}{'GEMM GF/s':>11}{'MFU':>8}"
          f"{'peak RSS GiB':>14}")
    for r in rows:
        print(f"{r['recipe']:<8}{r['tokens_per_step']:>9}{r['median_step_s']:>9.3f}{r['tokens_per_s']:>9.0f}"
              f"{r['model_gflop_per_s']:>12.1f}{r['gemm_gflop_per_s']:>11.1f}{100 * r['mfu']:>7.1f}%"
              f"{r['peak_rss_gib']:>14.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
