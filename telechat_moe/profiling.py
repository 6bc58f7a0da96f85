"""MindSpore's profiler around some training steps (the recipe's `profile:` section), and its short report.

    python -m telechat_moe.profiling PROFILE_DIR [--rank 0] [--steps 3-4] [--top 15] [--json FILE]

The run: `profile.steps: "3-4"` (training.dump_steps' syntax) starts `mindspore.profiler.profile` with
`ProfilerActivity.CPU` just before the first of those steps and stops it after the last (MindSpore then parses what
it collected into `<dir>/rank_<r>/<worker>_ascend_ms/ASCEND_PROFILER_OUTPUT/trace_view.json`). Beside it the
trainer's hook writes `steps.json`: each profiled step's wall-clock window and the step time the trainer measured
and logged for it (`metrics.jsonl`'s step_time_s is their running mean). Steps between two profiled ones that the
range leaves out are collected too but not reported.

The report, from the trace's kernels (MindSpore's "CPU OP" process: every kernel launch with its full scope name,
start and duration) of each profiled step, i.e. the kernels that start inside the step's window:
- top operators by total time: the operator type (the scope name's last part without `-opN`; a fused kernel is its
  GraphKernel_..._fusion; a hand kernel, ops.Custom, is named with the cell calling it, e.g.
  Custom[GroupedExperts]), calls per step, total ms over the steps, share of the kernel time;
- time per phase, from the full scope names MindSpore gives the ops of a graph: `Gradients/...` is the backward
  (autodiff puts every op of the backward graph under it); an op under the gradient-preparation or optimizer cells
  (`prepare`, `optimizer`, `replica_sum`, the accumulation buffers: PHASE_SCOPES) is "optimizer+gradient
  preparation", as are the graphs that run after the step graph (the expert-bias move); the step graph's other ops
  (`Default/...`) are the forward; an op of MindSpore's expanders (`Expand/_SumExt/...`, `Expand/_SoftmaxBackward/...`)
  has no cell scope and takes the phase of the kernel that ran before it (kernels run one at a time, in graph order);
- host gaps: the time between one kernel's end and the next one's start inside a step (the host launching the next
  kernel, Python between graphs, syncs), the largest ones with the kernels around them;
- per step: the span from its first kernel's start to its last kernel's end = kernel time + gaps, measured by the
  profiler alone, beside the step time the trainer measured and logged (their ratio).
Bad input (a folder with no profile, a step that was not profiled, an unreadable trace) is one line and exit 2.
"""
from __future__ import annotations

import json
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from oneline import InputError, OneLineParser

STEPS_FILE = "steps.json"
TRACE_FILE = "trace_view.json"
PHASES = ("forward", "backward", "optimizer+gradient preparation")
# Scope names (a cell's attribute name in TrainStep) whose ops are the optimizer and the gradient preparation
PHASE_SCOPES = ("prepare", "optimizer", "replica_sum", "grad_accum", "accum", "biases")


class ProfileError(InputError):
    """A profile folder that cannot be reported; one line naming the file or option."""


