"""The one entry point: `python run_train.py --recipe recipes/tiny.yaml [--set key=value ...] [--dry-run] [--resume]`.

Under msrun every process runs this file; the world size and rank come from MindSpore's communication init.
"""
from __future__ import annotations

import os
import sys


def parse_args(argv):
    from oneline import OneLineParser
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True, help="a recipe file, or its name in recipes/ (tiny, 105b, 1t ...)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    ap.add_argument("--dry-run", action="store_true", help="plan and validate only: parameters, FLOPs, memory")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    return ap.parse_args(argv)


def check_writable(path: str) -> None:
    from telechat_moe.errors import RecipeError
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_probe_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise RecipeError(f"output_dir: {path} is not writable ({e.strerror})") from None


def has_ascend() -> bool:
    """Ascend's driver and CANN toolkit install here; without them MindSpore cannot target the NPU."""
    return bool(os.environ.get("ASCEND_HOME_PATH")) or os.path.isdir("/usr/local/Ascend")


def distributed_world() -> tuple[int, int]:
    """(rank, world); initialises MindSpore communication when launched by msrun."""
    if "MS_WORKER_NUM" not in os.environ:
        return 0, 1
    from mindspore.communication import get_group_size, get_rank, init
    init()
    return get_rank(), get_group_size()


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    from oneline import InputError
    from telechat_moe.errors import RecipeError
    from telechat_moe.recipe import check_trainable, launched_processes, load_recipe, validate
    try:
        recipe = load_recipe(args.recipe, args.set)
        from telechat_moe.dry_run import fit_problem, report
        if args.dry_run:
            print(report(recipe))
            return 0
        from parallel.planner.machine import total_memory_bytes
        problem = fit_problem(recipe, total_memory_bytes(), has_ascend())
        if problem:
            raise RecipeError(problem)
        check_trainable(recipe, launched_processes(os.environ))
        check_writable(recipe.output_dir)
        from telechat_moe.trainer import Trainer, configure_mindspore
        configure_mindspore(recipe)     # before communication init: MindSpore fixes the device there
        rank, world = distributed_world()
        validate(recipe, world)
        from parallel.planner.machine import gemm_flops
        trainer = Trainer(recipe, rank, world, peak_flops=recipe.context.peak_tflops * 1e12 or gemm_flops())
        if args.resume:
            trainer.resume()
        trainer.fit()
        return 0
    except InputError as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
