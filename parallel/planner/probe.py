"""Measure real training steps on this machine, and the planner's prediction of the same steps.

`measure_steps` runs the trainer (graph mode, as run_train.py runs it) on a recipe in a fresh process, or under
msrun when the recipe is data-parallel, and reports:
- step memory: the peak resident set over the first steps, run alone, minus the resident set before the first
  one (weights and optimizer states are resident then), graph compilation included;
- step time: the median over rounds after the first two (which compile the graphs), where each round runs one
  step of every recipe measured beside it (built in the same process; under msrun on rank 0 while the other
  ranks wait) and then one of the recipe. This shared machine's speed drifts by tens of percent between
  minutes; a recipe timed beside another sees the same drift, so their ratio holds still where their absolute
  times do not. The calibration and bench/planner_accuracy.py time every run beside the calibration's reference
  probe, whose step says how fast the machine was compared with the calibration.
`predict_step` is the planner's step time and step memory (activations, transients and gradients) for the same
run. The calibration fits the cluster's runtime constants on probe recipes with these; bench/planner_accuracy.py
checks the fitted planner on other configurations.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_SPEC = "PLANNER_PROBE_SPEC"  # the worker's arguments: msrun would take --options for its own
_WARM_ROUNDS = 2  # the first steps of a trainer compile its graphs


def _rss(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _trainer(recipe_name: str, overrides: list[str], out: str, rank: int = 0, world: int = 1):
    from telechat_moe.recipe import load_recipe
    from telechat_moe.trainer import Trainer, configure_mindspore

    recipe = load_recipe(recipe_name, overrides + [f"output_dir={out}"])
    configure_mindspore(recipe)
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
        cmd, logs = [sys.executable, __file__], None
    else:
        logs = out / f"msrun_{name}"
        cmd = [str(Path(bin_dir) / "msrun"), f"--worker_num={dp}", f"--local_worker_num={dp}",
               f"--master_port={8200 + os.getpid() % 500}", "--join=True", f"--log_dir={logs}",
               "--cluster_time_out=300", __file__]
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
    from telechat_moe.recipe import load_recipe

    dp = load_recipe(recipe, overrides).parallel_config.data_parallel
    spec = {"name": name, "recipe": recipe, "overrides": overrides, "dp": dp, "memory_steps": memory_steps,
            "rounds": rounds, "beside": [list(b) for b in beside], "out": str(out / name)}
    return _run_worker(spec, out, dp, name)


def predict_step(recipe: str, overrides: list[str], cluster) -> dict:
    """The planner's step time and step memory for the trainer's run of this recipe on `cluster` (each of its
    data-parallel processes is one device)."""
    import numpy as np

    from parallel.planner.cost_model import (Layouts, Precision, Workload, block_costs, even_stage, evaluate,
                                             stage_memory)
    from telechat_moe.recipe import load_recipe

    r = load_recipe(recipe, overrides)
    dp = r.parallel_config.data_parallel
    w = Workload(r.model.to_model_shape(), cluster, devices=dp, seq_length=r.model.seq_length,
                 global_batch=r.training.global_batch_size,
                 precision=Precision(matmul_dtype="fp32", activation_bytes=4, param_bytes=4, grad_bytes=4),
                 shard_optimizer=False, overlap_grad_reduce=False)
    m = r.parallel_config.micro_batch_num
    lay = Layouts.single(dp=dp, mbs=r.training.global_batch_size // (dp * m), m=m, recompute=r.recompute_config.mode)
    mem = stage_memory(w, lay, block_costs(w, lay), even_stage(w, lay, np.array([0])))
    return {"step_time": float(evaluate(w, lay)["step_time"][0]),
            "step_memory": float(mem["activations"][0] + mem["transient"][0] + mem["grads"][0])}


if __name__ == "__main__":
    _worker(json.loads(os.environ[_SPEC]))
