"""Place the model's units (embedding, dense layers, MoE layers, MTP, output head) on pipeline stages x chunks.

The model is a chain of units cut into p*v contiguous segments; segment k is the (stage, chunk) the schedule's
chunk layout maps virtual stage k to (schedules.ChunkLayout: by default Megatron/MindFormers' interleaved order,
chunk k // p of stage k % p; DualPipeV's V puts segments k and 2p-1-k on stage k), so a stage's time is the sum of
v non-adjacent segments. `balance` minimises the schedule's steady-state period (`step_terms`), then the slowest
stage's time, under a per-stage memory limit exactly, as a mixed-integer program (scipy.optimize.milp / HiGHS);
`equal_layer_split` is the naive split it is compared with. A unit may offer `choices` (its costs under each
recompute mode): the MILP then also picks how many units of each segment run each choice. With the options the
planner's cost model assumes (dense layers in the first segment, the chunks of a stage within one layer of each
other, the step itself as the objective, memory over the schedule's held-micro-batch profiles) the same program
gives the planner's layers and recompute per chunk (parallel.planner.stage_ilp).

Units carry plain numbers (seconds, bytes). `planner_units` takes them from the planner's cost model
(parallel.planner.cost_model) for one layout on one cluster: per block forward and backward time with the TP
and expert all-to-all communication it charges and the recompute it runs, weights + gradients + optimizer
states, activations per micro-batch in flight and the block's transient working memory.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from oneline import InputError
from parallel.layout import RECOMPUTE, ParallelLayout
from parallel.planner.blocks import block_costs
from parallel.planner.cost_model import StagePlan, p2p_time, stage_memory, stage_parts
from parallel.pipeline.placement_milp import StageProgram
from parallel.pipeline.schedules import ChunkLayout
from parallel.pipeline.simulator import StageCosts
from parallel.planner.workload import Layouts, Workload

KINDS = ("embedding", "dense", "moe", "mtp", "head")


class PlacementError(InputError):
    """No placement satisfies the request; the message says which constraint."""


@dataclass(frozen=True)
class Unit:
    name: str
    kind: str  # one of KINDS
    forward: float  # time of one micro-batch's forward
    backward: float
    weight_memory: float = 0.0  # bytes held regardless of micro-batches: weights, gradients, optimizer states
    activation_memory: float = 0.0  # bytes held per micro-batch in flight
    layer: int = -1  # decoder layer index of dense/moe units
    transient: float = 0.0  # bytes alive only while the unit runs: a stage holds its units' largest
    forward_comm: float = 0.0  # of `forward`, the in-pass communication (TP, expert all-to-all)
    backward_comm: float = 0.0
    recompute: str | None = None  # the recompute mode these costs assume (cost_model.RECOMPUTE), None: no layer
    # the same unit under each recompute mode `balance` may pick from (same weights); (): it runs as given
    choices: tuple["Unit", ...] = ()

    @property
    def time(self) -> float:
        return self.forward + self.backward


@dataclass(frozen=True)
class PlacementOptions:
    # MTP on another stage than the output head (it then holds its own copy of the shared head weights); off:
    # MTP and the head share the last segment, as MindFormers places them.
    mtp_apart_from_head: bool = False
    # MTP's embedding lookup done on the first stage next to the main one, its result sent along; off: the MTP
    # stage holds its own copy of the embedding table.
    mtp_embedding_on_first_stage: bool = False
    # off: neither a second lookup nor a copy of the embedding (the cost model's copy on the last stage taken out)
    mtp_embedding_copy: bool = True
    memory_limit: float = math.inf  # bytes per device
    # the planner's cost model: the dense layers in the first segment (chunk 0 of stage 0, with the embedding),
    # every segment holding a layer and the chunks of a stage at most one layer apart (the head's may hold fewer)
    dense_in_first_segment: bool = False
    even_chunks: bool = False
    # with even_chunks: the first segment may hold the embedding alone and the last one the MTP and head alone (no
    # layer, and outside the one-layer spread), as Megatron's DeepSeek-V3 layouts place them
    bare_ends: bool = False
    # minimise the step of this many micro-batches (`step_terms`) instead of the period alone: the same placements
    # unless recompute choices change the work
    micro_batches: int | None = None
    # which segment each (stage, chunk) holds, and so which schedule's step the objective is
    chunk_layout: ChunkLayout = ChunkLayout.INTERLEAVED


def step_terms(chunk_layout: ChunkLayout, stages: int, chunks: int, m: int) -> tuple[float, float, float]:
    """The pipeline step of m micro-batches as period_weight * period + forward_weight * (forward work) +
    backward_weight * (backward work), work summed over all stages and chunks; `step_period` says what the period is.
    Interleaved 1F1B: in steady state every stage runs chunk 0, then chunk 1, ... of successive micro-batches in
    lock-step, so the period is the sum over chunks of the slowest stage's chunk and filling / draining costs the
    work spread over the chunks: (m - 1/v) * period + work / v. DualPipeV (the V layout): each stage runs one F0+B1
    and one F1+B0 per micro-batch, so the period is the slowest stage's time (both chunks), m of them, plus the
    bubble DeepSeek publishes, (p-1)(F&B + B - 3W) per chunk pass taken with W = 0 and F&B = F + B (as
    schedules.dualpipe_v runs it): (p-1)(F + 2B), the per-chunk F and B written as the work over its 2p chunks."""
    if chunk_layout is ChunkLayout.V:
        return float(m), (stages - 1) / (2 * stages), (stages - 1) / stages
    return m - 1 / chunks, 1 / chunks, 1 / chunks


def step_period(chunk_layout: ChunkLayout, time: np.ndarray) -> np.ndarray:
    """`step_terms`' period of chunk times [..., stage, chunk]."""
    if chunk_layout is ChunkLayout.V:
        return time.sum(axis=-1).max(axis=-1)
    return time.max(axis=-2).sum(axis=-1)


