"""A measured pipeline step beside its simulation.

Each rank's executor records when every action and transfer of a step started and ended (`PipelineResult`); a
`StageTimeline` is that record as JSON-ready data (the trainer writes one per step and rank). `measured` turns the
timelines of one pipeline's stages into the simulator's `SimResult`, so `simulator.gantt` draws the real step as it
draws a simulated one; `measured_costs` reads the per-chunk forward and backward times and the transfer time off
them, and `compare` simulates the schedule on those costs: how much of the real step the stages spent not
computing, against what the simulator predicts for the same chunk times.

Clocks: `time.perf_counter` is CLOCK_MONOTONIC on Linux, one clock for every process of a machine, so the stages'
records of one machine share a time axis; ranks on different machines do not (their timelines would need an
offset measured by a collective first).

Idle share: 1 - compute / (stages x step), compute being the time inside forward and backward actions. It is the
bubble plus the time in point-to-point transfers and host work between actions; the simulator's blocking transfers
make its idle share the same sum, its bubble alone `SimResult.bubble_ratio`.

Two predictions for the same measured costs, because transports differ in what a send waits for:
- `simulator.simulate`, the planner's model: a send is eager (the sender goes on after `p2p`; HCCL's Send/Receive);
- `simulate_programs`: each rank runs its executor program (`executor.program`: its actions and transfers in the
  one global order), and a transfer is a rendezvous that starts when both ends have reached it and holds both for
  `p2p`: the CPU transport, an all-reduce on the pair's group. This is the transport that ran here.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import median

from parallel.pipeline.executor import Compute, program
from parallel.pipeline.schedules import Action, Kind, Schedule, build
from parallel.pipeline.simulator import Interval, SimResult, StageCosts, peak_activation, simulate


@dataclass(frozen=True)
class StageTimeline:
    """What one stage ran in one step, on its own clock (seconds)."""
    schedule: str                       # the builder's name (schedules.build)
    stages: int
    chunks: int
    microbatches: int
    stage: int
    actions: list                       # [kind "F"|"B", micro-batch, local chunk, start, end]
    transfers: list                     # [direction "F"|"B", micro-batch, producing virtual stage k, src, dst,
                                        #  sent here (else received), start, end]
    peak_in_flight: int                 # activations (chunk inputs) held at most
    peak_in_flight_bytes: int

    @classmethod
    def of(cls, schedule: Schedule, result) -> "StageTimeline":
        """From the executor's `PipelineResult` of one step."""
        return cls(schedule.name, schedule.stages, schedule.chunks, schedule.microbatches, result.stage,
                   [[r.action.kind.value, r.action.microbatch, r.action.chunk, r.start, r.end] for r in result.log],
                   [[t.transfer.direction.value, t.transfer.mb, t.transfer.k, t.transfer.src, t.transfer.dst,
                     t.send, t.start, t.end] for t in result.transfers],
                   result.peak_in_flight, result.peak_in_flight_bytes)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "StageTimeline":
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})

    def rebuild_schedule(self) -> Schedule:
        return build(self.schedule, self.stages, self.chunks, self.microbatches)


@dataclass(frozen=True)
class TimelineComparison:
    measured: SimResult
    simulated: SimResult            # the executor's programs with rendezvous transfers (the CPU transport)
    eager: SimResult                # the planner's simulator: eager sends
    costs: StageCosts
    measured_idle: float
    simulated_idle: float


def idle_share(result: SimResult) -> float:
    """The share of the stages' time spent outside forward and backward compute (see the module docstring)."""
    return 1.0 - sum(result.compute) / (result.schedule.stages * result.step_time)


def _check(timelines: list[StageTimeline]) -> Schedule:
    stages = sorted(t.stage for t in timelines)
    if not timelines or stages != list(range(timelines[0].stages)):
        raise ValueError(f"timelines: expected one per stage of the pipeline, got stages {stages}")
    return timelines[0].rebuild_schedule()


