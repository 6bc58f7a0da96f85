"""bench/pipeline.py: its table, and one-line errors with exit code 2 for bad arguments."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.pipeline", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def test_table_row_against_theory():
    out = run("--p", "4", "--v", "2", "--m", "8,6", "--comm-fraction", "0", "--p2p", "0")
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("  4  2    8"))
    # free communication: 1F1B at (p-1)/(m+p-1) = 27.3%, interleaved and overlapped at (p-1)/(vm+p-1) = 15.8%
    assert row.count("27.3%") == 2 and row.count("15.8%") == 3
    assert "skipped" in next(line for line in out.stdout.splitlines() if line.startswith("  4  2    6"))


@pytest.mark.parametrize("args,field", [
    (("--p", "4,x"), "--p"),
    (("--m", "0"), "--m"),
    (("--comm-fraction", "-1"), "--comm-fraction"),
    (("--p", "4", "--v", "2", "--m", "8", "--recipe", "recipes/no_such.yaml"), "no_such.yaml"),
])
def test_bad_arguments_one_line_rc2(args, field):
    out = run(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in out.stderr


def test_gantt_dir_writes_one_png_per_schedule(tmp_path):
    out = run("--p", "4", "--v", "2", "--m", "8", "--gantt-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    for name in ("1f1b", "interleaved", "overlapped"):
        path = tmp_path / f"pipeline_{name}.png"
        assert f"wrote {path}" in out.stdout
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
