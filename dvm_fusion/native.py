"""The hand-written CPU kernels' shared libraries, built from `kernels/<name>.cc` with the machine's g++ on first use.

MindSpore runs an AOT `ops.Custom` kernel from a shared library; each is built once per source text into
$XDG_CACHE_HOME/telechat_moe/kernels (~/.cache/...), named by the source's hash, so an edited kernel is rebuilt and
an unchanged one is not. Processes starting together (msrun's ranks, test workers) build it once: the first holds a
file lock, the others wait and find the library.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from data_sched.default_corpus import cache_dir

SOURCES = Path(__file__).resolve().parent / "kernels"
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC")


class KernelBuildError(RuntimeError):
    pass


def library(name: str) -> Path:
    """The built library of kernels/<name>.cc, building it if this source has not been built yet."""
    source = SOURCES / f"{name}.cc"
    digest = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{name}-{digest}.so"
    if target.exists():
        return target
    compiler = shutil.which("g++")
    if compiler is None:
        raise KernelBuildError(f"{source}: building the CPU kernels needs g++ on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            built = subprocess.run([compiler, *FLAGS, "-o", str(partial), str(source), "-ldl"], capture_output=True,
                                   text=True)
            if built.returncode != 0:
                raise KernelBuildError(f"{source}: g++ failed: {built.stderr.strip()[-2000:]}")
            os.replace(partial, target)  # whole or absent: a reader never loads a half-written library
    return target
