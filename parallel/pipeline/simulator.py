"""Event-driven timeline of a pipeline schedule: step time, bubble, exposed communication, activation memory.

Timing model (per stage one compute stream):
- a forward/backward of (stage, chunk) takes its compute time plus its in-pass communication (the expert
  all-to-all of an MoE chunk), which is exposed: the stream waits for it;
- an overlapped (F, B) pair takes cF + cB plus whatever part of each one's communication the other's compute
  cannot cover: cF + cB + max(0, aF - cB) + max(0, aB - cF);
- a point-to-point transfer to the neighbouring stage takes `p2p` seconds; the receiver may start `p2p` after the
  sender finished. Unless the schedule runs transfers on their own stream (`async_p2p`), the sender's stream is
  busy for that time too (blocking send, as in non-overlapped 1F1B). Either way every transfer is an interval of
  the timeline: a blocking one on the compute stream, an asynchronous one on the stage's communication stream,
  where it costs the compute stream nothing (it counts neither as compute nor as exposed communication).
Activation memory of (stage, chunk) is held from the start of its forward to the end of its backward.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallel.pipeline.schedules import Action, Kind, Schedule, dependencies, validate


@dataclass(frozen=True)
class StageCosts:
    """Per (stage, chunk) costs of one micro-batch: seconds for time, any unit for activation memory."""
    forward: tuple[tuple[float, ...], ...]
    backward: tuple[tuple[float, ...], ...]
    forward_comm: tuple[tuple[float, ...], ...] | None = None
    backward_comm: tuple[tuple[float, ...], ...] | None = None
    activation: tuple[tuple[float, ...], ...] | None = None
    p2p: float = 0.0

    @classmethod
    def uniform(cls, p: int, v: int, forward: float = 1.0, backward: float = 2.0, p2p: float = 0.0,
                comm_fraction: float = 0.0, activation: float = 1.0) -> "StageCosts":
        """Every stage equal; a stage's per-micro-batch work split evenly over its v chunks, of which
        `comm_fraction` (relative to compute) is in-pass communication."""
        def grid(x: float) -> tuple[tuple[float, ...], ...]:
            return tuple(tuple(x / v for _ in range(v)) for _ in range(p))

        return cls(grid(forward), grid(backward), grid(forward * comm_fraction), grid(backward * comm_fraction),
                   grid(activation), p2p)

    def compute(self, stage: int, a: Action) -> float:
        return (self.forward if a.kind is Kind.F else self.backward)[stage][a.chunk]

    def comm(self, stage: int, a: Action) -> float:
        table = self.forward_comm if a.kind is Kind.F else self.backward_comm
        return table[stage][a.chunk] if table is not None else 0.0

    def act(self, stage: int, chunk: int) -> float:
        return self.activation[stage][chunk] if self.activation is not None else 1.0


@dataclass(frozen=True)
class Interval:
    stage: int
    start: float
    end: float
    kind: str  # "F", "B", "FB" (overlapped pair), "p2p" (blocking send) or "p2p-async" (on the comm stream)
    actions: tuple[Action, ...]  # for a transfer: the passes whose outputs it sends
    compute: float = 0.0  # of end - start, the part spent computing; the rest waited on communication


@dataclass(frozen=True)
class SimResult:
    schedule: Schedule
    step_time: float
    compute: tuple[float, ...]  # per stage: pure compute seconds
    exposed_comm: tuple[float, ...]  # per stage: seconds the stream waited on communication
    peak_activation: tuple[float, ...]
    intervals: tuple[Interval, ...]

    @property
    def bubble_ratio(self) -> float:
        """Idle fraction of all stages' time: neither computing nor waiting on communication."""
        total = self.step_time * self.schedule.stages
        return 1.0 - (sum(self.compute) + sum(self.exposed_comm)) / total

    @property
    def exposed_comm_ratio(self) -> float:
        return sum(self.exposed_comm) / (self.step_time * self.schedule.stages)


def theoretical_bubble(p: int, m: int, v: int = 1) -> float:
    """Bubble of (interleaved) 1F1B for uniform stages and free communication: (p-1) / (v*m + p-1)."""
    return (p - 1) / (v * m + p - 1)