@dataclass(frozen=True)
class Placement:
    stages: int
    chunks: int
    units: tuple[Unit, ...]
    sizes: tuple[int, ...]  # units per segment, segment k at chunk_layout.stage_and_chunk(stages, k)
    stage_time: tuple[float, ...]
    stage_memory: tuple[float, ...]  # peak bytes: fixed part + activations of the in-flight micro-batches
    stage_fixed_memory: tuple[float, ...]  # weights, gradients, optimizer states and the largest transient
    method: str
    gap: float = 0.0  # relative MIP gap where the solver stopped (0: proven optimal)
    chunk_layout: ChunkLayout = ChunkLayout.INTERLEAVED

    @property
    def segments(self) -> list[tuple[Unit, ...]]:
        bounds = np.concatenate([[0], np.cumsum(self.sizes)])
        return [self.units[bounds[k]:bounds[k + 1]] for k in range(len(self.sizes))]

    def location(self, name: str) -> tuple[int, int]:
        """(stage, chunk) of a unit."""
        for k, seg in enumerate(self.segments):
            if any(u.name == name for u in seg):
                return self.chunk_layout.stage_and_chunk(self.stages, k)
        raise KeyError(name)

    @property
    def slowest_over_mean(self) -> float:
        return max(self.stage_time) / (sum(self.stage_time) / self.stages)

    def stage_costs(self, p2p: float = 0.0) -> StageCosts:
        """The simulator's per-(stage, chunk) costs: compute, in-pass communication, activation bytes."""
        grids = {key: [[0.0] * self.chunks for _ in range(self.stages)]
                 for key in ("forward", "backward", "forward_comm", "backward_comm", "activation")}
        for k, seg in enumerate(self.segments):
            s, c = self.chunk_layout.stage_and_chunk(self.stages, k)
            for u in seg:
                grids["forward"][s][c] += u.forward - u.forward_comm
                grids["backward"][s][c] += u.backward - u.backward_comm
                grids["forward_comm"][s][c] += u.forward_comm
                grids["backward_comm"][s][c] += u.backward_comm
                grids["activation"][s][c] += u.activation_memory
        return StageCosts(**{key: tuple(map(tuple, g)) for key, g in grids.items()}, p2p=p2p)

    def describe(self) -> str:
        """One line per stage: time relative to the mean stage, memory in GiB, the units of each chunk."""
        mean = sum(self.stage_time) / self.stages
        rows = []
        for s in range(self.stages):
            parts = [_compact(self.segments[self.chunk_layout.virtual_stage(self.stages, s, c)])
                     for c in range(self.chunks)]
            rows.append(f"stage {s:>2}: time {self.stage_time[s] / mean:5.3f} x mean  "
                        f"memory {self.stage_memory[s] / 2 ** 30:7.2f} GiB  " + " | ".join(parts))
        return "\n".join(rows)


