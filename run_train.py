"""The one entry point: `python run_train.py --recipe recipes/tiny.yaml [--set key=value ...] [--dry-run] [--resume]`.
(`--dry-run --show-parallel`: also how one rank holds each weight and the collectives a step issues.)

Under msrun every process runs this file; the world size and rank come from MindSpore's communication init.
"""
from __future__ import annotations

import os
import sys
from contextlib import ExitStack


def parse_args(argv):
    from oneline import OneLineParser
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True, help="a recipe file, or its name in recipes/ (tiny, 105b, 1t ...)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    ap.add_argument("--dry-run", action="store_true", help="plan and validate only: parameters, FLOPs, memory")
    ap.add_argument("--show-parallel", action="store_true",
                    help="with --dry-run: how each weight is sharded and the collectives a step issues, with bytes")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    args = ap.parse_args(argv)
    if args.show_parallel and not args.dry_run:
        ap.error("--show-parallel needs --dry-run (it plans, it does not train)")
    return args


# ---- the run -----------------------------------------------------------------------------------------------------
def train(recipe, resume: bool) -> None:
    """Configure MindSpore, join the msrun job, train; the output folder locked for the run's life. Under msrun a
    failed collective or init, or MindSpore's SIGTERM, becomes PeerStopped naming this process."""
    from telechat_moe.launch import (COMMUNICATION, PeerStopped, Terminated, distributed_world, first_line,
                                     is_scheduler, locked_output_dir, rank_before_init, stop_on_sigterm, under_msrun)
    from telechat_moe.recipe_checks import validate
    from telechat_moe.trainer import Trainer, configure_mindspore
    rank = rank_before_init()
    who = "msrun scheduler" if is_scheduler() else f"rank {rank if rank is not None else '?'}"
    if under_msrun() and not is_scheduler():
        stop_on_sigterm()
    with ExitStack() as held:
        locked = rank is not None
        if locked:
            held.enter_context(locked_output_dir(recipe.output_dir, rank))
        try:
            configure_mindspore(recipe)     # before communication init: MindSpore fixes the device there
            try:
                rank, world = distributed_world()
            except RuntimeError as e:
                if not under_msrun():
                    raise
                # the scheduler's init serves the cluster until the job ends: its error is the job's
                failed = "the job failed" if is_scheduler() else "msrun communication init failed"
                raise PeerStopped(f"{who}: {failed}: {first_line(str(e))}") from None
            who = f"rank {rank}"
            if not locked:
                held.enter_context(locked_output_dir(recipe.output_dir, rank))
            validate(recipe, world)
            from telechat_moe.metrics import peak_gemm_flops
            trainer = Trainer(recipe, rank, world, peak_flops=recipe.context.peak_tflops * 1e12 or peak_gemm_flops())
            if resume:
                trainer.resume()
            trainer.fit()
        except RuntimeError as e:
            if not under_msrun() or not COMMUNICATION.search(str(e)):
                raise
            raise PeerStopped(f"{who}: stopped because a process of this msrun job stopped ({first_line(str(e))}); "
                              f"see the other workers' logs") from None
        except Terminated:
            raise PeerStopped(f"{who}: terminated by SIGTERM (MindSpore sends it once a process of this msrun job "
                              f"has stopped); see the other workers' logs") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    from dvm_fusion import BLAS_ENVIRONMENT
    for name, value in BLAS_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    from oneline import InputError
    from telechat_moe.errors import RecipeError
    from telechat_moe.launch import PeerStopped, check_tokenizer, check_writable, has_ascend
    from telechat_moe.recipe import load_recipe
    from telechat_moe.recipe_checks import check_trainable, launched_processes
    try:
        recipe = load_recipe(args.recipe, args.set)
        from telechat_moe.dry_run import fit_problem, report
        from telechat_moe.show_parallel import show_parallel
        if args.dry_run:
            print(report(recipe))
            if args.show_parallel:
                print(show_parallel(recipe))
            return 0
        from parallel.planner.machine import total_memory_bytes
        problem = fit_problem(recipe, total_memory_bytes(), has_ascend())
        if problem:
            raise RecipeError(problem)
        check_trainable(recipe, launched_processes(os.environ))
        check_writable(recipe.output_dir)
        check_tokenizer(recipe)
        train(recipe, args.resume)
        return 0
    except InputError as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    except PeerStopped as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Now, without MindSpore's teardown: it would wait ~20 s to unregister from a scheduler that has gone, and
        # MindSpore's SIGTERM may still come meanwhile.
        os._exit(2)


if __name__ == "__main__":
    sys.exit(main())
