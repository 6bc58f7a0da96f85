"""Shared test helpers: running the entry point as a user would, and checking one-line errors."""
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


def assert_one_line_error(proc, *needles: str) -> str:
    """Exit code 2, exactly one non-empty line on stderr, no traceback, naming what the user got wrong."""
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert proc.returncode == 2, f"rc={proc.returncode}\nstdout:{proc.stdout[-2000:]}\nstderr:{proc.stderr[-3000:]}"
    assert len(lines) == 1, f"expected one line, got:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]
