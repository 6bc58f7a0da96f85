"""Pipeline schedules as pure functions, and a validator for any schedule.

A schedule lists, per pipeline stage, the order in which that stage runs forward (F) and backward (B) passes of
(micro-batch, chunk) pairs. With `v` virtual chunks per stage, chunk `c` of stage `s` holds virtual stage
`c * p + s` (Megatron's interleaved layout): the model runs through stages 0..p-1 with chunk 0, then again with
chunk 1, and so on, so every stage holds non-adjacent slices of the model.

The overlapped variant additionally names pairs of adjacent actions (a forward of one micro-batch and a backward
of another) that run as one fused unit, so that the communication of one hides behind the compute of the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from oneline import InputError


class Kind(str, Enum):
    F = "F"
    B = "B"


@dataclass(frozen=True, order=True)
class Action:
    kind: Kind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class ScheduleError(InputError):
    """A schedule that cannot run; the message names the stage and action."""


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int
    chunks: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    # Per stage: indices i such that actions[i] (an F) and actions[i+1] (a B) run as one overlapped unit.
    pairs: tuple[frozenset[int], ...] = field(default=())
    # True when point-to-point transfers run on their own stream instead of blocking the compute stream.
    async_p2p: bool = False

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    def slots(self, stage: int) -> list[tuple[Action, ...]]:
        """The stage's actions grouped into execution units: a fused (F, B) pair or a single action."""
        acts, paired = self.actions[stage], self.pairs[stage] if self.pairs else frozenset()
        out, i = [], 0
        while i < len(acts):
            if i in paired:
                out.append((acts[i], acts[i + 1]))
                i += 2
            else:
                out.append((acts[i],))
                i += 1
        return out


