"""Progress reporting: a console line per log step, metrics.jsonl, TensorBoard scalars and expert-load histograms.

Only rank 0 writes, and only once opened at the run's first step: the records of a step after it (the steps a
resumed run replays) are dropped from metrics.jsonl and purged from TensorBoard's view. Nothing here synchronises
with the device beyond the scalars the step already returned, so logging does not slow the training loop.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def peak_gemm_flops(measure=None) -> float:
    """This CPU's fp32 GEMM peak at this process's BLAS thread count, the denominator of the logged MFU: the higher of
    a measurement now (`measure`, by default parallel.planner.machine.gemm_flops, 0.2 s) and the highest measured
    before on the same CPU at the same thread count, kept in <cache>/peak_flops.json. One short measurement reads low
    when the machine is busy for that moment (a small run once logged MFU 122% after one at half the rate); a peak is
    the best the CPU has shown."""
    import hashlib
    from data_sched.default_corpus import cache_dir
    from dvm_fusion.adamw import cpu_threads
    from dvm_fusion.native import cpu_identity
    from parallel.planner.report import write_atomically
    if measure is None:
        from parallel.planner.machine import gemm_flops as measure
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or str(cpu_threads())     # OpenBLAS reads its own first
    key = hashlib.sha256(f"{cpu_identity()}\nthreads {threads}".encode()).hexdigest()[:16]
    path = cache_dir() / "peak_flops.json"
    try:
        known = json.loads(path.read_text())
        best = float(known.get(key, 0.0))
    except (OSError, ValueError, TypeError, AttributeError):
        known, best = {}, 0.0
    now = measure()
    if now > best:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps({**known, key: now}))   # a process starting beside this never reads half
    return max(now, best)


def format_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


class StepLogger:
    def __init__(self, log_dir: Path, enabled: bool, total_steps: int, tokens_per_step: int, flops_per_token: float,
                 peak_flops: float, devices: int):
        self.enabled = enabled
        self.log_dir = log_dir
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.devices = devices
        self.writer = None
        self.jsonl = None
        self.step_times: list[float] = []

    def open(self, start_step: int) -> None:
        """Start writing at the run's first step, `start_step` + 1: metrics.jsonl keeps its records up to
        `start_step` and appends after them; TensorBoard hides the earlier runs' events after it."""
        if not self.enabled:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / "metrics.jsonl"
        keep_records_until(path, start_step)
        from tensorboardX import SummaryWriter
        self.writer = SummaryWriter(str(self.log_dir / "tensorboard"), purge_step=start_step + 1)
        self.jsonl = open(path, "a", encoding="utf-8")

    def step_time(self, seconds: float) -> None:
        self.step_times.append(seconds)

    def _steady_step_time(self) -> float:
        # The first step compiles the graph; it says nothing about throughput.
        times = self.step_times[1:] or self.step_times
        recent = times[-20:]
        return float(np.mean(recent)) if recent else float("nan")

    def log(self, step: int, values: dict, expert_load: np.ndarray | None = None, console: bool = True,
            scalars: dict | None = None) -> dict:
        """`values` go to the step line, metrics.jsonl and TensorBoard; `scalars` (e.g. the expert traffic) to the
        last two only."""
        dt = self._steady_step_time()
        tokens_per_s = self.tokens_per_step / dt
        mfu = self.flops_per_token * tokens_per_s / (self.peak_flops * self.devices)
        record = {"step": step, **{k: float(v) for k, v in {**values, **(scalars or {})}.items()},
                  "tokens_per_s": tokens_per_s, "mfu": mfu, "step_time_s": dt}
        if self.jsonl is None:
            return record
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for k, v in record.items():
            if k != "step":
                self.writer.add_scalar(f"train/{k}", v, step)
        if expert_load is not None:
            for layer, load in enumerate(expert_load):
                # One histogram sample per routed token copy, valued by the expert it went to.
                counts = np.asarray(load, dtype=np.int64)
                self.writer.add_histogram(f"expert_load/moe_layer_{layer}", np.repeat(np.arange(len(counts)), counts),
                                          step, bins=np.arange(len(counts) + 1) - 0.5)
        if console:
            eta = format_eta(dt * (self.total_steps - step))
            parts = " ".join(f"{k} {v:.4f}" for k, v in values.items() if k != "lr")
            print(f"step {step:6d}/{self.total_steps} | {parts} | lr {values.get('lr', 0):.2e} | "
                  f"{tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}% | ETA {eta}", flush=True)
        return record

    def image(self, tag: str, png: Path, step: int) -> None:
        """A PNG already written (e.g. an expert-load heatmap) as a TensorBoard image."""
        if self.writer is None:
            return
        import matplotlib.pyplot as plt
        self.writer.add_image(tag, plt.imread(png)[..., :3], step, dataformats="HWC")
        self.writer.flush()

    def log_eval(self, step: int, loss: float) -> None:
        if self.jsonl is None:
            return
        self.jsonl.write(json.dumps({"step": step, "eval_lm_loss": loss}) + "\n")
        self.jsonl.flush()
        self.writer.add_scalar("eval/lm_loss", loss, step)
        print(f"step {step:6d}/{self.total_steps} | held-out lm_loss {loss:.4f} | ppl {np.exp(loss):.2f}", flush=True)

    def close(self) -> None:
        if self.jsonl is not None:
            self.writer.close()
            self.jsonl.close()
            self.writer = self.jsonl = None


def keep_records_until(path: Path, step: int) -> None:
    """Rewrite the JSON-lines file at `path` (if any) with only its records of steps up to `step`; a torn last line
    (a killed run) goes too. Atomic: a crash leaves the old file or the new one."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def info(message: str, enabled: bool = True) -> None:
    if enabled:
        print(message, file=sys.stdout, flush=True)


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