def measured(timelines: list[StageTimeline]) -> SimResult:
    """The stages' records as the simulator's timeline: time 0 is the first start of any stage; an action is an
    interval of pure compute; each transfer an interval of its stage's stream ("p2p": on the CPU transport both
    ends block in it), counted as exposed communication."""
    schedule = _check(timelines)
    p = schedule.stages
    zero = min(min([a[3] for a in t.actions] + [x[6] for x in t.transfers]) for t in timelines)
    end = max(max([a[4] for a in t.actions] + [x[7] for x in t.transfers]) for t in timelines)
    intervals, compute, exposed = [], [0.0] * p, [0.0] * p
    for t in sorted(timelines, key=lambda t: t.stage):
        for kind, mb, chunk, start, stop in t.actions:
            action = Action(Kind(kind), mb, chunk)
            intervals.append(Interval(t.stage, start - zero, stop - zero, kind, (action,), stop - start))
            compute[t.stage] += stop - start
        for direction, mb, k, src, dst, _, start, stop in t.transfers:
            if src == dst:
                continue
            # drawn in the colour of the chunk that produced it
            action = Action(Kind(direction), mb, schedule.stage_and_chunk(k)[1])
            intervals.append(Interval(t.stage, start - zero, stop - zero, "p2p", (action,)))
            exposed[t.stage] += stop - start
    return SimResult(schedule, end - zero, tuple(compute), tuple(exposed), tuple(0.0 for _ in range(p)),
                     tuple(intervals))


def measured_costs(timelines: list[StageTimeline]) -> StageCosts:
    """Per (stage, chunk) the median forward and backward time over the step's micro-batches; the transfer time
    the median over transfers of the shorter of its two ends' records (the end that arrived last did not wait:
    its time is the transfer's own)."""
    schedule = _check(timelines)
    p, v = schedule.stages, schedule.chunks
    times: dict[tuple[str, int, int], list[float]] = {}
    ends: dict[tuple, list[float]] = {}
    for t in timelines:
        for kind, _, chunk, start, stop in t.actions:
            times.setdefault((kind, t.stage, chunk), []).append(stop - start)
        for direction, mb, k, src, dst, _, start, stop in t.transfers:
            if src != dst:
                ends.setdefault((direction, mb, k), []).append(stop - start)
    grid = [[[median(times[(kind, s, c)]) for c in range(v)] for s in range(p)] for kind in ("F", "B")]
    pure = [min(d) for d in ends.values() if len(d) == 2]
    return StageCosts(tuple(map(tuple, grid[0])), tuple(map(tuple, grid[1])), p2p=median(pure) if pure else 0.0)


def simulate_programs(schedule: Schedule, costs: StageCosts) -> SimResult:
    """Each stage runs its executor program in order; a transfer between two stages starts when both have reached
    it and takes `costs.p2p` on both (see the module docstring); a hand-over inside a stage costs nothing. An
    action takes its compute and then its in-pass communication (exposed: the executor runs DualPipeV's paired
    actions one after the other, so nothing overlaps). Activation memory as `simulator.simulate` counts it."""
    p = schedule.stages
    programs = [program(schedule, s) for s in range(p)]
    at, clock = [0] * p, [0.0] * p
    compute, exposed = [0.0] * p, [0.0] * p
    intervals = []
    start_of, finish = {}, {}
    while any(at[s] < len(programs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while at[s] < len(programs[s]):
                e = programs[s][at[s]]
                if isinstance(e, Compute):
                    cost, comm = costs.compute(s, e.action), costs.comm(s, e.action)
                    intervals.append(Interval(s, clock[s], clock[s] + cost + comm, e.action.kind.value, (e.action,),
                                              cost))
                    start_of[(s, e.action)] = clock[s]
                    clock[s] += cost + comm
                    finish[(s, e.action)] = clock[s]
                    compute[s] += cost
                    exposed[s] += comm
                elif e.src != e.dst:
                    peer = e.dst if e.src == s else e.src
                    if at[peer] >= len(programs[peer]) or programs[peer][at[peer]] != e:
                        break                       # the other end has not reached it yet
                    start = max(clock[s], clock[peer])
                    action = Action(e.direction, e.mb, schedule.stage_and_chunk(e.k)[1])
                    for end in (s, peer):      # the wait before `start` is bubble; the transfer itself is not
                        intervals.append(Interval(end, start, start + costs.p2p, "p2p", (action,)))
                        exposed[end] += costs.p2p
                        clock[end] = start + costs.p2p
                    at[peer] += 1
                at[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("the executor programs deadlock")   # cannot happen: the global order is a total one
    return SimResult(schedule, max(clock), tuple(compute), tuple(exposed),
                     peak_activation(schedule, costs, start_of, finish), tuple(intervals))


def compare(timelines: list[StageTimeline]) -> TimelineComparison:
    real = measured(timelines)
    costs = measured_costs(timelines)
    sim = simulate_programs(real.schedule, costs)
    return TimelineComparison(real, sim, simulate(real.schedule, costs), costs, idle_share(real), idle_share(sim))
