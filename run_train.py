"""The one entry point: `python run_train.py --recipe recipes/tiny.yaml [--set key=value ...] [--dry-run] [--resume]`.

Under msrun every process runs this file; the world size and rank come from MindSpore's communication init.
"""
from __future__ import annotations

import fcntl
import os
import re
import signal
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path


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


# ---- msrun: ranks, the scheduler, a peer that stops ---------------------------------------------------------------
class PeerStopped(Exception):
    """This process of an msrun job stopped because another one did; the message is the line the user sees."""


class Terminated(Exception):
    """SIGTERM, raised in the main thread: MindSpore sends it to a worker once the cluster's heartbeat finds a
    process of the job gone (after failing the collectives in flight)."""


# What MindSpore's errors say when a collective or the cluster failed, as opposed to a fault of this process.
COMMUNICATION = re.compile(r"AllReduce|AllGather|ReduceScatter|Broadcast|AlltoAll|collective|cluster|timed out|"
                           r"heartbeat|communicat|Recv|Receiv", re.IGNORECASE)


def under_msrun() -> bool:
    return "MS_WORKER_NUM" in os.environ


def is_scheduler() -> bool:
    """msrun runs this file once more as the cluster's scheduler, whose communication init serves the workers'."""
    return os.environ.get("MS_ROLE") == "MS_SCHED"


def rank_before_init() -> int | None:
    """This process's rank before communication init: 0 outside msrun; msrun's RANK_ID for its workers (exported
    where msrun numbers them, as on one machine); None where MindSpore numbers them at init, and for the scheduler."""
    if not under_msrun():
        return 0
    value = os.environ.get("RANK_ID", "")
    return int(value) if value.isdigit() and not is_scheduler() else None


def distributed_world() -> tuple[int, int]:
    """(rank, world); initialises MindSpore communication when launched by msrun."""
    if not under_msrun():
        return 0, 1
    from mindspore.communication import get_group_size, get_rank, init
    init()
    return get_rank(), get_group_size()


def first_line(text: str) -> str:
    """The first line of a MindSpore error that says something (its messages open with blank and ---- lines)."""
    for line in text.splitlines():
        line = line.replace("[const vector]", "").strip()
        if line and set(line) != {"-"} and not (line.startswith("- ") and line.endswith(":")):
            return line
    return ""


def stop_on_sigterm() -> None:
    """Under msrun, SIGTERM raises Terminated in the main thread instead of ending the process without a word; a
    second one ends it."""
    def raise_terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()
    signal.signal(signal.SIGTERM, raise_terminated)


@contextmanager
def locked_output_dir(path: str, rank: int):
    """An exclusive lock on the output folder for the run's life: a file per rank (`.lock.rank<r>`), so the ranks
    of one msrun job share the folder and a second run into it is refused. The file holds the holder's pid and goes
    when the run ends."""
    from telechat_moe.errors import RecipeError
    lock = Path(path) / f".lock.rank{rank}"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            by = f" (process {holder})" if holder.isdigit() else ""
            raise RecipeError(f"output_dir: {path} is in use by another training run{by}; wait for it to end or "
                              f"choose another output_dir") from None
        try:
            held, now = os.fstat(fd), os.stat(lock)
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                break
        except FileNotFoundError:
            pass
        os.close(fd)       # the holder removed the file between our open and our lock: lock the current one
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    try:
        yield
    finally:
        os.unlink(lock)    # before the release, so that a run which opened the old file retries on a new one
        os.close(fd)


# ---- the run -----------------------------------------------------------------------------------------------------
def check_tokenizer(recipe) -> None:
    """A tokenizer the run would load (data.tokenizer, or one an earlier run trained into output_dir) must fit the
    model's embedding: refused here, not by a Gather index error at step 1."""
    from data_sched.prepare import check_tokenizer_fits, tokenizer_in_use
    path = tokenizer_in_use(recipe.data.tokenizer, recipe.output_dir)
    if path:
        check_tokenizer_fits(path, recipe.model.vocab_size)


def train(recipe, resume: bool) -> None:
    """Configure MindSpore, join the msrun job, train; the output folder locked for the run's life. Under msrun a
    failed collective or init, or MindSpore's SIGTERM, becomes PeerStopped naming this process."""
    from telechat_moe.recipe import validate
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
            from parallel.planner.machine import gemm_flops
            trainer = Trainer(recipe, rank, world, peak_flops=recipe.context.peak_tflops * 1e12 or gemm_flops())
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
    from oneline import InputError
    from telechat_moe.errors import RecipeError
    from telechat_moe.recipe import check_trainable, launched_processes, load_recipe
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
