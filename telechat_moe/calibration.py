"""Real training steps on this machine, measured, and the planner's prediction of the same steps: what the
planner's CPU runtime model is fitted to (`python -m scripts.calibrate_cluster`) and checked on
(bench/planner_accuracy.py).

`measure_steps` runs the trainer (graph mode, as run_train.py runs it) on a recipe in a fresh process
(`python -m telechat_moe.calibration`, its arguments in the environment), or under msrun when the recipe is
data-parallel, and reports:
- step memory: the peak resident set over the first steps, run alone, minus the resident set before the first
  one (weights and optimizer states are resident then), graph compilation included;
- step time: the median over rounds after the first two (which compile the graphs), where each round runs one
  step of every recipe measured beside it (built in the same process; under msrun on rank 0 while the other
  ranks wait) and then one of the recipe. This shared machine's speed drifts by tens of percent between
  minutes; a recipe timed beside another sees the same drift, so their ratio holds still where their absolute
  times do not. The calibration and bench/planner_accuracy.py time every run beside the reference probe
  (REFERENCE), whose step says how fast the machine was compared with the calibration.
`predict_step` is the planner's step time and step memory (activations, transients and gradients) for the same
run (`probe_workload` describes the run to the planner).

`measure_runtime` measures eight small probe recipes (two-layer variants of tiny.yaml and small.yaml, none of them
a configuration bench/planner_accuracy.py checks), their memory and step time each in its own process, the time
beside the reference probe (a data-parallel variant under msrun besides, for the communicators' memory), and fits
the runtime constants to them (parallel.planner.calibrate.fit_runtime). The reference probe's step time is kept
with them: the machine's speed they hold for.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from parallel.planner.calibrate import fit_runtime, runtime_section, step_prediction
from parallel.planner.cluster import Cluster, cluster_from_dict
from parallel.planner.workload import Layouts, Workload
from telechat_moe.recipe import load_recipe
from telechat_moe.workload import recipe_layout, recipe_workload

ROOT = Path(__file__).resolve().parents[1]
_SPEC = "CALIBRATION_PROBE_SPEC"  # the worker's arguments: msrun would take --options for its own
_WARM_ROUNDS = 2  # the first steps of a trainer compile its graphs
_WORKER = ["-m", "telechat_moe.calibration"]  # this module's __main__: one worker process

# Two-layer variants of tiny.yaml and small.yaml (1 dense and 1 MoE layer, MTP 1): each varies what some runtime
# constants scale. (name, recipe, overrides)
_TWO_LAYERS = ["model.num_hidden_layers=2", "model.n_routed_experts=8"]


def _seq(n: int) -> list[str]:
    return [f"model.{key}={n}" for key in ("seq_length", "max_position_embeddings", "original_max_position_embeddings")]


PROBES = [("base", "tiny", _TWO_LAYERS),
          ("top1", "tiny", _TWO_LAYERS + ["model.num_experts_per_tok=1"]),
          ("top8", "tiny", _TWO_LAYERS + ["model.num_experts_per_tok=8"]),
          ("experts32", "tiny", _TWO_LAYERS + ["model.n_routed_experts=32"]),
          ("small-2layers", "small", ["model.num_hidden_layers=2"]),
          ("seq384", "tiny", _TWO_LAYERS + _seq(384)),
          ("micro2", "tiny", _TWO_LAYERS + ["parallel_config.micro_batch_num=2"]),
          ("recompute", "tiny", _TWO_LAYERS + ["recompute_config.recompute=true"])]
# the base probe again: its step, measured beside every run, says how fast the machine is then
REFERENCE = ("reference", *PROBES[0][1:])
# a data-parallel probe under msrun, for memory only: the timing runs share one process
MEMORY_PROBES = PROBES + [("dp2", "tiny", _TWO_LAYERS + ["parallel_config.data_parallel=2"])]


def _rss(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _trainer(recipe_name: str, overrides: list[str], out: str, rank: int = 0, world: int = 1):
    from telechat_moe.trainer import Trainer, configure_mindspore

    recipe = load_recipe(recipe_name, overrides + [f"output_dir={out}"])
    configure_mindspore(recipe)
    # peak FLOP/s only scales the logged MFU, which a probe does not read: a fixed figure, no GEMM measured
    return Trainer(recipe, rank, world, peak_flops=1e9)


def _timed_step(trainer, i: int) -> float:
    batch = trainer.loader.batch_at(0, i)
    start = time.perf_counter()
    trainer.train_step(batch)
    return time.perf_counter() - start


def _worker(spec: dict) -> None:
    """Inside one (msrun) process: the recipe's step memory over its first steps alone, then rounds of one step
    of each recipe beside it (on rank 0, the other ranks waiting) and one of the recipe; prints one RESULT line on
    rank 0."""
    rank, world = 0, 1
    if spec["dp"] > 1:
        from mindspore.communication import get_group_size, get_rank, init
        init()
        rank, world = get_rank(), get_group_size()
    trainer = _trainer(spec["recipe"], spec["overrides"], spec["out"], rank, world)
    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # restart the peak-RSS counter
        f.write("5")
    for i in range(spec["memory_steps"]):
        trainer.train_step(trainer.loader.batch_at(0, i))
    result = {"step_memory": _rss("VmHWM") - before} if spec["memory_steps"] else {}
    beside = {name: _trainer(recipe, overrides, f"{spec['out']}/{name}") for name, recipe, overrides
              in spec["beside"]} if rank == 0 else {}
    times = {name: [] for name in [*beside, spec["name"]]}
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    for i in range(spec["rounds"]):
        # the other ranks sleep through rank 0's steps beside (a marker file per round): those see the machine
        # as the calibration's single process saw it, and the recipe's ranks start their step together
        marker = Path(spec["out"]) / f"round_{i}"
        for name, other in beside.items():
            times[name].append(_timed_step(other, i))
        if rank == 0:
            marker.touch()
        while not marker.exists():
            time.sleep(0.001)
        times[spec["name"]].append(_timed_step(trainer, spec["memory_steps"] + i))
    if spec["rounds"]:
        medians = {name: _median(t[_WARM_ROUNDS:]) for name, t in times.items()}
        result.update(step_time=medians.pop(spec["name"]), beside=medians, times=times)
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def _run_worker(spec: dict, out: Path, dp: int, name: str) -> dict:
    bin_dir = str(Path(sys.executable).parent)  # msrun starts workers with the `python` on PATH
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOG_MF_PATH": str(out / "mflog"), "GLOG_v": "3",
           "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), _SPEC: json.dumps(spec)}
    if dp == 1:
        cmd, logs = [sys.executable, *_WORKER], None
    else:
        logs = out / f"msrun_{name}"
        cmd = [str(Path(bin_dir) / "msrun"), f"--worker_num={dp}", f"--local_worker_num={dp}",
               f"--master_port={8200 + os.getpid() % 500}", "--join=True", f"--log_dir={logs}",
               "--cluster_time_out=300", "python", *_WORKER]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    text = r.stdout + "".join(f.read_text() for f in sorted(logs.glob("worker_*.log"))) if logs else r.stdout
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{name}: no result (rc {r.returncode}): {(text + r.stderr)[-3000:]}")


def measure_steps(recipe: str, overrides: list[str], out: Path, name: str = "probe", memory_steps: int = 3,
                  rounds: int = 0, beside: list[tuple[str, str, list[str]]] = ()) -> dict:
    """{step_memory} of the first `memory_steps` steps; with `rounds` (at least 3) also {step_time, beside:
    {name: step_time}, times: {name: per-round seconds}} of the recipe timed in rounds with the single-process runs
    of (name, recipe, overrides) `beside` it. Runs under msrun when the recipe is data-parallel."""
    dp = load_recipe(recipe, overrides).parallel_config.data_parallel
    spec = {"name": name, "recipe": recipe, "overrides": overrides, "dp": dp, "memory_steps": memory_steps,
            "rounds": rounds, "beside": [list(b) for b in beside], "out": str(out / name)}
    return _run_worker(spec, out, dp, name)


def probe_workload(recipe: str, overrides: list[str], cluster: Cluster) -> tuple[Workload, Layouts]:
    """The trainer's run of this recipe as the planner sees it on `cluster` (each of its data-parallel processes
    is one device; fp32 throughout, no optimizer sharding or overlapped gradient reduction)."""
    r = load_recipe(recipe, overrides)
    w = dataclasses.replace(recipe_workload(r, cluster, devices=r.parallel_config.data_parallel, dtype="fp32"),
                            shard_optimizer=False, overlap_grad_reduce=False)
    return w, Layouts.of(recipe_layout(r, w))


def predict_step(recipe: str, overrides: list[str], cluster: Cluster) -> dict:
    """The planner's step time and step memory for the trainer's run of this recipe on `cluster`."""
    return step_prediction(*probe_workload(recipe, overrides, cluster))


def measure_runtime(cluster_doc: dict, rounds: int = 7) -> tuple[dict, list[dict]]:
    """Measure the probes and fit the runtime section of `cluster_doc` (which has the machine's rates); also the
    fit's report per probe. Each probe runs in its own process: its memory over its first steps alone, then its
    step time in rounds beside the reference probe, as bench/planner_accuracy.py measures its cases. The
    machine's speed drifts between minutes: each probe's time is brought to the reference's median speed over
    all probes by the reference beside it."""
    measured = []
    with tempfile.TemporaryDirectory(prefix="calibrate_") as tmp:
        for i, (name, recipe, overrides) in enumerate(MEMORY_PROBES, 1):
            timed = (name, recipe, overrides) in PROBES
            print(f"  probe {i}/{len(MEMORY_PROBES)}: {name} ({'memory, time' if timed else 'memory'}) ...",
                  file=sys.stderr, flush=True)
            measured.append({"name": name, "recipe": recipe, "overrides": overrides,
                             **measure_steps(recipe, overrides, Path(tmp), name, rounds=rounds if timed else 0,
                                             beside=[REFERENCE] if timed else [])})
    reference = float(np.median([m["beside"][REFERENCE[0]] for m in measured if "beside" in m]))
    for m in measured:
        if "beside" in m:
            m["step_time"] *= reference / m["beside"][REFERENCE[0]]
    cluster = cluster_from_dict(cluster_doc, "calibration")
    for m in measured:
        m["workload"], m["layouts"] = probe_workload(m["recipe"], m["overrides"], cluster)
    runtime, report = fit_runtime(cluster, measured)
    return runtime_section(dataclasses.replace(runtime, reference_step_time=reference)), report


if __name__ == "__main__":
    _worker(json.loads(os.environ[_SPEC]))
