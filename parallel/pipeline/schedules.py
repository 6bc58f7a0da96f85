"""Pipeline schedules as pure functions, and a validator for any schedule.

A schedule lists, per pipeline stage, the order in which that stage runs forward (F) and backward (B) passes of
(micro-batch, chunk) pairs. With `v` virtual chunks per stage the model is cut into p*v slices (virtual stages),
and the schedule's `ChunkLayout` says which slice chunk `c` of stage `s` holds (`Schedule.virtual_stage`; every
user of the mapping asks the schedule): Megatron's interleaved layout `c * p + s` runs the model through stages
0..p-1 with chunk 0, then again with chunk 1, and so on; DualPipeV's V layout runs down the stages with chunk 0
and back up with chunk 1, so stage 0 holds the first and the last slice (embedding and loss on one device) and the
turn at stage p-1 from chunk 0 to chunk 1 stays on that stage.

The overlapped variant and DualPipeV additionally name pairs of adjacent actions (a forward of one micro-batch and
a backward of another) that run as one fused unit, so that the communication of one hides behind the compute of the
other.
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


class ChunkLayout(str, Enum):
    """Which slice of the model (virtual stage) each chunk of each stage holds."""
    INTERLEAVED = "interleaved"  # every chunk runs down the stages: virtual stage c * p + s
    V = "v"  # even chunks run down the stages, odd chunks back up: stage p-1 hands each turn to itself

    def _upward(self, chunk: int) -> bool:
        return self is ChunkLayout.V and chunk % 2 == 1

    def virtual_stage(self, stages: int, stage: int, chunk: int) -> int:
        """The slice of the model that `chunk` of `stage` holds, with `stages` stages."""
        return chunk * stages + (stages - 1 - stage if self._upward(chunk) else stage)

    def stage_and_chunk(self, stages: int, k: int) -> tuple[int, int]:
        """The (stage, chunk) that holds virtual stage k: the inverse of `virtual_stage`."""
        chunk, offset = divmod(k, stages)
        return (stages - 1 - offset if self._upward(chunk) else offset), chunk


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
    # Which slice of the model each (stage, chunk) holds: ask `virtual_stage` and `stage_and_chunk`.
    chunk_layout: ChunkLayout = ChunkLayout.INTERLEAVED

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """The slice of the model that `chunk` of `stage` holds."""
        return self.chunk_layout.virtual_stage(self.stages, stage, chunk)

    def stage_and_chunk(self, k: int) -> tuple[int, int]:
        """The (stage, chunk) that holds virtual stage k: the inverse of `virtual_stage`."""
        return self.chunk_layout.stage_and_chunk(self.stages, k)

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
    mb, c = action.microbatch, action.chunk
    k = schedule.virtual_stage(stage, c)
    if action.kind is Kind.F:
        if k == 0:
            return []
        prev_stage, prev_chunk = schedule.stage_and_chunk(k - 1)
        return [(prev_stage, Action(Kind.F, mb, prev_chunk))]
    if k == schedule.stages * schedule.chunks - 1:  # the loss sits on the last virtual stage: its backward starts
        return [(stage, Action(Kind.F, mb, c))]      # from its own forward
    next_stage, next_chunk = schedule.stage_and_chunk(k + 1)
    return [(next_stage, Action(Kind.B, mb, next_chunk)), (stage, Action(Kind.F, mb, c))]


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
    (bench/planner_published.py when it approximated DualPipe by this schedule) 23% below the published throughput,
    because two passes of different micro-batches overlap as well whatever their chunk. Pairing different chunks
    at every step needs DualPipeV's V-shaped layer layout, not the interleaved one."""
    _check_microbatch_groups(p, v, m, "the overlapped schedule")
    stages, pairs = [], []
    for s in range(p):
        acts, warm = _interleaved_order(p, v, m, s, 1)
        stages.append(tuple(acts))
        pairs.append(frozenset(warm + 2 * i for i in range(m * v - warm)))
    return Schedule("overlapped", p, v, m, tuple(stages), tuple(pairs), async_p2p=True)


def _numbered(units: list[tuple[tuple[Kind, int], ...]]) -> tuple[tuple[Action, ...], frozenset[int]]:
    """A stage's actions from its units of (kind, chunk) passes, each pass of a chunk taking that chunk's next
    micro-batch; and the index of the first action of each two-pass (overlapped) unit."""
    taken: dict[tuple[Kind, int], int] = {}
    acts, pairs = [], set()
    for unit in units:
        if len(unit) == 2:
            pairs.add(len(acts))
        for kind, chunk in unit:
            mb = taken.get((kind, chunk), 0)
            taken[(kind, chunk)] = mb + 1
            acts.append(Action(kind, mb, chunk))
    return tuple(acts), frozenset(pairs)


