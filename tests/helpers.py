"""Shared test helpers: running the entry point as a user would (in a fresh process, or in this one through the same
`run_train.main(argv)`), and checking one-line errors."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT.parent / "shared" / "data" / "corpus"


def run_cli(*args: str, timeout: float = 600, env: dict | None = None, cwd: str | Path | None = None):
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3", **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=str(cwd or ROOT))


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
