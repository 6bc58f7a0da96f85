"""How accurate is the planner on what we can measure? Predict, then measure, training steps on this CPU.

For each configuration (the tiny and small recipes, varying hidden size, sequence, experts, top-k, global batch,
micro-batches, recompute, and data parallelism under msrun) the planner predicts the step time and memory from
parallel/planner/clusters/cpu.yaml (run `python -m parallel.planner.calibrate` first), and a worker process
runs the lead's Trainer.train_step and measures:
- step time: the median of the steps after the first two (the first compiles the graphs);
- step memory: the peak resident set size over all steps minus the resident size before the first one (weights
  and optimizer states are resident then; MindSpore's memory pool grows on the first step and is reused after),
  compared with the prediction of what a step adds: activations, gradients and the largest transient buffer.
  Graph compilation happens in the first step too, so the measurement includes its working memory.
This machine is shared, so timings are noisy.
Run: python bench/planner_accuracy.py [--steps 5] [--only NAME ...] [--png accuracy.png]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from telechat_moe.errors import OneLineParser  # noqa: E402

from parallel.planner.calibrate import gemm_flops  # noqa: E402

CONFIGS = [  # name, recipe, overrides, data-parallel processes
    ("tiny", "tiny", [], 1),
    ("tiny-hidden384", "tiny", ["model.hidden_size=384"], 1),
    ("tiny-seq512", "tiny", ["model.seq_length=512", "model.max_position_embeddings=512",
                             "model.original_max_position_embeddings=512"], 1),
    ("tiny-experts32", "tiny", ["model.n_routed_experts=32"], 1),
    ("tiny-top2", "tiny", ["model.num_experts_per_tok=2"], 1),
    ("tiny-batch16", "tiny", ["training.global_batch_size=16"], 1),
    ("tiny-micro4", "tiny", ["parallel_config.micro_batch_num=4"], 1),
    ("tiny-recompute", "tiny", ["recompute_config.recompute=true"], 1),
    ("tiny-selective", "tiny", ["recompute_config.select_recompute=true"], 1),
    ("small", "small", [], 1),
    ("small-seq128", "small", ["model.seq_length=128", "model.max_position_embeddings=128",
                               "model.original_max_position_embeddings=128"], 1),
    ("small-micro2", "small", ["parallel_config.micro_batch_num=2"], 1),
    ("tiny-dp2", "tiny", ["parallel_config.data_parallel=2"], 2),
    ("small-dp2", "small", ["parallel_config.data_parallel=2"], 2),
]


def _rss(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(spec: dict) -> None:
    """Runs inside one (msrun) process: build the trainer, time its steps, print one RESULT line on rank 0."""
    os.environ.setdefault("GLOG_v", "3")
    from telechat_moe.recipe import load_recipe
    from telechat_moe.trainer import Trainer, configure_mindspore

    recipe = load_recipe(spec["recipe"], spec["overrides"] + [f"output_dir={spec['out']}"])
    configure_mindspore(recipe)  # graph mode, as run_train.py runs it, before the communication init
    rank, world = 0, 1
    if spec["dp"] > 1:
        from mindspore.communication import get_group_size, get_rank, init
        init()
        rank, world = get_rank(), get_group_size()
    trainer = Trainer(recipe, rank, world, peak_flops=1e9)
    before = _rss("VmRSS")  # weights and optimizer states are resident; the pool grows on the first step
    with open("/proc/self/clear_refs", "w") as f:  # restart the peak-RSS counter
        f.write("5")
    times, rss = [], []
    for i in range(spec["steps"]):
        batch = trainer.loader.batch_at(0, i)
        start = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - start)
        rss.append(_rss("VmRSS") - before)
    timed = sorted(times[2:])
    if rank == 0:
        print("RESULT " + json.dumps({"step_time": timed[len(timed) // 2], "step_memory": _rss("VmHWM") - before,
                                      "times": times, "rss_after_steps": rss}), flush=True)


def measure(name: str, recipe: str, overrides: list[str], dp: int, steps: int, out: Path) -> dict:
    spec = json.dumps({"recipe": recipe, "overrides": overrides, "dp": dp, "steps": steps,
                       "out": str(out / recipe)})
    bin_dir = str(Path(sys.executable).parent)  # msrun starts workers with the `python` on PATH
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOG_MF_PATH": str(out / "mflog"), "GLOG_v": "3",
           "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    env["PLANNER_ACCURACY_WORKER"] = spec  # not an argument: msrun would take --worker for one of its own
    if dp == 1:
        cmd = [sys.executable, __file__]
        logs = None
    else:
        logs = out / f"msrun_{name}"
        cmd = [str(Path(bin_dir) / "msrun"), f"--worker_num={dp}", f"--local_worker_num={dp}", f"--master_port={8200 + os.getpid() % 500}",
               "--join=True", f"--log_dir={logs}", "--cluster_time_out=300", __file__]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    text = r.stdout + "".join(f.read_text() for f in sorted(logs.glob("worker_*.log"))) if logs else r.stdout
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{name}: no result (rc {r.returncode}): {(text + r.stderr)[-3000:]}")


def predict(recipe_name: str, overrides: list[str], dp: int, gemm_rate: float) -> dict:
    """The planner's step time and per-step memory for the trainer's CPU run of this recipe. The calibrated
    cluster is rescaled to the GEMM FLOP/s measured beside the run (this shared machine's speed drifts by tens of
    percent between minutes); the dp processes of an msrun run share this one machine's cores and memory
    bandwidth, so each is a device of 1/dp of it."""
    import dataclasses

    import numpy as np

    from parallel.planner.cluster import load_cluster
    from parallel.planner.cost_model import Layouts, Precision, Workload, block_costs, even_stage, evaluate, stage_memory
    from telechat_moe.recipe import load_recipe

    r = load_recipe(recipe_name, overrides)
    shape = r.model.to_model_shape()
    cpu = load_cluster("cpu")
    speed = gemm_rate / cpu.flops("fp32") / dp
    cpu = dataclasses.replace(cpu, peak_flops={k: v * speed for k, v in cpu.peak_flops.items()},
                              memory_bandwidth=cpu.memory_bandwidth / dp)
    w = Workload(shape, cpu, devices=dp, seq_length=r.model.seq_length,
                 global_batch=r.training.global_batch_size,
                 precision=Precision(matmul_dtype="fp32", activation_bytes=4, param_bytes=4, grad_bytes=4),
                 shard_optimizer=False, overlap_grad_reduce=False)
    m = r.parallel_config.micro_batch_num
    mbs = r.training.global_batch_size // (dp * m)
    lay = Layouts.single(dp=dp, mbs=mbs, m=m, recompute=r.recompute_config.mode)
    score = evaluate(w, lay)
    mem = stage_memory(w, lay, block_costs(w, lay), even_stage(w, lay, np.array([0])))
    return {"step_time": float(score["step_time"][0]),
            "step_memory": float(mem["activations"][0] + mem["transient"][0] + mem["grads"][0])}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, key, unit, scale in ((axes[0], "step_time", "s", 1.0), (axes[1], "step_memory", "MiB", 2 ** 20)):
        meas = [r["measured"][key] / scale for r in rows]
        pred = [r["predicted"][key] / scale for r in rows]
        ax.scatter(meas, pred)
        for r, x, y in zip(rows, meas, pred):
            ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        lo, hi = min(meas + pred) * 0.8, max(meas + pred) * 1.2
        ax.plot([lo, hi], [lo, hi], "k--", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {key.replace('_', ' ')} ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
    fig.suptitle("planner vs measured training steps on this CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--only", nargs="*", help="configuration names to run")
    ap.add_argument("--png", help="write predicted-vs-measured scatter plots")
    ap.add_argument("--json", help="write the per-case results")
    if os.environ.get("PLANNER_ACCURACY_WORKER"):
        worker(json.loads(os.environ["PLANNER_ACCURACY_WORKER"]))
        return
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps: at least 3 (two warm-up steps, then the timed ones)")
    configs = [c for c in CONFIGS if not args.only or c[0] in args.only]
    rows = []
    with tempfile.TemporaryDirectory(prefix="planner_accuracy_") as tmp:
        for i, (name, recipe, overrides, dp) in enumerate(configs, 1):
            print(f"[{i}/{len(configs)}] {name}: measuring ...", file=sys.stderr, flush=True)
            before = gemm_flops()
            measured = measure(name, recipe, overrides, dp, args.steps, Path(tmp))
            predicted = predict(recipe, overrides, dp, (before + gemm_flops()) / 2)
            err = {k: predicted[k] / measured[k] - 1 for k in ("step_time", "step_memory")}
            rows.append({"name": name, "measured": measured, "predicted": predicted, "error": err})
            print(f"{name:16s} step: measured {measured['step_time']:7.3f} s, predicted {predicted['step_time']:7.3f} s "
                  f"({100 * err['step_time']:+6.1f}%)   step memory: measured {measured['step_memory'] / 2**20:8.1f} "
                  f"MiB, predicted {predicted['step_memory'] / 2**20:8.1f} MiB ({100 * err['step_memory']:+6.1f}%)",
                  flush=True)
    for key in ("step_time", "step_memory"):
        errs = [abs(r["error"][key]) for r in rows]
        print(f"{key}: mean absolute error {100 * sum(errs) / len(errs):.1f}% over {len(errs)} cases, "
              f"worst {100 * max(errs):.1f}%")
    if args.png:
        plot(rows, args.png)
        print(f"wrote {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