# ---- the run side: the trainer's hook ------------------------------------------------------------------------------
class StepProfiler:
    """Starts MindSpore's profiler before the first profiled step and stops it after the last; records each profiled
    step's window and the trainer's time for it in steps.json. With no steps it does nothing."""

    def __init__(self, steps: frozenset[int], folder: Path, rank: int):
        self.steps, self.folder, self.rank = steps, folder, rank
        self.profiler = None
        self.records: list[dict] = []
        self.start_us = 0.0

    @classmethod
    def of(cls, recipe, rank: int) -> "StepProfiler":
        from precision.dump import parse_steps
        p = recipe.profile
        steps = parse_steps(p.steps, "profile.steps") if p.steps else frozenset()
        return cls(steps, Path(p.output_dir or Path(recipe.output_dir) / "profile") / f"rank_{rank}", rank)

    def before(self, step: int) -> None:
        if step not in self.steps:
            return
        if self.profiler is None and not self.records:      # the first profiled step this run reaches
            import mindspore as ms
            from mindspore.profiler import ProfilerActivity
            self.folder.mkdir(parents=True, exist_ok=True)
            self.profiler = ms.profiler.profile(
                activities=[ProfilerActivity.CPU], start_profile=False,
                on_trace_ready=ms.profiler.tensorboard_trace_handler(str(self.folder)))
            self.profiler.start()
        self.start_us = time.time_ns() / 1e3

    def after(self, step: int, seconds: float) -> None:
        """`seconds`: the step time the trainer measured and logs."""
        if step not in self.steps or self.profiler is None:
            return
        self.records.append({"step": step, "start_us": self.start_us, "end_us": time.time_ns() / 1e3,
                             "trainer_step_s": seconds})
        if step == max(self.steps):
            self.close()

    def close(self) -> None:
        """Stop (MindSpore parses its data here) and write steps.json; also when a run ends inside the range."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        (self.folder / STEPS_FILE).write_text(json.dumps({"rank": self.rank, "steps": self.records}, indent=1))


# ---- the report side -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kernel:
    name: str           # full scope name, e.g. Gradients/Default/model-TeleChatMoE/.../MatMul-op3
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us

    @property
    def op_type(self) -> str:
        """The operator's type; a Custom kernel (ops.Custom: the hand kernels) with the cell that calls it."""
        parts = self.name.split("/")
        op = re.sub(r"-op\d+$", "", parts[-1])
        if op == "Custom":
            cell = next((p for p in reversed(parts[:-1]) if not p.startswith("Grad_")), "")
            return f"Custom[{cell.split('-')[-1]}]" if cell else op
        return op


def phase_of(name: str) -> str | None:
    """forward | backward | optimizer+gradient preparation from an op's full scope name (module docstring); None
    for an op of MindSpore's expanders (`Expand/...`), which carries no cell scope."""
    if name.startswith("Gradients/"):
        return "backward"
    if name.startswith("Expand/"):
        return None
    parts = name.split("/")
    if any(part.split("-", 1)[0] in PHASE_SCOPES for part in parts[1:-1]):
        return "optimizer+gradient preparation"
    return "forward"


@dataclass
class StepProfile:
    step: int
    trainer_step_s: float
    kernels: list[Kernel]

    @property
    def span_s(self) -> float:
        """The profile's total for the step: first kernel's start to last kernel's end."""
        return (max(k.end_us for k in self.kernels) - min(k.start_us for k in self.kernels)) / 1e6

    @property
    def busy_s(self) -> float:
        """Time some kernel ran (overlapping kernels counted once)."""
        busy, end = 0.0, -float("inf")
        for k in sorted(self.kernels, key=lambda k: k.start_us):
            if k.end_us > end:
                busy += k.end_us - max(k.start_us, end)
                end = k.end_us
        return busy / 1e6

    def gaps(self) -> list[tuple[float, Kernel, Kernel]]:
        """(seconds, kernel before, kernel after) of every host gap between kernels."""
        out, last = [], None
        for k in sorted(self.kernels, key=lambda k: k.start_us):
            if last is not None and k.start_us > last.end_us:
                out.append(((k.start_us - last.end_us) / 1e6, last, k))
            if last is None or k.end_us > last.end_us:
                last = k
        return out


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{path}: not a readable profile file ({type(e).__name__}: {str(e).splitlines()[0]})") \
            from None


def rank_folder(folder: Path, rank: int) -> Path:
    """The profile of `rank`: `folder` itself or its rank_<rank> (profile.output_dir, or <output_dir>/profile)."""
    for cand in (folder, folder / f"rank_{rank}", folder / "profile" / f"rank_{rank}"):
        if (cand / STEPS_FILE).is_file():
            return cand
    if not folder.is_dir():
        raise ProfileError(f"{folder}: no such folder")
    raise ProfileError(f"{folder}: no profile of rank {rank} ({STEPS_FILE} in it or in rank_{rank}/; train with "
                       f"--set profile.steps=3-4)")