def dualpipe_v_bubble(p: int, m: int, forward: float = 1.0, backward: float = 2.0) -> float:
    """Bubble of DualPipeV on p stages (2p virtual stages) for uniform stages and free communication, from the
    idle time DeepSeek publishes, (PP/2 - 1)(F&B + B - 3W) with PP = 2p and per-chunk passes, taken with W = 0
    (the backward not split, as `schedules.dualpipe_v` runs it) and F&B = F + B: (p-1)(F + 2B) beside the
    2m(F + B) of compute. `forward`, `backward`: a stage's per-micro-batch times, half of each per chunk."""
    f, b = forward / 2, backward / 2
    idle = (p - 1) * (f + 2 * b)
    return idle / (2 * m * (f + b) + idle)


def _sends(schedule: Schedule, stage: int, a: Action) -> bool:
    """Whether the action's output goes to another stage (activations forward, gradients backward); a hand-over
    between two chunks of one stage (DualPipeV's turn) is free."""
    k, last = schedule.virtual_stage(stage, a.chunk), schedule.stages * schedule.chunks - 1
    nxt = k + 1 if a.kind is Kind.F else k - 1
    return 0 <= nxt <= last and schedule.stage_and_chunk(nxt)[0] != stage


def simulate(schedule: Schedule, costs: StageCosts) -> SimResult:
    report = validate(schedule)
    p = schedule.stages
    slots = [schedule.slots(s) for s in range(p)]
    finish: dict[tuple[int, Action], float] = {}
    start_of: dict[tuple[int, Action], float] = {}
    free = [0.0] * p
    compute = [0.0] * p
    exposed = [0.0] * p
    intervals: list[Interval] = []
    for s, i in report.order:
        slot = slots[s][i]
        ready = free[s]
        for a in slot:
            for t, dep in dependencies(schedule, s, a):
                ready = max(ready, finish[(t, dep)] + (costs.p2p if t != s else 0.0))
        c = [costs.compute(s, a) for a in slot]
        w = [costs.comm(s, a) for a in slot]
        if len(slot) == 2:  # overlapped pair: each one's communication hides behind the other's compute
            duration = c[0] + c[1] + max(0.0, w[0] - c[1]) + max(0.0, w[1] - c[0])
        else:
            duration = c[0] + w[0]
        end = ready + duration
        compute[s] += sum(c)
        exposed[s] += duration - sum(c)
        intervals.append(Interval(s, ready, end, "".join(a.kind.value for a in slot), slot, sum(c)))
        for a in slot:
            start_of[(s, a)] = ready
            finish[(s, a)] = end
        free[s] = end
        sending = tuple(a for a in slot if _sends(schedule, s, a))
        if sending and costs.p2p:
            if schedule.async_p2p:  # each transfer on the communication stream, concurrently with the next unit
                intervals += [Interval(s, end, end + costs.p2p, "p2p-async", (a,)) for a in sending]
            else:
                n = len(sending)
                intervals.append(Interval(s, end, end + n * costs.p2p, "p2p", sending))
                free[s] = end + n * costs.p2p
                exposed[s] += n * costs.p2p
    step = max(free)  # every transfer ends before the compute that receives it
    return SimResult(schedule, step, tuple(compute), tuple(exposed), peak_activation(schedule, costs, start_of, finish),
                     tuple(intervals))


def peak_activation(schedule: Schedule, costs: StageCosts, start_of: dict, finish: dict) -> tuple[float, ...]:
    """Per stage, the most activation memory held at once: (stage, chunk)'s from its forward's start
    (`start_of[(stage, action)]`) to its backward's end (`finish`)."""
    peak = []
    for s in range(schedule.stages):
        events = []
        for a in schedule.actions[s]:
            if a.kind is Kind.F:
                events.append((start_of[(s, a)], 1, costs.act(s, a.chunk)))
            else:
                events.append((finish[(s, a)], 0, -costs.act(s, a.chunk)))  # frees sort before allocations
        held = top = 0.0
        for _, _, delta in sorted(events):
            held += delta
            top = max(top, held)
        peak.append(top)
    return tuple(peak)