def _compact(seg: tuple[Unit, ...]) -> str:
    """'emb, L0-L3, mtp' style summary of a segment."""
    out: list[str] = []
    run: list[str] = []
    for u in seg:
        if u.kind in ("dense", "moe"):
            run.append(u.name)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run = []
        out.append(u.name)
    if run:
        out.append(run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out) or "-"


def _profiles(stages: int, chunks: int, in_flight) -> tuple[np.ndarray, ...]:
    """Per stage, rows of micro-batches held per chunk at once; a stage's activation peak is the largest row's.
    `in_flight` is stages x chunks counts (one row each: every chunk at its own peak), or per stage an array of
    rows (the schedule's held-micro-batch profiles, stage_ilp.held_profiles); default one micro-batch each."""
    if in_flight is None:
        return tuple(np.ones((1, chunks)) for _ in range(stages))
    if len(in_flight) == stages and all(np.ndim(rows) == 2 and np.shape(rows)[1] == chunks for rows in in_flight):
        return tuple(np.asarray(rows, dtype=float) for rows in in_flight)
    arr = np.asarray(in_flight, dtype=float)
    if arr.shape != (stages, chunks):
        raise PlacementError(f"in_flight: expected {stages} x {chunks} counts, got shape {arr.shape}")
    return tuple(arr[:, None, :])


def evaluate(units, stages: int, chunks: int, sizes, in_flight=None, method: str = "given",
             chunk_layout: ChunkLayout = ChunkLayout.INTERLEAVED) -> Placement:
    """Stage times and memory of the placement that puts sizes[k] consecutive units into segment k."""
    units = tuple(units)
    sizes = tuple(int(x) for x in sizes)
    if len(sizes) != stages * chunks or sum(sizes) != len(units) or min(sizes) < 0:
        raise PlacementError(f"sizes: expected {stages * chunks} non-negative segment sizes summing to "
                             f"{len(units)} units, got {list(sizes)}")
    profiles = _profiles(stages, chunks, in_flight)
    time = [0.0] * stages
    static = [0.0] * stages
    transient = [0.0] * stages
    act = [[0.0] * len(rows) for rows in profiles]  # per stage and profile
    i = 0
    for k, size in enumerate(sizes):
        s, c = chunk_layout.stage_and_chunk(stages, k)
        for u in units[i:i + size]:
            time[s] += u.time
            static[s] += u.weight_memory
            transient[s] = max(transient[s], u.transient)
            for j, held in enumerate(profiles[s][:, c]):
                act[s][j] += u.activation_memory * held
        i += size
    fixed = tuple(a + b for a, b in zip(static, transient))
    return Placement(stages, chunks, units, sizes, tuple(time), tuple(f + max(a) for f, a in zip(fixed, act)), fixed,
                     method, chunk_layout=chunk_layout)


def _check_chain(units: tuple[Unit, ...], stages: int, chunks: int) -> None:
    if stages < 1 or chunks < 1:
        raise PlacementError(f"stages/chunks: expected positive integers, got {stages}/{chunks}")
    for u in units:
        if u.kind not in KINDS:
            raise PlacementError(f"unit {u.name}: kind {u.kind!r} is not one of {KINDS}")
    if len(units) < stages * chunks:
        raise PlacementError(f"{len(units)} units cannot fill {stages} stages x {chunks} chunks "
                             f"(every segment needs at least one unit)")
    names = [u.name for u in units]
    if len(set(names)) != len(names):
        raise PlacementError("units: names must be unique")