def _dualpipe_v_units(p: int, m: int, s: int) -> list[tuple[tuple[Kind, int], ...]]:
    """Stage s's units in DualPipeV's eight steps, its weight-gradient passes (W) folded into their backwards."""
    f0, f1, b0, b1 = (Kind.F, 0), (Kind.F, 1), (Kind.B, 0), (Kind.B, 1)
    below = p - 1 - s  # stages between s and the turn at p-1
    steady = [(f0, b1), (f1, b0)] * (m - 2 * p + s + 1)
    if s == p - 1:
        # DualPipeV runs this stage's first steady pair unfused, to send the activation of step 2's last F1 (held
        # back there) between the two; this model's sends leave eagerly anyway, the order is kept as DeepSeek's
        steady[0:1] = [(f0,), (b1,)]
    return ([(f0,)] * 2 * below            # 1: warm-up down the V
            + [(f0,), (f1,)] * (s + 1)     # 2: both chunks in turn
            + [(b1,), (f1,)] * below       # 3: chunk 1's first backwards (B1 W1 F1 in DualPipeV)
            + steady                       # 4: F of one chunk overlapped with B of the other
            + [(b1,), (f1, b0)] * below    # 5: the last forwards
            + [(b1,), (b0,)] * (s + 1)     # 6: cool-down of both chunks
            + [(b0,)] * below)             # 7: chunk 0's last backwards (W B0 in DualPipeV); 8 is W alone


def dualpipe_v_unfit(p: int, v: int, m: int, names: dict[str, str] | None = None) -> tuple[str, str] | None:
    """Why DualPipeV cannot run p stages of v chunks over m micro-batches, or None where it can: (the size at
    fault, "chunks" or "microbatches"; the rule it breaks, worded in the caller's `names` for p, v and m). The one
    statement of the rule: the builder raises it, the planner offers DualPipeV only where it is None
    (refine.schedules_for), `--evaluate` words it in its keys (plan.parse_schedule). One stage builds (its V turns
    on itself); a layout of two chunks has more than one stage by the layout rules (layout.interleave_has_stages)."""
    n = {"p": "p", "v": "v", "m": "m", **(names or {})}
    if v != 2:
        return "chunks", f"runs 2 chunks per stage (a V), so {n['v']}=2, got {n['v']}={v}"
    if m < 2 * p:
        return "microbatches", f"needs {n['m']} >= 2*{n['p']} = {2 * p} micro-batches, got {n['m']}={m}"
    return None


def dualpipe_v(p: int, m: int, v: int = 2) -> Schedule:
    """DeepSeek's DualPipeV (DualPipe cut in half, github.com/deepseek-ai/DualPipe `dualpipev.py`): two chunks per
    stage in the V layout (stage s holds virtual stages s and 2p-1-s; embedding and loss on stage 0). Stage s warms
    up with 2(p-1-s) forwards of chunk 0, then runs both chunks, and in its steady state overlaps the forward of one
    chunk with the backward of the other (`pairs`: each all-to-all hides behind the other pass's compute), for
    m - 2p + s + 1 rounds of F0+B1, F1+B0; transfers run on their own stream. Needs m >= 2p micro-batches
    (`dualpipe_v_unfit`).

    Simplification: DualPipeV splits each backward into an input-gradient pass B and a weight-gradient pass W and
    defers some W's into the warm-up and cool-down bubbles (zero bubble). Actions here are F and B only, so each W
    runs inside its B: the order is DualPipeV's with every W dropped. On uniform stages the bubble is then the
    published (p-1)(F&B + B - 3W) with W = 0 (`simulator.dualpipe_v_bubble`)."""
    _check_sizes(p, v, m)
    unfit = dualpipe_v_unfit(p, v, m)
    if unfit:
        raise ScheduleError(f"{unfit[0]}: DualPipeV {unfit[1]}")
    stages, pairs = zip(*(_numbered(_dualpipe_v_units(p, m, s)) for s in range(p)))
    return Schedule("dualpipev", p, 2, m, stages, pairs, async_p2p=True, chunk_layout=ChunkLayout.V)


SCHEDULES = {
    "gpipe": lambda p, v, m: gpipe(p, m, v),
    "1f1b": lambda p, v, m: one_f_one_b(p, m),
    "interleaved": interleaved_1f1b,
    "overlapped": overlapped_1f1b,
    "dualpipev": lambda p, v, m: dualpipe_v(p, m, v),
}


def build(name: str, p: int, v: int, m: int) -> Schedule:
    """Schedule by name; 1f1b ignores v (it has one chunk per stage), dualpipev needs v = 2."""
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