def load_steps(folder: Path, rank: int = 0, wanted: frozenset[int] | None = None) -> list[StepProfile]:
    """Each profiled step (or those `wanted`) with the kernels that started inside its window."""
    where = rank_folder(folder, rank)
    steps = _read_json(where / STEPS_FILE)
    try:
        records = [(int(s["step"]), float(s["start_us"]), float(s["end_us"]), float(s["trainer_step_s"]))
                   for s in steps["steps"]]
    except (KeyError, TypeError, ValueError):
        raise ProfileError(f"{where / STEPS_FILE}: expected {{'steps': [{{step, start_us, end_us, "
                           f"trainer_step_s}}]}}") from None
    if not records:
        raise ProfileError(f"{where / STEPS_FILE}: no step was profiled")
    profiled = sorted(r[0] for r in records)
    if wanted is not None:
        missing = sorted(wanted - set(profiled))
        if missing:
            raise ProfileError(f"--steps: step {missing[0]} was not profiled (profiled: "
                               f"{','.join(map(str, profiled))})")
        records = [r for r in records if r[0] in wanted]
    traces = sorted(where.glob(f"*/ASCEND_PROFILER_OUTPUT/{TRACE_FILE}"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise ProfileError(f"{where}: no */ASCEND_PROFILER_OUTPUT/{TRACE_FILE} (MindSpore's profiler did not finish "
                           f"parsing)")
    kernels = cpu_kernels(traces[-1])
    out = []
    for step, start, end, trainer in records:
        inside = [k for k in kernels if start <= k.start_us <= end]
        if not inside:
            raise ProfileError(f"{traces[-1]}: no kernel inside step {step}'s window (a trace of another run?)")
        out.append(StepProfile(step, trainer, inside))
    return out


def cpu_kernels(trace: Path) -> list[Kernel]:
    """The kernels of MindSpore's "CPU OP" process in a trace_view.json."""
    events = _read_json(trace)
    if not isinstance(events, list):
        raise ProfileError(f"{trace}: expected a list of trace events")
    pids = {e.get("pid") for e in events if isinstance(e, dict) and e.get("ph") == "M"
            and e.get("name") == "process_name" and e.get("args", {}).get("name") == "CPU OP"}
    if not pids:
        raise ProfileError(f"{trace}: no CPU OP process (profile with ProfilerActivity.CPU)")
    try:
        return [Kernel(e["name"], float(e["ts"]), float(e["dur"])) for e in events
                if isinstance(e, dict) and e.get("ph") == "X" and e.get("pid") in pids]
    except (KeyError, TypeError, ValueError):
        raise ProfileError(f"{trace}: a CPU OP event without name, ts or dur") from None


def _graph_phases(step: StepProfile) -> list[str]:
    """Each kernel's phase: its scope's (phase_of); an expander's op takes the phase of the kernel that ran before
    it; the kernels after the last backward kernel in no optimizer scope (another graph, e.g. the expert-bias move)
    count as optimizer+gradient preparation."""
    order = sorted(range(len(step.kernels)), key=lambda i: step.kernels[i].start_us)
    phases, previous = [phase_of(k.name) for k in step.kernels], PHASES[0]
    for i in order:
        phases[i] = previous = phases[i] or previous
    last_backward = max((pos for pos, i in enumerate(order) if phases[i] == "backward"), default=None)
    if last_backward is not None:
        for i in order[last_backward + 1:]:
            if phases[i] == "forward":
                phases[i] = PHASES[2]
    return phases


def report(steps: list[StepProfile], top: int = 15) -> tuple[str, dict]:
    """The text report and its numbers."""
    n = len(steps)
    by_type: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    phase_s: dict[str, float] = defaultdict(float)
    gaps = []
    for s in steps:
        for k, ph in zip(s.kernels, _graph_phases(s)):
            by_type[k.op_type][0] += 1
            by_type[k.op_type][1] += k.dur_us / 1e6
            phase_s[ph] += k.dur_us / 1e6
        gaps += [(g, s.step, a, b) for g, a, b in s.gaps()]
    kernel_s = sum(v[1] for v in by_type.values())
    lines = [f"profile of step{'s' if n > 1 else ''} {','.join(str(s.step) for s in steps)}: "
             f"{sum(len(s.kernels) for s in steps) // n} kernels per step, {kernel_s / n * 1e3:.1f} ms of kernel "
             f"time per step", "", f"top operators by total time (of {len(by_type)} types):",
             f"  {'operator':40s} {'calls/step':>10s} {'total ms':>10s} {'share':>7s}"]
    ranked = sorted(by_type.items(), key=lambda kv: -kv[1][1])
    for name, (calls, secs) in ranked[:top]:
        lines.append(f"  {name[:40]:40s} {calls / n:10.0f} {secs * 1e3:10.2f} {100 * secs / kernel_s:6.1f}%")
    lines += ["", "time per phase (kernel time per step; from the ops' scope names: Gradients/ = backward, the "
                  "prepare/optimizer cells and later graphs = optimizer+gradient preparation, the rest = forward, an "
                  "expander's op (Expand/) = the phase of the kernel before it):"]
    for ph in PHASES:
        lines.append(f"  {ph:32s} {phase_s[ph] / n * 1e3:9.1f} ms {100 * phase_s[ph] / kernel_s:6.1f}%")
    gap_s = sum(g for g, *_ in gaps)
    lines += ["", f"host gaps between kernels: {gap_s / n * 1e3:.1f} ms per step in {len(gaps) // n} gaps; the "
                  f"largest:"]
    for g, step, a, b in sorted(gaps, key=lambda x: -x[0])[:5]:
        lines.append(f"  {g * 1e3:8.2f} ms  step {step}: after {a.name[-60:]}  before {b.name[-60:]}")
    lines += ["", "per step: profile total (first kernel start to last kernel end = kernels + gaps) vs the trainer's "
                  "logged step time",
              f"  {'step':>5s} {'kernels ms':>11s} {'gaps ms':>9s} {'total ms':>9s} {'trainer ms':>11s} {'ratio':>6s}"]
    rows = []
    for s in steps:
        ratio = s.span_s / s.trainer_step_s
        rows.append({"step": s.step, "kernels_s": s.busy_s, "gaps_s": s.span_s - s.busy_s, "total_s": s.span_s,
                     "trainer_step_s": s.trainer_step_s, "ratio": ratio})
        lines.append(f"  {s.step:5d} {s.busy_s * 1e3:11.1f} {(s.span_s - s.busy_s) * 1e3:9.1f} "
                     f"{s.span_s * 1e3:9.1f} {s.trainer_step_s * 1e3:11.1f} {ratio:6.3f}")
    numbers = {"steps": rows, "kernel_s_per_step": kernel_s / n,
               "phases_s_per_step": {ph: phase_s[ph] / n for ph in PHASES},
               "top_operators": [{"name": name, "calls_per_step": calls / n, "total_s": secs,
                                  "share": secs / kernel_s} for name, (calls, secs) in ranked[:top]],
               "gaps_s_per_step": gap_s / n}
    return "\n".join(lines), numbers


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m telechat_moe.profiling", description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="profile.output_dir of a run (default <output_dir>/profile), or its rank_<r>")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--steps", default="", help="only these profiled steps, e.g. 4 or 3-4")
    ap.add_argument("--top", type=int, default=15, help="operators listed")
    ap.add_argument("--json", help="also write the numbers as JSON")
    args = ap.parse_args(argv)
    try:
        wanted = None
        if args.steps:
            from precision.dump import DumpError, parse_steps
            try:
                wanted = parse_steps(args.steps, "--steps")
            except DumpError as e:
                raise ProfileError(str(e)) from None
        text, numbers = report(load_steps(Path(args.folder), args.rank, wanted), args.top)
    except InputError as e:
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return 2
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(numbers, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
