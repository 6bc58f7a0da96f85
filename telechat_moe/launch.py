"""What a training run needs around the trainer: the launch (msrun's ranks and scheduler, a peer that stops), an
exclusive hold on the output folder, and the checks made before MindSpore starts (output folder writable, the
tokenizer fits the model, Ascend present). `run_train.py` wires them; they hold no training logic."""
from __future__ import annotations

import fcntl
import os
import re
import signal
from contextlib import contextmanager
from pathlib import Path

from telechat_moe.errors import RecipeError
from telechat_moe.safetensors_io import write_probe


def check_writable(path: str) -> None:
    try:
        write_probe(Path(path))
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


def check_tokenizer(recipe) -> None:
    """A tokenizer the run would load (data.tokenizer, or one an earlier run trained into output_dir) must fit the
    model's embedding: refused here, not by a Gather index error at step 1."""
    from data_sched.prepare import check_tokenizer_fits, tokenizer_in_use
    path = tokenizer_in_use(recipe.data.tokenizer, recipe.output_dir)
    if path:
        check_tokenizer_fits(path, recipe.model.vocab_size)