def equal_layer_split(units, stages: int, chunks: int, in_flight=None) -> Placement:
    """The naive split: the same number of decoder layers in every segment (remainder to the middle segments),
    embedding with the first segment, MTP and head with the last."""
    units = tuple(units)
    _check_chain(units, stages, chunks)
    layers = [i for i, u in enumerate(units) if u.kind in ("dense", "moe")]
    segs = stages * chunks
    base, extra = divmod(len(layers), segs)
    counts = [base] * segs
    first = (segs - extra) // 2
    for k in range(first, first + extra):
        counts[k] += 1
    if min(counts) == 0:
        raise PlacementError(f"{len(layers)} layers cannot give each of {segs} segments one layer")
    counts[0] += layers[0]  # the units before the first layer (embedding)
    counts[-1] += len(units) - 1 - layers[-1]  # and after the last one (MTP, head)
    return evaluate(units, stages, chunks, counts, in_flight, method="equal layers")


def _runs(units: tuple[Unit, ...]) -> list[tuple[int, int]]:
    """(start, length) of the maximal runs of consecutive units of one kind with equal time, memory and choices."""
    def costs(u: Unit) -> tuple:
        return (u.kind, u.forward, u.backward, u.weight_memory, u.activation_memory, u.transient,
                tuple(map(costs, u.choices)))

    key = [costs(u) for u in units]
    out: list[tuple[int, int]] = []
    for i in range(len(units)):
        if out and key[i] == key[i - 1]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def _capped(bound: np.ndarray, target: int, value: float) -> np.ndarray:
    """`bound` with `target` at most `value`, widened by HiGHS' feasibility tolerance (1e-7): the value comes from a
    solution that may miss a row by that much, and the next pass must keep it feasible."""
    out = bound.copy()
    out[target] = value + 1e-7 * (1 + abs(value))
    return out