def dependencies(schedule: Schedule, stage: int, action: Action) -> list[tuple[int, Action]]:
    """(stage, action) pairs that must finish before `action` may start on `stage`."""
    p, v = schedule.stages, schedule.chunks
    mb, c = action.microbatch, action.chunk
    k = schedule.virtual_stage(stage, c)
    if action.kind is Kind.F:
        if k == 0:
            return []
        prev = k - 1
        return [(prev % p, Action(Kind.F, mb, prev // p))]
    if k == p * v - 1:  # the loss sits on the last virtual stage: its backward starts from its own forward
        return [(stage, Action(Kind.F, mb, c))]
    nxt = k + 1
    return [(nxt % p, Action(Kind.B, mb, nxt // p)), (stage, Action(Kind.F, mb, c))]


# ---- schedule builders ---------------------------------------------------------------------------------------------
def _check_sizes(p: int, v: int, m: int) -> None:
    for name, value in (("stages", p), ("chunks", v), ("microbatches", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name}: expected a positive integer, got {value!r}")


def _check_microbatch_groups(p: int, v: int, m: int, what: str) -> None:
    # Megatron's order runs micro-batches in groups of p through all chunks; a short last group lacks the warm-up
    # that covers the round trip through the other stages, and the stages deadlock (the validator shows it).
    _check_sizes(p, v, m)
    if m % p:
        raise ScheduleError(f"microbatches: {what} needs a multiple of the {p} stages, got {m}")


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """All forwards (chunk-major, as data flows), then all backwards in reverse order: the largest bubble and the
    most activations in flight; the baseline."""
    _check_sizes(p, v, m)
    fwd = [Action(Kind.F, mb, c) for c in range(v) for mb in range(m)]
    bwd = [Action(Kind.B, mb, c) for c in reversed(range(v)) for mb in range(m)]
    return Schedule("gpipe", p, v, m, tuple(tuple(fwd + bwd) for _ in range(p)))


def one_f_one_b(p: int, m: int) -> Schedule:
    """Non-interleaved 1F1B (PipeDream-flush): stage s warms up with p-s-1 forwards, then alternates one forward
    and one backward, then drains. At most p-s micro-batches in flight on stage s."""
    _check_sizes(p, 1, m)
    stages = []
    for s in range(p):
        warm = min(p - s - 1, m)
        acts = [Action(Kind.F, mb) for mb in range(warm)]
        for i in range(m - warm):
            acts += [Action(Kind.F, warm + i), Action(Kind.B, i)]
        acts += [Action(Kind.B, mb) for mb in range(m - warm, m)]
        stages.append(tuple(acts))
    return Schedule("1f1b", p, 1, m, tuple(stages))


def _interleaved_table(p: int, v: int, m: int) -> list[tuple[int, int]]:
    """Megatron's order of (micro-batch, chunk) for forwards: groups of p micro-batches run through chunk 0, then
    the same group through chunk 1, and so on."""
    return [(first + i, c) for first in range(0, m, p) for c in range(v) for i in range(p)]


def _interleaved_order(p: int, v: int, m: int, s: int, extra_warmup: int) -> tuple[list[Action], int]:
    table = _interleaved_table(p, v, m)
    total = m * v
    if m == p:
        warm = total  # Megatron: with exactly p micro-batches every forward is warm-up
    else:
        warm = min((p - s - 1) * 2 + (v - 1) * p + extra_warmup, total)
    fwd = [Action(Kind.F, mb, c) for mb, c in table]
    bwd = [Action(Kind.B, mb, v - 1 - c) for mb, c in table]
    acts = fwd[:warm]
    for i in range(total - warm):
        acts += [fwd[warm + i], bwd[i]]
    acts += bwd[total - warm:]
    return acts, warm


def interleaved_1f1b(p: int, v: int, m: int) -> Schedule:
    """Megatron's interleaved 1F1B: v chunks per stage, warm-up of 2(p-s-1) + (v-1)p forwards on stage s, then
    one forward / one backward. Bubble (p-1)/(v*m + p-1) for uniform stages, at the price of v times more
    point-to-point transfers."""
    _check_microbatch_groups(p, v, m, "interleaved 1F1B")
    stages = tuple(tuple(_interleaved_order(p, v, m, s, 0)[0]) for s in range(p))
    return Schedule("interleaved" if v > 1 else "interleaved(v=1)", p, v, m, stages)


def overlapped_1f1b(p: int, v: int, m: int) -> Schedule:
    """Interleaved 1F1B whose steady state runs each forward together with the following backward (another
    micro-batch) as one overlapped unit, as Megatron's combined 1F1B does for expert-parallel overlap: the expert
    all-to-all of one hides behind the compute of the other, and point-to-point transfers run on their own stream.
    One extra warm-up forward makes the fused forward independent of the backward it is paired with (the backward
    no longer waits for a forward that sits in the same unit on the next stage), so the activations in flight are
    those of interleaved 1F1B plus one.

    In Megatron's order forwards and backwards come in runs of p passes of one chunk, and the offset between the
    two runs shifts by two passes from one stage to the next, so with v > 1 a pair holds two different chunks on
    some steps and one chunk (two micro-batches) on others: with p=4, v=2, 16 of the 32 steady-state pairs. Fusing
    only the pairs of different chunks was measured: 13-21% longer steps at v=2 and the DeepSeek-V3 check
    (bench/planner_deepseek_v3.py, DualPipe approximated by this schedule) 23% below the published throughput,
    because two passes of different micro-batches overlap as well whatever their chunk. Pairing different chunks
    at every step needs DualPipeV's V-shaped layer layout, not the interleaved one."""
    _check_microbatch_groups(p, v, m, "the overlapped schedule")
    stages, pairs = [], []
    for s in range(p):
        acts, warm = _interleaved_order(p, v, m, s, 1)
        stages.append(tuple(acts))
        pairs.append(frozenset(warm + 2 * i for i in range(m * v - warm)))
    return Schedule("overlapped", p, v, m, tuple(stages), tuple(pairs), async_p2p=True)


SCHEDULES = {
    "gpipe": lambda p, v, m: gpipe(p, m, v),
    "1f1b": lambda p, v, m: one_f_one_b(p, m),
    "interleaved": interleaved_1f1b,
    "overlapped": overlapped_1f1b,
}


def build(name: str, p: int, v: int, m: int) -> Schedule:
    """Schedule by name; 1f1b ignores v (it has one chunk per stage)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule: expected one of {sorted(SCHEDULES)}, got {name!r}")
    return SCHEDULES[name](p, v, m)


# ---- validation ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleReport:
    peak_in_flight: tuple[int, ...]  # per stage: most (micro-batch, chunk) activations held at once
    peak_in_flight_by_chunk: tuple[tuple[int, ...], ...]  # per stage and chunk: most micro-batches held at once
    order: tuple[tuple[int, int], ...]  # a feasible global execution order: (stage, slot index)


def _check_coverage(schedule: Schedule) -> None:
    p, v, m = schedule.stages, schedule.chunks, schedule.microbatches
    if len(schedule.actions) != p:
        raise ScheduleError(f"schedule {schedule.name}: {len(schedule.actions)} stage lists for {p} stages")
    if schedule.pairs and len(schedule.pairs) != p:
        raise ScheduleError(f"schedule {schedule.name}: {len(schedule.pairs)} pair sets for {p} stages")
    expected = {Action(k, mb, c) for k in Kind for mb in range(m) for c in range(v)}
    for s, acts in enumerate(schedule.actions):
        seen: set[Action] = set()
        for a in acts:
            if a in seen:
                raise ScheduleError(f"stage {s}: {a} appears twice")
            if a not in expected:
                raise ScheduleError(f"stage {s}: {a} is outside {m} micro-batches x {v} chunks")
            if a.kind is Kind.B and Action(Kind.F, a.microbatch, a.chunk) not in seen:
                raise ScheduleError(f"stage {s}: {a} runs before its forward")
            seen.add(a)
        if missing := sorted(expected - seen):
            raise ScheduleError(f"stage {s}: missing {', '.join(map(str, missing[:4]))}"
                                + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
        for i in (schedule.pairs[s] if schedule.pairs else ()):
            if not (0 <= i < len(acts) - 1 and acts[i].kind is Kind.F and acts[i + 1].kind is Kind.B):
                raise ScheduleError(f"stage {s}: overlapped pair at {i} is not a forward followed by a backward")
            if acts[i].microbatch == acts[i + 1].microbatch and acts[i].chunk == acts[i + 1].chunk:
                raise ScheduleError(f"stage {s}: overlapped pair {acts[i]}+{acts[i + 1]} is one pass twice")
            if i + 1 in schedule.pairs[s]:
                raise ScheduleError(f"stage {s}: overlapped pairs at {i} and {i + 1} share an action")


def validate(schedule: Schedule) -> ScheduleReport:
    """Check every stage runs each (micro-batch, chunk) F and B exactly once, B after F, that each overlapped pair
    is a forward and a backward of different passes, and that the stages can make progress together (no
    cross-stage dependency cycle); report activations in flight per stage."""
    _check_coverage(schedule)
    p = schedule.stages
    slots = [schedule.slots(s) for s in range(p)]
    done: set[tuple[int, Action]] = set()
    head = [0] * p
    order = []
    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            while head[s] < len(slots[s]):
                slot = slots[s][head[s]]
                if not all(d in done for a in slot for d in dependencies(schedule, s, a)):
                    break
                done.update((s, a) for a in slot)
                order.append((s, head[s]))
                head[s] += 1
                progressed = True
    if any(head[s] < len(slots[s]) for s in range(p)):
        waits = []
        for s in range(p):
            if head[s] < len(slots[s]):
                slot = slots[s][head[s]]
                need = [f"{a} on stage {t}" for x in slot for t, a in dependencies(schedule, s, x)
                        if (t, a) not in done]
                waits.append(f"stage {s} at {'+'.join(map(str, slot))} waits for {', '.join(need)}")
        raise ScheduleError(f"schedule {schedule.name} deadlocks: " + "; ".join(waits))
    peak, by_chunk = [], []
    for acts in schedule.actions:
        held, top = 0, 0
        held_c, top_c = [0] * schedule.chunks, [0] * schedule.chunks
        for a in acts:
            step = 1 if a.kind is Kind.F else -1
            held += step
            held_c[a.chunk] += step
            top = max(top, held)
            top_c[a.chunk] = max(top_c[a.chunk], held_c[a.chunk])
        peak.append(top)
        by_chunk.append(tuple(top_c))
    return ScheduleReport(tuple(peak), tuple(by_chunk), tuple(order))
