"""Shared test helpers: running the entry point as a user would (in a fresh process, or in this one through the same
`run_train.main(argv)`), launching jobs under msrun, and checking one-line errors."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT.parent / "shared" / "data" / "corpus"


def run_cli(*args: str, timeout: float = 900, env: dict | None = None, cwd: str | Path | None = None):
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3", **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=str(cwd or ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_msrun_at_a_time():
    """A lock held while an msrun job runs, shared by every test process of the machine (the suite's two xdist
    workers): two jobs of 4 ranks at once put 8 busy processes on 2 cores, and a collective of one waited past
    mccl's receive timeout ("Ring ReduceScatter wait receiving ... failed"). The other worker meanwhile runs
    single-process tests, where two workers gain."""
    import tempfile
    from filelock import FileLock
    return FileLock(os.path.join(tempfile.gettempdir(), "telechat_tests_msrun.lock"))


# MindSpore's cluster polls (workers joining, the job's finish) every few seconds; on one machine a second will do:
# a 4-rank job that only joins and leaves took 17-24 s with MindSpore's intervals and 12-15 s with these, and the
# suite runs about 25 msrun jobs one at a time.
FAST_CLUSTER = {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}


def msrun_environment() -> dict[str, str]:
    """What an msrun job here runs with: the venv's python first on PATH (msrun starts its workers with the first
    python there) and FAST_CLUSTER."""
    return {"PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", **FAST_CLUSTER}


def msrun(world: int, log_dir: Path, *args: str, cluster_time_out: int = 60, env: dict | None = None,
          timeout: float = 1200):
    """`msrun --worker_num=world ... ARGS` on this machine with --join=True, the venv's python first on PATH (msrun
    starts its workers with the first python there) -> (completed process, the tail of every worker's log).
    `timeout` only guards against a hang that cluster_time_out misses: CI's machines have run these jobs at half this
    machine's speed (a 4-rank migration run took over 600 s there)."""
    command = shutil.which("msrun", path=os.path.dirname(sys.executable))
    with one_msrun_at_a_time():
        proc = run_cli(command, f"--worker_num={world}", f"--local_worker_num={world}",
                       f"--master_port={free_port()}", "--join=True", f"--log_dir={log_dir}",
                       f"--cluster_time_out={cluster_time_out}", *args, env={**msrun_environment(), **(env or {})},
                       timeout=timeout)
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in Path(log_dir).glob("worker_*.log"))
    return proc, logs


def run_workers(tmp_path: Path, script: str, world: int) -> list:
    """A worker script of tests/workers/ under msrun; every rank writes `<out>/rank_<r>.json`: their contents."""
    out = tmp_path / "results"
    proc, logs = msrun(world, tmp_path / "logs", str(ROOT / "tests" / "workers" / script), str(out))
    assert proc.returncode == 0, logs
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(world)]


def run_main(capfd, *argv: str) -> subprocess.CompletedProcess:
    """`python run_train.py ARGV` without a new interpreter: the same `run_train.main(argv)` in this process, its
    exit code (a returned one or a SystemExit's, as argparse raises) and what it wrote to file descriptors 1 and 2
    (so output from C code or from handlers holding the old sys.stderr counts as in a subprocess). Only for runs that
    end before MindSpore is configured (dry runs, recipe errors); a run that trains or needs a fresh process uses
    run_cli."""
    import run_train
    capfd.readouterr()                       # drop whatever the test printed before
    cwd = os.getcwd()
    os.chdir(ROOT)                           # run_cli's working directory
    try:
        rc = run_train.main(list(argv))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(cwd)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["run_train.py", *argv], rc, out, err)


def assert_one_line_error(proc, *needles: str) -> str:
    """Exit code 2, exactly one non-empty line on stderr, no traceback, naming what the user got wrong."""
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert proc.returncode == 2, f"rc={proc.returncode}\nstdout:{proc.stdout[-2000:]}\nstderr:{proc.stderr[-3000:]}"
    assert len(lines) == 1, f"expected one line, got:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def assert_losses_match(one: Path, out: Path, steps, label: str) -> None:
    """The losses and gradient norm `out` logged at `steps` equal those of the one-process run `one`, within the
    float32 chain tolerance of precision/ for the steps since the start (or the resume)."""
    from precision.tolerance import chain_tolerance, relative_error
    from tests.test_training import metrics
    tokens = 4 * 64
    first, later = chain_tolerance("float32", [tokens]), chain_tolerance("float32", [tokens, tokens])
    base, logged = metrics(one), metrics(out)
    for step in steps:
        for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm"):
            err = relative_error(logged[step][key], base[step][key])
            print(f"step {step} {key}: one process {base[step][key]:.7f}, {label} {logged[step][key]:.7f}, "
                  f"relative error {err:.2e}")
            assert err <= (first if step == 1 else later).rtol, (label, step, key, err)


def assert_no_divergence(one: Path, out: Path) -> None:
    """precision.compare aligns the two runs' tensor dumps and finds no divergence."""
    report = run_cli("-m", "precision.compare", str(one / "dump"), str(out / "dump"), "--png", "")
    assert report.returncode == 0 and "no divergence" in report.stdout, report.stdout + report.stderr
    print(report.stdout.splitlines()[-1])