def balance(units, stages: int, chunks: int, options: PlacementOptions = PlacementOptions(),
            in_flight=None, node_limit: int | None = None, tie_break_nodes: int = 500, gap: float | None = None,
            tie_breaks: bool = True, prove: bool = True) -> Placement:
    """Exact placement under every stage's memory <= the limit, every segment non-empty, and the MTP options.

    Objective, lexicographic: first the steady-state period of the schedule of `options.chunk_layout` (`step_terms`;
    interleaved 1F1B: the sum over chunks of the slowest stage's chunk, DualPipeV: the slowest stage; the step itself
    with `options.micro_batches`), then the slowest chunk of any stage, then the slowest stage's time; for one chunk
    per stage all three are the slowest stage. Minimising only the slowest stage lets the chunks of a stage differ
    freely, and the interleaved step then pays each chunk's own maximum; the period alone cannot tell chunks split
    alike on every stage (1+4 layers from 2+3), which the simulated schedule pays for in its slowest chunk. Each
    later pass keeps the earlier objectives within HiGHS' feasibility tolerance (1e-7 relative), so it only breaks
    their ties. Without `tie_breaks` only the first objective; `gap` is the relative MIP gap the
    first pass stops at (default HiGHS' own); without `prove` the best placement found within `node_limit` branch-
    and-bound nodes per pass is returned, with that gap in Placement.gap, instead of an error. Budgets are nodes,
    never seconds, so that the same inputs give the same placement however loaded or fast the machine.

    A MILP over the p*v-1 cut positions. Inside a run of identical units (the MoE layers) the prefix sums of
    time and memory are linear in the cut's offset, so each cut needs one binary per run it can reach (the run it
    falls in) and an integer offset inside it: a few hundred variables for a 1T model, solved to proven optimality
    by HiGHS in well under a second (one binary per unit and segment instead takes minutes). A cut that only one
    run can hold (the planner's options keep every cut inside the MoE layers) is its offset alone. A run whose
    units offer `choices` adds, per segment that can hold its units, an integer count of them under each choice,
    and the returned placement holds each unit as the choice it runs.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    units = tuple(units)
    _check_chain(units, stages, chunks)
    terms = step_terms(options.chunk_layout, stages, chunks, options.micro_batches) if options.micro_batches else None
    prog = StageProgram(units, stages, chunks, options, _profiles(stages, chunks, in_flight), _runs(units), terms,
                        tie_breaks)
    constraints = LinearConstraint(*prog.matrix())
    integrality = np.array(prog.integrality)

    def solve(cost: np.ndarray, bounds: Bounds, limits: dict, prove: bool):
        res = milp(cost, constraints=constraints, integrality=integrality, bounds=bounds, options=limits)
        # HiGHS' presolve fails on some capped passes (seen with scipy 1.17): solve without it. Status 4 with a
        # solution is HiGHS 1.12's node limit ("solution limit reached", which scipy does not name), not a failure
        if res.status == 4 and res.x is None:
            res = milp(cost, constraints=constraints, integrality=integrality, bounds=bounds,
                       options={**limits, "presolve": False})
        if res.x is None:
            why = "memory_limit" if prog.limited else "the MTP, non-empty-segment and chunk constraints"
            raise PlacementError(f"no placement of {len(units)} units on {stages} stages x {chunks} chunks satisfies "
                                 f"{why} ({res.message})")
        if prove and res.status != 0:
            raise PlacementError(f"placement solver stopped before proving optimality: {res.message}")
        return res

    def minimise(target: int, bound: np.ndarray, limits: dict, prove: bool, sign: float = 1.0):
        cost = np.zeros(prog.nv)
        cost[target] = sign
        return solve(cost, Bounds(np.zeros(prog.nv), bound), limits, prove)

    def reached(target: int, x: np.ndarray) -> float:
        """The slowest chunk's (`largest`) or stage's (`z`) time of the solution with its integers rounded, at least
        the solver's value: the solver meets rows and integrality only to its tolerances, and a cap below what the
        placement really takes could leave the next pass without a solution."""
        xi = np.where(integrality == 1, np.round(x), x)
        seg = [prog.value(prog.segment(k, "t"), xi) for k in range(prog.segs)]
        got = max(seg) if target == prog.largest else max(sum(seg[k] for k in ks) for ks in prog.on_stage)
        return max(float(x[target]), got)

    bound = np.array(prog.upper)
    proven = {} if node_limit is None else {"node_limit": node_limit}
    res = minimise(prog.goal, bound, proven if gap is None else {**proven, "mip_rel_gap": gap}, prove)
    stopped_at = float(getattr(res, "mip_gap", 0.0) or 0.0) if res.status != 0 else 0.0
    if tie_breaks and chunks > 1:
        # second pass: at that period, the slowest chunk. The period is blind to how a stage's time splits over its
        # chunks when every stage splits alike (1+4 and 2+3 layers are both 5 layers of period), but interleaved
        # 1F1B runs the chunks of different stages side by side, so its steady state waits on the slowest chunk
        # anywhere (simulated, p=16, v=2, m=64, every stage F=1, B=2: step 214.5 with its chunks split 1:1, 301.8
        # at 1:4, the same period).
        bound = _capped(bound, prog.goal, res.x[prog.goal])
        res = minimise(prog.largest, bound, proven, prove)
        bound = _capped(bound, prog.largest, reached(prog.largest, res.x))
        res = minimise(prog.z, bound, proven, prove)
    # last pass, a tie-break: among the placements with that period, slowest chunk and slowest stage, raise the
    # fastest stage, so that the other stages do not keep whatever uneven split the first passes returned. Its best
    # within a node budget will do.
    if tie_breaks:
        res = minimise(prog.floor, _capped(bound, prog.z, reached(prog.z, res.x)), {"node_limit": tie_break_nodes},
                       prove=False, sign=-1.0)
    x = np.round(res.x)
    cuts = prog.cuts(x)
    placed = list(units)
    for (k, r), xs in prog.picks.items():  # the run's units in segment k, in order, as the counted choices
        start, length = prog.runs[r]
        first, end = max(cuts[k], start), min(cuts[k + 1], start + length)
        placed[first:end] = [c for j, c in zip(xs, units[start].choices) for _ in range(int(x[j]))]
    return dataclasses.replace(evaluate(placed, stages, chunks, np.diff(cuts), prog.profiles, method="balanced (MILP)",
                                        chunk_layout=options.chunk_layout), gap=stopped_at)


def planner_units(w: Workload, layout: ParallelLayout, options: PlacementOptions = PlacementOptions(),
                  recompute: tuple[str, ...] = ()) -> list[Unit]:
    """The model as a chain [embedding, dense layers, MoE layers, MTP depths, head] with the cost model's costs for
    `layout`: each unit is one block scored alone on a stage (stage_parts, stage_memory).

    The cost model bills head and MTP together on the last stage; the head is scored on the model without MTP and
    each MTP depth as the difference. MTP on a stage of its own holds its own copy of the head (the head's vocabulary
    matrix) and, unless its embedding lookup runs on the first stage (`mtp_embedding_on_first_stage`, which moves
    that lookup and its collectives to the embedding unit) or `mtp_embedding_copy` is off, a copy of the embedding
    table. Dense, MoE and MTP units run the layout's recompute mode and offer each mode of `recompute` as a choice
    to `balance`.
    """
    own = layout.recompute
    modes = tuple(dict.fromkeys((own, *recompute)))
    head_only = dataclasses.replace(w, shape=dataclasses.replace(w.shape, mtp_depth=0))
    rows = [("embedding", None), ("head", None)] + [(name, r) for r in modes for name in ("dense", "moe", "last")]
    n = len(rows)
    lay = Layouts.of(layout).take(np.zeros(n, int))

    def by_mode(kind: str) -> np.ndarray:
        return np.array([[float(name == kind and r == mode) for name, r in rows] for mode in RECOMPUTE])

    plan = StagePlan(stage=np.zeros(n, int), dense_by_mode=by_mode("dense"), moe_by_mode=by_mode("moe"),
                     embedding=np.array([float(name == "embedding") for name, _ in rows]),
                     last=np.array([float(name in ("head", "last")) for name, _ in rows]),
                     mtp_mode=np.array([RECOMPUTE.index(r or own) for _, r in rows]))
    cost: dict[tuple, dict[str, float]] = {}
    for wk in (w, head_only):
        b = block_costs(wk, lay)
        parts = stage_parts(wk, b, plan)
        mem = stage_memory(wk, lay, b, plan)
        for i, row in enumerate(rows):
            if (wk is head_only) == (row[0] == "head"):
                cost[row] = {key: float(parts[key][i]) for key in parts}
                cost[row].update(static=float(mem["static"][i]),
                                 act=float(mem["activation_per_microbatch"][i]), transient=float(mem["transient"][i]))
    head, emb = cost["head", None], dict(cost["embedding", None])
    depth = w.shape.mtp_depth
    for r in modes:
        last = cost["last", r]
        mtp = cost["mtp", r] = {key: (last[key] - head[key]) / max(depth, 1) for key in last}
        mtp["transient"] = last["transient"]  # an MTP depth runs the shared head itself
        if options.mtp_apart_from_head:
            mtp["static"] += head["static"]
        if depth and (not options.mtp_embedding_copy or options.mtp_embedding_on_first_stage):
            mtp["static"] -= emb["static"] / depth      # stage_memory bills the copy on the last stage
    if depth and options.mtp_embedding_on_first_stage:
        # the cost model bills the MTP lookup's tensor-parallel collectives in the MTP depth: they move with it
        for r in modes:
            for key in ("fwd_comm", "bwd_comm"):
                cost["mtp", r][key] -= emb[key]
        for key in ("fwd_compute", "bwd_compute", "fwd_comm", "bwd_comm"):
            emb[key] *= 1 + depth

    def unit(name: str, kind: str, c: dict, layer: int = -1, r: str | None = None) -> Unit:
        return Unit(name, kind, c["fwd_compute"] + c["fwd_comm"], c["bwd_compute"] + c["bwd_comm"], c["static"],
                    c["act"], layer, c["transient"], c["fwd_comm"], c["bwd_comm"], r)

    def block(name: str, kind: str, layer: int = -1) -> Unit:
        choices = tuple(unit(name, kind, cost[kind, r], layer, r) for r in RECOMPUTE if r in recompute)
        return dataclasses.replace(unit(name, kind, cost[kind, own], layer, own), choices=choices)

    units = [unit("embedding", "embedding", emb)]
    units += [block(f"L{i}", "dense" if i < w.shape.first_k_dense else "moe", i) for i in range(w.shape.num_layers)]
    units += [block(f"mtp{d}" if depth > 1 else "mtp", "mtp") for d in range(depth)]
    return units + [unit("head", "head", head)]


def placement_p2p(w: Workload, layout: ParallelLayout) -> float:
    """Seconds to send one micro-batch's hidden state to the next stage (the simulator's p2p)."""
    return float(p2p_time(w, Layouts.of(layout))[0])
