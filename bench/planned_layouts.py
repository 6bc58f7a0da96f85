"""Does the trainer take what the planner proposes? `python -m bench.planned_layouts --recipe 1t --devices 4096`.

Runs the planner's search (`python -m telechat_moe.plan`'s, same workload), writes each of the top layouts as a
recipe the way `--write` does, loads it through the trainer's loader and asks, as one process would: the trainer's
checks (`check_trainable`, which must refuse only the process count) and the dry run's per-device static memory
(weights, gradients, optimizer states, gradients held between micro-batches) against the recipe's
`context.max_device_memory_gb`. One row per layout; exit code 1 when any layout fails either.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from parallel.planner.report import layout_text, write_recipe
from parallel.planner.search import SearchSpace
from telechat_moe.dry_run import GIB, static_memory
from telechat_moe.plan import read_recipe, run_search
from telechat_moe.recipe import RecipeError, load_recipe
from telechat_moe.recipe_checks import check_trainable
from telechat_moe.workload import recipe_workload


def trainer_answer(recipe) -> str:
    """'ok' when one process with this layout stops only at the process count, else the trainer's refusal."""
    try:
        check_trainable(recipe, 1 if recipe.layout.world_size > 1 else 2)
    except RecipeError as e:
        text = str(e)
        return "ok" if "process" in text and "launched" in text else text
    return "ok"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.planned_layouts", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="1t")
    ap.add_argument("--devices", type=int, default=4096)
    ap.add_argument("--cluster", default="ascend910b")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args(argv)
    recipe, path = read_recipe(args.recipe)
    w = recipe_workload(recipe, args.cluster, args.devices)
    _, candidates = run_search(w, SearchSpace(), args.top)
    cap = recipe.context.max_device_memory_gb
    print(f"{'#':>3}  {'layout':<78} {'schedule':<11} {'planner GiB':>11} {'dry run static GiB':>18} "
          f"{'cap':>5}  trainer")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, c in enumerate(candidates[:args.top], 1):
            out = Path(tmp) / f"planned_{i}.yaml"
            write_recipe(str(out), path, c, w, "bench.planned_layouts")
            planned = load_recipe(str(out))
            static = static_memory(planned)["total"] / GIB
            answer = trainer_answer(planned)
            fits = not cap or static <= cap
            failed += answer != "ok" or not fits
            print(f"{i:>3}  {layout_text(c.layout):<78} {c.schedule:<11} {c.scores['memory'] / GIB:>11.2f} "
                  f"{static:>18.2f} {cap:>5}  {answer}{'' if fits else ', DOES NOT FIT'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