def gantt(result: SimResult, path: str, title: str | None = None) -> None:
    """Write a Gantt chart PNG: one row per stage, colour per chunk, light forward, dark backward; an overlapped
    pair is drawn as a forward half over a backward half; exposed communication and blocking sends hatched. Every
    point-to-point transfer also appears on a thin communication row under its stage's compute row (activations
    sent on above, gradients sent back below), drawn at least 0.3% of the step wide so that a short one stays
    visible; a blocking send shows there and as the hatched gap it leaves on the compute row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sched = result.schedule
    cmap = plt.get_cmap("tab10")
    comm_row = any(iv.kind.startswith("p2p") for iv in result.intervals)
    # (bottom, height) of a stage's compute band and of its communication row, relative to the row's bottom
    band, comm = ((0.32, 0.62), (0.04, 0.22)) if comm_row else ((0.1, 0.8), None)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.22 * len(sched.actions[0]) + 2), 0.6 * sched.stages + 1.6))
    for iv in result.intervals:
        y = sched.stages - 1 - iv.stage
        width = iv.end - iv.start
        if iv.kind.startswith("p2p"):
            if iv.kind == "p2p":
                ax.broken_barh([(iv.start, width)], (y + band[0], band[1]), facecolors="lightgrey", hatch="///",
                               edgecolor="grey", linewidth=0.3)
            each = width / len(iv.actions)  # a blocking interval holds its unit's sends one after the other
            for n, a in enumerate(iv.actions):
                half = comm[1] / 2
                ax.broken_barh([(iv.start + n * each, max(each, 0.003 * result.step_time))],
                               (y + comm[0] + (half if a.kind is Kind.F else 0.0), half),
                               facecolors=[cmap(a.chunk % 10)], alpha=0.45 if a.kind is Kind.F else 1.0,
                               edgecolor="black", linewidth=0.2)
            continue
        pair = len(iv.actions) == 2
        halves = [(a, (y + band[0] + band[1] / 2, band[1] / 2) if pair and n == 0 else
                   (y + band[0], band[1] / 2) if pair else (y + band[0], band[1]))
                  for n, a in enumerate(iv.actions)]
        for a, (bottom, height) in halves:
            color = cmap(a.chunk % 10)
            alpha = 0.45 if a.kind is Kind.F else 1.0
            ax.broken_barh([(iv.start, width)], (bottom, height), facecolors=[color], alpha=alpha,
                           edgecolor="black", linewidth=0.4)
            if width - iv.compute > 1e-12:  # the stream waited on this pass's communication
                ax.broken_barh([(iv.start + iv.compute, width - iv.compute)], (bottom, height), facecolors="none",
                               hatch="xxx", edgecolor="white", linewidth=0)
            if width > 0.012 * result.step_time:
                ax.text(iv.start + width / 2, bottom + height / 2, str(a.microbatch), ha="center",
                        va="center", fontsize=6 if pair else 7)
    ax.set_yticks([sched.stages - 1 - s + band[0] + band[1] / 2 for s in range(sched.stages)])
    ax.set_yticklabels([f"stage {s}" for s in range(sched.stages)])
    ax.set_xlim(0, result.step_time)
    ax.set_xlabel("time")
    legend = [Patch(facecolor=cmap(c % 10), alpha=0.45, label=f"F chunk {c}") for c in range(sched.chunks)]
    legend += [Patch(facecolor=cmap(c % 10), label=f"B chunk {c}") for c in range(sched.chunks)]
    if any(not iv.kind.startswith("p2p") and iv.end - iv.start - iv.compute > 1e-12 for iv in result.intervals):
        legend.append(Patch(facecolor="grey", hatch="xxx", edgecolor="white", label="exposed all-to-all"))
    if any(iv.kind == "p2p" for iv in result.intervals):
        legend.append(Patch(facecolor="lightgrey", hatch="///", edgecolor="grey", label="blocking send"))
    if comm_row:
        legend.append(Patch(facecolor="white", edgecolor="black",
                            label="p2p send (thin row: activations above, gradients below)"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(4, len(legend)),
              fontsize=7, frameon=False)
    ax.set_title(title or f"{sched.name}: p={sched.stages} v={sched.chunks} m={sched.microbatches}  "
                 f"step {result.step_time:.2f}  bubble {100 * result.bubble_ratio:.1f}%", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
