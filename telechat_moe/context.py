"""MindSpore's context from a recipe's `context` section, applied once per process before communication init.

Which call each setting becomes (MindSpore 2.9's own APIs, the ones its set_context deprecation notes point to; every
call is checked against the installed package's signatures by tests/test_context.py):

| recipe key | call | where |
| --- | --- | --- |
| mode, jit_level | `ms.set_context(mode=..., jit_config={"jit_level": ...})` | CPU, Ascend |
| device_target | `ms.set_device(target)` (under msrun MindSpore picks each rank's device id) | CPU, Ascend |
| enable_graph_kernel | `ms.set_context(enable_graph_kernel=True)` | CPU, Ascend |
| fusion.graph_kernel | CPU: `ms.set_context(enable_graph_kernel=True)` (AKG); Ascend: jit_level O1 | CPU, Ascend |
| fusion.*_ops, flags | `os.environ[MS_DEV_GRAPH_KERNEL_FLAGS]` ("--disable_cluster_ops=Mul,Add ...") | CPU, Ascend |
| fusion.save_graphs | `os.environ[MS_DEV_SAVE_GRAPHS, MS_DEV_SAVE_GRAPHS_PATH, MS_DEV_DUMP_IR_PASSES]` | CPU, Ascend |
| max_device_memory_gb, mempool_block_size_gb | `ms.runtime.set_memory(max_size=, increase_size=)` ("NGB") | Ascend |
| memory_optimize_level | `ms.runtime.set_memory(optimize_level=...)` | CPU, Ascend |
| deterministic: ON | `ms.set_deterministic(True)` (also sets HCCL_DETERMINISTIC, TE_PARALLEL_COMPILER) | CPU, Ascend |
| hccl_connect_timeout, hccl_exec_timeout, hccl_buffsize | `os.environ[HCCL_...]` | Ascend |
| compile_cache | `os.environ[MS_COMPILER_CACHE_ENABLE, MS_COMPILER_CACHE_PATH]` (a keyed folder) | CPU, Ascend |
| lazy_inline | `@ms.lazy_inline(policy="front")` on the decoder layers (telechat_moe.model, not here) | CPU, Ascend |

Graph-kernel fusion has one switch per device: on Ascend jit_level O1 is DVM, MindSpore's own fusion (a recipe at O1
fuses; fusion.graph_kernel asks for O1 there); on CPU jit_level O1 alone fuses nothing and enable_graph_kernel turns on
AKG (context.enable_graph_kernel, MindFormers' key, and fusion.graph_kernel are the same switch). The flags and the IR
dump go through the environment variables MindSpore 2.9's set_context points to (read when a graph compiles); the IR
dump keeps only the built kernel graphs (`graph_build_*.ir`, what `python -m dvm_fusion.report` reads).

MindSpore's compile cache reuses a graph when the Python sources it was built from are unchanged; values that only
a recipe changes (`--set model.hidden_size=...`) would not invalidate it, so each cache folder is named by a hash of
the whole recipe but its output_dir, this project's sources and MindSpore's version: a graph is only ever loaded by
the run that would have compiled the same one.

On CPU, max_device_memory_gb stays the planner's and the fit check's budget only (MindSpore ignores a memory cap on
CPU) and the HCCL variables are not set (the CPU transport is mccl). A setting at its default makes no call.
set_memory and set_deterministic may each be called once per process: once made, a second configure_mindspore in
the same process (tests, calibration) must ask for the same values, or it raises before setting anything.
"""
from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import mindspore as ms

from data_sched.default_corpus import cache_dir
from telechat_moe.recipe_checks import FUSION_OP_LISTS

if TYPE_CHECKING:
    from telechat_moe.recipe_schema import ContextConfig, Recipe

# recipe key -> HCCL's environment variable (read when communication initialises)
HCCL_ENV = {"hccl_connect_timeout": "HCCL_CONNECT_TIMEOUT", "hccl_exec_timeout": "HCCL_EXEC_TIMEOUT",
            "hccl_buffsize": "HCCL_BUFFSIZE"}

# The once-per-process settings this process has applied: name -> value.
_APPLIED: dict = {}


def gb_text(gb: float) -> str:
    """55.5 -> "55.5GB", MindSpore's memory size strings (six decimals at most; validate() keeps sizes above 0 at
    MIN_GB or more, so none reads "0GB")."""
    return f"{gb:f}".rstrip("0").rstrip(".") + "GB"


def hccl_environment(c: ContextConfig) -> dict[str, str]:
    """The HCCL variables the recipe sets (Ascend; a 0 leaves the variable as the environment has it)."""
    if c.device_target != "Ascend":
        return {}
    return {env: str(getattr(c, key)) for key, env in HCCL_ENV.items() if getattr(c, key)}


