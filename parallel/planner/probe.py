"""Measure real training steps on this machine, and the planner's prediction of the same steps.

`measure_steps` runs the trainer (graph mode, as run_train.py runs it) on a recipe in a fresh process, or under
msrun with dp processes, and reports:
- step time: the median of the steps after the first two (the first compiles the graphs);
- speed: the fp32 GEMM FLOP/s measured just before each of those steps in the same process(es), the same
  measurement as the calibration's peak. This shared machine's speed drifts by tens of percent between
  minutes, and msrun's processes share its cores, so a prediction is made for the speed the step actually had;
- step memory: the peak resident set over all steps minus the resident set before the first one (weights and
  optimizer states are resident then), graph compilation included.
`measure_interleaved` times several recipes' steps in one process, round by round (one step of each per round,
after building all of them), so that the machine's drift reaches all of them alike: their relative times are
what the calibration's fit needs. `predict_step` is the planner's step time and step memory (activations,
transients and gradients) for the same run. The calibration fits the cluster's runtime constants on probe recipes
with these; bench/planner_accuracy.py checks the fitted planner on other configurations.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_SPEC = "PLANNER_PROBE_SPEC"  # the worker's arguments: msrun would take --options for its own


def _rss(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _worker(spec: dict) -> None:
    """Inside one (msrun) process: build the trainer, time its steps, print one RESULT line on rank 0."""
    from parallel.planner.calibrate import gemm_flops
    from telechat_moe.recipe import load_recipe
    from telechat_moe.trainer import Trainer, configure_mindspore

    recipe = load_recipe(spec["recipe"], spec["overrides"] + [f"output_dir={spec['out']}"])
    configure_mindspore(recipe)
    rank = 0
    world = 1
    if spec["dp"] > 1:
        from mindspore.communication import get_group_size, get_rank, init
        init()
        rank, world = get_rank(), get_group_size()
    trainer = Trainer(recipe, rank, world, peak_flops=1e9)
    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # restart the peak-RSS counter
        f.write("5")
    times, rates = [], []
    for i in range(spec["steps"]):
        rates.append(gemm_flops(repeats=1))
        batch = trainer.loader.batch_at(0, i)
        start = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - start)
    if rank == 0:
        print("RESULT " + json.dumps({"step_time": _median(times[2:]), "gemm_flops": _median(rates[2:]),
                                      "step_memory": _rss("VmHWM") - before, "times": times}), flush=True)


def _interleaved_worker(spec: dict) -> None:
    from parallel.planner.calibrate import gemm_flops
    from telechat_moe.recipe import load_recipe
    from telechat_moe.trainer import Trainer, configure_mindspore

    trainers = {}
    for name, recipe_name, overrides in spec["cases"]:
        recipe = load_recipe(recipe_name, overrides + [f"output_dir={spec['out']}/{name}"])
        configure_mindspore(recipe)
        trainers[name] = Trainer(recipe, 0, 1, peak_flops=1e9)
    times = {name: [] for name in trainers}
    rates = []
    for i in range(spec["steps"]):
        rates.append(gemm_flops(repeats=1))
        for name, trainer in trainers.items():
            batch = trainer.loader.batch_at(0, i)
            start = time.perf_counter()
            trainer.train_step(batch)
            times[name].append(time.perf_counter() - start)
    print("RESULT " + json.dumps({name: {"step_time": _median(t[2:]), "gemm_flops": _median(rates[2:])}
                                  for name, t in times.items()}), flush=True)


def _run_worker(spec: dict, out: Path, dp: int = 1, name: str = "probe") -> dict:
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


def measure_interleaved(cases: list[tuple[str, str, list[str]]], steps: int, out: Path) -> dict:
    """{name: {step_time, gemm_flops}} of single-process runs of (name, recipe, overrides), all built in one
    process and stepped in rounds (`steps` rounds, at least 3; the first two compile and are not timed)."""
    return _run_worker({"cases": cases, "steps": steps, "out": str(out / "interleaved")}, out, name="interleaved")


def measure_steps(recipe: str, overrides: list[str], dp: int, steps: int, out: Path, name: str = "probe") -> dict:
    """Step time, GEMM FLOP/s beside it and step memory of `steps` training steps (at least 3)."""
    spec = {"recipe": recipe, "overrides": overrides, "dp": dp, "steps": steps, "out": str(out / name)}
    return _run_worker(spec, out, dp, name)


def predict_step(recipe: str, overrides: list[str], dp: int, gemm_rate: float, cluster) -> dict:
    """The planner's step time and step memory for the trainer's run of this recipe on `cluster` rescaled to
    the measured `gemm_rate` (each of the dp processes is one device; in-pass compute and memory traffic follow
    the rate, the links do not)."""
    import numpy as np

    from parallel.planner.cost_model import (Layouts, Precision, Workload, block_costs, even_stage, evaluate,
                                             stage_memory)
    from telechat_moe.recipe import load_recipe

    r = load_recipe(recipe, overrides)
    speed = gemm_rate / cluster.flops("fp32")
    device = dataclasses.replace(cluster, peak_flops={k: v * speed for k, v in cluster.peak_flops.items()},
                                 memory_bandwidth=cluster.memory_bandwidth * speed)
    w = Workload(r.model.to_model_shape(), device, devices=dp, seq_length=r.model.seq_length,
                 global_batch=r.training.global_batch_size,
                 precision=Precision(matmul_dtype="fp32", activation_bytes=4, param_bytes=4, grad_bytes=4),
                 shard_optimizer=False, overlap_grad_reduce=False)
    m = r.parallel_config.micro_batch_num
    lay = Layouts.single(dp=dp, mbs=r.training.global_batch_size // (dp * m), m=m, recompute=r.recompute_config.mode)
    mem = stage_memory(w, lay, block_costs(w, lay), even_stage(w, lay, np.array([0])))
    return {"step_time": float(evaluate(w, lay)["step_time"][0]),
            "step_memory": float(mem["activations"][0] + mem["transient"][0] + mem["grads"][0])}


if __name__ == "__main__":
    _spec = json.loads(os.environ[_SPEC])
    (_interleaved_worker if "cases" in _spec else _worker)(_spec)
