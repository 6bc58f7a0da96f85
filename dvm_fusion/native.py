"""The hand-written CPU kernels' shared libraries, built from `kernels/<name>.cc` with the machine's g++ on first use,
and what their callers share (`each_float32`).

MindSpore runs an AOT `ops.Custom` kernel from a shared library; each is built once per source text and CPU into
$XDG_CACHE_HOME/telechat_moe/kernels (~/.cache/...), named by a hash of both (the build targets the CPU it runs on),
the shared headers (kernels/*.h), the flags and g++'s version, so an edited kernel is rebuilt and an unchanged one
is not. Processes starting together (msrun's ranks, test workers) build it once: the first holds a file lock, the
others wait and find the library.
"""
from __future__ import annotations

import fcntl
from functools import cache
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import mindspore as ms
from mindspore import ops

from data_sched.default_corpus import cache_dir

SOURCES = Path(__file__).resolve().parent / "kernels"
# -march=native and no FP traps: the row kernels' loops vectorize only so (rowwise.cc's SwiGLU: 7.5 -> 0.6 ms on
# tiny's [4096, 384]); the library is then tied to the CPU that built it, which its name's hash covers.
# -fopenmp-simd: a loop marked `#pragma omp simd reduction(...)` may sum (or take the max) in vector lanes, which
# float semantics forbid otherwise (no OpenMP runtime is linked).
# -fno-math-errno: with errno kept, std::sqrt is a call GCC cannot vectorize; AdamW's loop over small's 113M
# parameters took 215 ms instead of about 60 (sqrt itself is exact either way: only errno on a negative is lost).
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-fopenmp-simd", "-std=c++17", "-shared",
         "-fPIC")


@cache
def cpu_identity() -> str:
    """The machine and its CPU's model and feature flags, as /proc/cpuinfo gives them (Linux); else the machine."""
    lines = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":")[0].strip()
            if key in ("model name", "flags", "Features", "CPU part") and line not in lines:
                lines.append(line)
    except OSError:
        pass
    return platform.machine() + "\n" + "\n".join(lines)


class KernelBuildError(RuntimeError):
    pass


@cache
def compiler() -> tuple[str, str]:
    """g++'s path and its version line (part of a library's name: another compiler builds other code)."""
    path = shutil.which("g++")
    if path is None:
        return "", ""
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.partition("\n")[0]
    return path, version


def library(name: str) -> Path:
    """The built library of kernels/<name>.cc, building it if this source has not been built yet."""
    source = SOURCES / f"{name}.cc"
    path, version = compiler()
    headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))  # what a source may include
    key = source.read_bytes() + headers + " ".join(FLAGS).encode() + cpu_identity().encode() + version.encode()
    target = cache_dir() / "kernels" / f"{name}-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if target.exists():
        return target
    if not path:
        raise KernelBuildError(f"{source}: building the CPU kernels needs g++ on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            built = subprocess.run([path, *FLAGS, "-o", str(partial), str(source), "-ldl"], capture_output=True,
                                   text=True)
            if built.returncode != 0:
                raise KernelBuildError(f"{source}: g++ failed: {built.stderr.strip()[-2000:]}")
            os.replace(partial, target)  # whole or absent: a reader never loads a half-written library
    return target


def _float32(t):
    return t if t.dtype == ms.float32 else t.astype(ms.float32)


_each = ops.HyperMap()


def each_float32(tensors: tuple) -> tuple:
    """The tensors as float32 (the kernels' element type), inside a graph. A HyperMap and not a comprehension: in
    graph mode a comprehension over small's 90 gradients took 3 s of its first step's compile (measured); the
    HyperMap's cost is not measurable."""
    return _each(_float32, tensors)


def aot_kernel(lib: Path, name: str, out_dtype, bprop=None):
    """`ops.Custom` of the kernel `name` in `lib` whose output shape the library's `<name>InferShape` gives (MindSpore's
    C++ shape inference): unlike a Python `out_shape`, it takes inputs whose row count a graph knows only at run time
    (the exact expert exchange's). MindSpore 2.9 reads the primitive's `reg_op_name` on that path (without it: "The
    pointer[value] is null" at compile)."""
    kernel = ops.Custom(f"{lib}:{name}", out_shape=None, out_dtype=out_dtype, func_type="aot", bprop=bprop)
    kernel.add_prim_attr("reg_op_name", name)
    return kernel