def graph_kernel_flags(r: Recipe) -> str:
    """MindSpore's graph-kernel flags for the fusion section: its operator lists, then its own flags."""
    f = r.fusion
    lists = [f"--{key}={','.join(getattr(f, key))}" for key in FUSION_OP_LISTS if getattr(f, key)]
    return " ".join(lists + f.flags.split())


def graphs_dir(r: Recipe) -> str:
    """Where the IR dump goes: fusion.save_graphs_path, or <output_dir>/graphs."""
    return r.fusion.save_graphs_path or os.path.join(r.output_dir, "graphs")


def fusion_environment(r: Recipe) -> dict[str, str]:
    """The environment variables the fusion section sets (none at its defaults)."""
    out = {}
    flags = graph_kernel_flags(r)
    if flags:
        out["MS_DEV_GRAPH_KERNEL_FLAGS"] = flags
    if r.fusion.save_graphs:
        out.update({"MS_DEV_SAVE_GRAPHS": "1", "MS_DEV_SAVE_GRAPHS_PATH": os.path.abspath(graphs_dir(r)),
                    "MS_DEV_DUMP_IR_PASSES": "graph_build"})
    return out


def memory_settings(c: ContextConfig) -> dict[str, str]:
    """mindspore.runtime.set_memory's keyword arguments for the recipe; empty: nothing to set."""
    out = {}
    if c.device_target == "Ascend":
        if c.max_device_memory_gb:
            out["max_size"] = gb_text(c.max_device_memory_gb)
        if c.mempool_block_size_gb:
            out["increase_size"] = gb_text(c.mempool_block_size_gb)
    if c.memory_optimize_level != "O0":
        out["optimize_level"] = c.memory_optimize_level
    return out


# the packages whose sources build the graphs
SOURCE_PACKAGES = ("telechat_moe", "parallel", "dvm_fusion", "precision", "data_sched")


def compile_cache_dir(r: Recipe) -> Path:
    """The compile cache's folder for this recipe (see the module docstring)."""
    recipe = {k: v for k, v in r.to_dict().items() if k != "output_dir"}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode())
    digest.update(version("mindspore").encode())
    root = Path(__file__).resolve().parents[1]
    for source in sorted(f for pkg in SOURCE_PACKAGES for f in (root / pkg).rglob("*") if f.suffix in (".py", ".cc")):
        digest.update(source.read_bytes())
    return cache_dir() / "graphs" / digest.hexdigest()[:16]


def compile_cache_environment(r: Recipe) -> dict[str, str]:
    if not r.context.compile_cache:
        return {}
    return {"MS_COMPILER_CACHE_ENABLE": "1", "MS_COMPILER_CACHE_PATH": str(compile_cache_dir(r))}


def _refuse_change(once: dict) -> None:
    """A once-per-process setting this process has applied, asked for with another value (its default included):
    refused before anything is set."""
    for name, value in once.items():
        if name in _APPLIED and _APPLIED[name] != value:
            raise RuntimeError(f"{name} was applied as {_APPLIED[name]!r} in this process and MindSpore fixes it "
                               f"once per process; cannot change it to {value!r}")


def configure_mindspore(r: Recipe) -> None:
    """Apply the recipe's context: before communication init (MindSpore fixes the device there, HCCL reads its
    environment there) and before any kernel runs."""
    c = r.context
    memory = memory_settings(c)
    once = {"mindspore.runtime.set_memory": memory, "mindspore.set_deterministic": c.deterministic == "ON"}
    _refuse_change(once)
    os.environ.update(hccl_environment(c))
    os.environ.update(fusion_environment(r))
    os.environ.update(compile_cache_environment(r))
    ms.set_context(mode=c.mode, jit_config={"jit_level": c.jit_level})
    # MindSpore fixes the device once kernels have run; setting the same one again would be refused.
    if ms.get_context("device_target") != c.device_target:
        ms.set_device(c.device_target)
    if c.enable_graph_kernel or (r.fusion.graph_kernel and c.device_target == "CPU"):
        ms.set_context(enable_graph_kernel=True)
    # at their defaults nothing is called (and nothing fixed for the process)
    if memory and "mindspore.runtime.set_memory" not in _APPLIED:
        ms.runtime.set_memory(**memory)
        _APPLIED["mindspore.runtime.set_memory"] = memory
    if once["mindspore.set_deterministic"] and "mindspore.set_deterministic" not in _APPLIED:
        ms.set_deterministic(True)
        _APPLIED["mindspore.set_deterministic"] = True
