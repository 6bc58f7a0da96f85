"""Layers and recompute per pipeline chunk for one layout: the placement MILP on the cost model, and brute force.

Decision: how many dense and MoE layers each (stage, virtual chunk) holds under each recompute mode (none /
selective / full), and the recompute mode of the MTP layer (with head and loss in the last chunk of the last stage).

Chunking "free" (the default): the dense layers wherever the cuts put them, the first chunk may hold the
embedding alone and the last one the MTP, head and loss alone; the other chunks of a stage differ by at most one
layer. That spread stays because the objective below is blind to how a stage's time splits over its chunks, where
the interleaved schedule is not: on uniform stages (p=16, v=2, m=64, F:B = 1:2) chunks of 0.5 and 1 take a
simulated 130.5 where the formula says 107.25. Chunking "even" (MindFormers' uniform split): the dense layers in
the first chunk, every chunk holding a layer (the last one of the last stage, with the head, may hold fewer).
Objective, the schedule's step (placement.step_terms). (Interleaved) 1F1B: in steady state every stage runs
chunk 0, then chunk 1, ... of successive micro-batches in lock-step, so a micro-batch costs the sum over chunks of
the slowest stage's chunk time, and filling / draining the pipeline costs the total work spread over the chunks:
    T = (m - 1/v) * sum_c max_s t[s, c] + sum_{s,c} t[s, c] / v
(for v = 1 the classic (m - 1) * max_s t_s + sum_s t_s; for equal chunks (m + (p-1)/v) * stage time). DualPipeV:
every stage runs F0+B1 and F1+B0 per micro-batch, so m times the slowest stage, plus DeepSeek's bubble with W = 0:
    T = m * max_s (t[s, 0] + t[s, 1]) + (p-1)/(2p) * sum_{s,c} (f[s, c] + 2 b[s, c])
(exact in the simulator for uniform stages with F = B; with B = 2F it is one chunk forward longer). The segments
sit where the schedule's ChunkLayout puts them: DualPipeV's V has the embedding in chunk 0 and head, loss and MTP
in chunk 1 of stage 0.
Memory: a stage's activation peak only depends on its own order of forwards and backwards, so it is the maximum
over the prefixes of that order of (micro-batches held per chunk) x (activation per chunk): one linear row per
distinct prefix. Plus weights, gradients, optimizer states and the largest transient of a block on the stage.

The program is parallel.pipeline.placement's `balance` over the cost model's units (`planner_units`), each dense
layer, MoE layer and MTP depth offering the three recompute modes as choices, under the options that state the
above; every coefficient comes from the cost model itself, and `assess` scores any assignment with the cost model
and the schedule directly, so brute force checks the program exactly.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from parallel.layout import RECOMPUTE, ParallelLayout
from parallel.pipeline.placement import (PlacementError, PlacementOptions, balance, planner_units, step_period,
                                         step_terms)
from parallel.pipeline.schedules import ChunkLayout, Kind, build
from parallel.planner.blocks import block_costs
from parallel.planner.cost_model import StagePlan, p2p_time, stage_memory, stage_parts, summarise, update_time
from parallel.planner.model_shape import even_layer_split
from parallel.planner.workload import Layouts, Workload

MODES = len(RECOMPUTE)


CHUNKINGS = ("free", "even")

Counts = tuple[tuple[tuple[int, ...], ...], ...]  # [stage][chunk][recompute mode]: layers


@dataclass(frozen=True)
class StageAssignment:
    dense_by_mode: Counts  # the first-k dense layers
    moe_by_mode: Counts
    mtp_mode: int
    objective: float = float("nan")  # pipeline seconds (without sends and optimizer), as `assess` computes
    gap: float = 0.0  # relative MIP gap when the solver stopped (0: proven optimal)

    @property
    def layers_per_chunk(self) -> list[list[int]]:
        return [[sum(d) + sum(e) for d, e in zip(ds, es)] for ds, es in zip(self.dense_by_mode, self.moe_by_mode)]

    @property
    def layers_per_stage(self) -> list[int]:
        return [sum(x) for x in self.layers_per_chunk]

    def recompute_per_stage(self, mode: int) -> list[int]:
        """Layers recomputed with `mode` on each stage (MindFormers' per-stage recompute lists)."""
        return [sum(d[mode] + e[mode] for d, e in zip(ds, es)) for ds, es in zip(self.dense_by_mode, self.moe_by_mode)]


def schedule_name(layout: ParallelLayout, schedule: str | None = None) -> str:
    """`schedule`, or the layout's default: 1F1B, interleaved with virtual chunks."""
    return schedule or ("interleaved" if layout.vpp > 1 else "1f1b")


def chunk_layout(layout: ParallelLayout, schedule: str | None = None) -> ChunkLayout:
    """Which segment each (stage, chunk) holds under `schedule` (default `schedule_name`'s)."""
    return _chunk_layout(schedule_name(layout, schedule), layout.pp, layout.vpp, layout.micro_batch_num)


@lru_cache(maxsize=256)
def _chunk_layout(name: str, pp: int, v: int, m: int) -> ChunkLayout:
    return build(name, pp, v, m).chunk_layout


@lru_cache(maxsize=256)
def held_profiles(pp: int, v: int, m: int, name: str) -> tuple[np.ndarray, ...]:
    """Per stage: the distinct, non-dominated vectors of micro-batches held per chunk over the prefixes of the
    stage's action order (taken right after each forward, where the count can only have grown)."""
    sched = build(name, pp, v, m)
    out = []
    for acts in sched.actions:
        held, rows = np.zeros(v, dtype=np.int64), set()
        for a in acts:
            held[a.chunk] += 1 if a.kind is Kind.F else -1
            if a.kind is Kind.F:
                rows.add(tuple(held))
        arr = np.array(sorted(rows))
        keep = [r for r in arr if not any((o >= r).all() and (o > r).any() for o in arr)]
        out.append(np.array(keep, dtype=np.float64))
    return tuple(out)


def chunk_plans(layout: ParallelLayout, assignments: list[StageAssignment],
                chunks: ChunkLayout = ChunkLayout.INTERLEAVED) -> StagePlan:
    """All chunks of all assignments as one StagePlan, ordered assignment, stage, chunk; the embedding in the
    chunk holding the first segment, head, loss and MTP in the one holding the last."""
    pp, v = layout.pp, layout.vpp
    first, last_chunk = chunks.stage_and_chunk(pp, 0), chunks.stage_and_chunk(pp, pp * v - 1)
    dense, moe, emb, last, mtp, stage = [], [], [], [], [], []
    for a in assignments:
        for s in range(pp):
            for c in range(v):
                dense.append(a.dense_by_mode[s][c])
                moe.append(a.moe_by_mode[s][c])
                emb.append((s, c) == first)
                last.append((s, c) == last_chunk)
                mtp.append(a.mtp_mode)
                stage.append(s)
    return StagePlan(stage=np.array(stage), dense_by_mode=np.array(dense, float).T, moe_by_mode=np.array(moe, float).T,
                     embedding=np.array(emb, float), last=np.array(last, float), mtp_mode=np.array(mtp))


def assess(w: Workload, layout: ParallelLayout, assignments: list[StageAssignment],
           schedule: str | None = None) -> dict[str, np.ndarray]:
    """Cost-model scores of many assignments in one pass: 'objective' (pipeline seconds, the ILP's objective),
    'memory' [n, pp] (bytes per stage), 'fwd' / 'bwd' [n, pp] (per-micro-batch stage seconds), 'chunk_time'."""
    pp, v, m = layout.pp, layout.vpp, layout.micro_batch_num
    n = len(assignments)
    lay = Layouts.of(layout).take(np.zeros(n * pp * v, int))
    chunks = chunk_layout(layout, schedule)
    st = chunk_plans(layout, assignments, chunks)
    b = block_costs(w, lay)
    parts = stage_parts(w, b, st)
    shape = (n, pp, v)
    fwd = (parts["fwd_compute"] + parts["fwd_comm"]).reshape(shape)
    bwd = (parts["bwd_compute"] + parts["bwd_comm"]).reshape(shape)
    t = fwd + bwd
    mem = stage_memory(w, lay, b, st)
    static = mem["static"].reshape(shape).sum(axis=2)
    act = mem["activation_per_microbatch"].reshape(shape)
    transient = mem["transient"].reshape(shape).max(axis=2)
    profiles = held_profiles(pp, v, m, schedule_name(layout, schedule))
    peak = np.stack([np.max(act[:, s, :] @ profiles[s].T, axis=1) for s in range(pp)], axis=1)
    on_period, on_fwd, on_bwd = step_terms(chunks, pp, v, m)
    objective = on_period * step_period(chunks, t) + on_fwd * fwd.sum(axis=(1, 2)) + on_bwd * bwd.sum(axis=(1, 2))
    return {"objective": objective, "memory": static + peak + transient, "fwd": fwd.sum(axis=2),
            "bwd": bwd.sum(axis=2), "chunk_time": t}


def score_assignment(w: Workload, layout: ParallelLayout, a: StageAssignment, schedule: str | None = None) -> dict:
    """The cost model's full score of a layout under an assignment and pipeline `schedule` (default
    `schedule_name`'s): the schedule's step (`assess`' objective) plus its sends, a period's two per micro-batch
    and the fill and drain's 2(p-1), as cost_model.step_time adds them to the interleaved step; then exposed DP
    and the optimizer."""
    r = assess(w, layout, [a], schedule)
    pp = layout.pp
    one = Layouts.of(layout)
    lay, chunks = one.take(np.zeros(pp, int)), one.take(np.zeros(pp * layout.vpp, int))
    where = chunk_layout(layout, schedule)
    st = chunk_plans(layout, [a], where)
    mem = stage_memory(w, chunks, block_costs(w, chunks), st)
    per_stage = {k: mem[k].reshape(pp, -1).sum(axis=1)
                 for k in ("dense_params", "expert_params", "replicated_params", "pair_params")}
    t = r["chunk_time"][0]
    on_period = step_terms(where, pp, layout.vpp, layout.micro_batch_num)[0]
    p2p = p2p_time(w, one)
    pipe = r["objective"] + 2 * p2p * on_period + 2 * (pp - 1) * p2p
    total = pipe + update_time(w, lay, per_stage, r["fwd"][0], r["bwd"][0]).max()
    scores = summarise(w, one, total, pipe, np.array([t.sum()]), np.array([r["memory"][0].max()]))
    out = {k: float(np.asarray(v).ravel()[0]) for k, v in scores.items()}
    out["memory_per_stage"] = [float(x) for x in r["memory"][0]]
    return out


def by_segment(pp: int, v: int, layers: list[int], first_k_dense: int, modes: list[int],
               chunks: ChunkLayout = ChunkLayout.INTERLEAVED) -> tuple[Counts, Counts]:
    """(dense, MoE) counts per [stage][chunk][mode] of `layers` layers per segment in model order (segment k at
    chunks.stage_and_chunk(pp, k)), layer i running recompute mode modes[i]."""
    dense = [[[0] * MODES for _ in range(v)] for _ in range(pp)]
    moe = [[[0] * MODES for _ in range(v)] for _ in range(pp)]
    i = 0
    for k, size in enumerate(layers):
        s, c = chunks.stage_and_chunk(pp, k)
        for layer in range(i, i + size):
            (dense if layer < first_k_dense else moe)[s][c][modes[layer]] += 1
        i += size
    freeze = lambda x: tuple(tuple(map(tuple, st)) for st in x)  # noqa: E731
    return freeze(dense), freeze(moe)


def even_assignment(w: Workload, layout: ParallelLayout, chunks: ChunkLayout = ChunkLayout.INTERLEAVED
                    ) -> StageAssignment:
    """Even split of layers over stages, then over each stage's chunks (remainder to the middle), with the
    layout's uniform recompute mode; the dense layers, the first ones, wherever that puts them."""
    pp, v = layout.pp, layout.vpp
    per_chunk = [even_layer_split(n, v) for n in even_layer_split(w.shape.num_layers, pp)]
    sizes = [per_chunk[s][c] for s, c in (chunks.stage_and_chunk(pp, k) for k in range(pp * v))]
    mode = RECOMPUTE.index(layout.recompute)
    dense, moe = by_segment(pp, v, sizes, w.shape.first_k_dense, [mode] * w.shape.num_layers, chunks)
    return StageAssignment(dense, moe, mode)


# Branch-and-bound nodes per solver pass: a budget of work, not of seconds, so that a plan does not depend on the
# machine's load. On the 12 best layouts of 1t at 4096 devices and of 105b at 512, budgets of 200, 1000 and 5000
# nodes gave the same placements, all proven optimal (0.1-1.4 s each); 105b at 64 devices (pp=8, vpp=4, m=32)
# stops at a 5.4% gap after 200 nodes (1.9 s) and is still there after 1000 (3 s).
NODE_LIMIT = 200


def chunking_options(chunking: str) -> dict:
    """The placement options that state a chunking (CHUNKINGS)."""
    if chunking not in CHUNKINGS:
        raise ValueError(f"chunking: expected one of {CHUNKINGS}, got {chunking!r}")
    return {"even_chunks": True, "dense_in_first_segment": chunking == "even", "bare_ends": chunking == "free"}


def solve_ilp(w: Workload, layout: ParallelLayout, memory_limit: float | None = None, node_limit: int = NODE_LIMIT,
              gap: float = 1e-9, schedule: str | None = None, chunking: str = "free") -> StageAssignment | None:
    """Optimal assignment for `layout` under pipeline `schedule` (default 1F1B or
    interleaved) and `chunking`, or None when none fits in memory: the placement MILP with every recompute mode a
    choice, the step as objective and memory over the schedule's profiles; the best found within `node_limit`
    branch-and-bound nodes, its relative gap in StageAssignment.gap."""
    pp, v, m = layout.pp, layout.vpp, layout.micro_batch_num
    chunks = chunk_layout(layout, schedule)
    options = PlacementOptions(mtp_embedding_copy=False, micro_batches=m, **chunking_options(chunking),
                               memory_limit=w.cluster.usable_memory if memory_limit is None else memory_limit,
                               chunk_layout=chunks)
    try:
        placed = balance(planner_units(w, layout, options, RECOMPUTE), pp, v, options,
                         held_profiles(pp, v, m, schedule_name(layout, schedule)), node_limit=node_limit, gap=gap,
                         tie_breaks=False, prove=False)
    except PlacementError:
        return None
    layers = [u for u in placed.units if u.kind in ("dense", "moe")]
    dense, moe = by_segment(pp, v, [sum(u.kind in ("dense", "moe") for u in seg) for seg in placed.segments],
                            w.shape.first_k_dense, [RECOMPUTE.index(u.recompute) for u in layers], chunks)
    a = StageAssignment(dense, moe, mtp_mode=next((RECOMPUTE.index(u.recompute) for u in placed.units
                                                   if u.kind == "mtp"), 0))
    return dataclasses.replace(a, objective=float(assess(w, layout, [a], schedule)["objective"][0]), gap=placed.gap)


def chunks_allowed(a: StageAssignment, chunking: str, chunks: ChunkLayout = ChunkLayout.INTERLEAVED) -> bool:
    """Whether `a` is one of `chunking`'s assignments (the MILP's feasible set). The chunks of a stage are at most
    one layer apart, but a chunk with the embedding or the head may hold fewer: under "even" only the head's
    chunk, which still holds a layer, and every chunk holds the dense layers' first; under "free" both ends, down
    to none."""
    rows = a.layers_per_chunk
    pp, v = len(rows), len(rows[0])
    head = chunks.stage_and_chunk(pp, pp * v - 1)
    ends = {chunks.stage_and_chunk(pp, 0), head} if chunking == "free" else set()
    first = chunks.stage_and_chunk(pp, 0)
    if chunking == "even" and (any(sum(d) for st in a.dense_by_mode for d in st)
                               != sum(a.dense_by_mode[first[0]][first[1]])):
        return False
    for s, sizes in enumerate(rows):
        fewer = [c for c in range(v) if (s, c) in ends or (s, c) == head]
        plain = [n for c, n in enumerate(sizes) if c not in fewer]
        if any(n < 1 for c, n in enumerate(sizes) if (s, c) not in ends):
            return False
        if plain and (max(sizes) > min(plain) + 1):
            return False
    return True


def _compositions(total: int, parts: int):
    """All tuples of `parts` non-negative integers summing to `total`."""
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        edges = (-1,) + cuts + (total + parts - 1,)
        yield tuple(edges[i + 1] - edges[i] - 1 for i in range(parts))


def brute_force(w: Workload, layout: ParallelLayout, memory_limit: float | None = None,
                chunking: str = "free", schedule: str | None = None) -> StageAssignment | None:
    """Every assignment of `chunking` scored by `assess` under `schedule`; for small spaces only (it grows
    combinatorially). The layers of a segment are the next ones in model order, each segment's dense and MoE
    layers split over the recompute modes every way."""
    limit = w.cluster.usable_memory if memory_limit is None else memory_limit
    pp, v, k = layout.pp, layout.vpp, w.shape.first_k_dense
    chunks = chunk_layout(layout, schedule)
    where = [chunks.stage_and_chunk(pp, i) for i in range(pp * v)]
    candidates = []
    for sizes in _compositions(w.shape.num_layers, pp * v):
        kinds, _ = by_segment(pp, v, list(sizes), k, [0] * w.shape.num_layers, chunks)  # dense layers per segment
        dense_n = [sum(kinds[s][c]) for s, c in where]
        splits = [[(d, e) for d in _compositions(dense_n[i], MODES) for e in _compositions(sizes[i] - dense_n[i], MODES)]
                  for i in range(pp * v)]
        for pick in itertools.product(*splits):
            grid = lambda j: tuple(tuple(pick[chunks.virtual_stage(pp, s, c)][j] for c in range(v))  # noqa: E731
                                   for s in range(pp))
            a = StageAssignment(grid(0), grid(1), 0)
            if not chunks_allowed(a, chunking, chunks):
                continue
            for mtp in range(MODES if w.shape.mtp_depth else 1):
                candidates.append(dataclasses.replace(a, mtp_mode=mtp))
    if not candidates:
        return None
    r = assess(w, layout, candidates, schedule)
    objective = np.where(r["memory"].max(axis=1) <= limit, r["objective"], np.inf)
    best = int(np.argmin(objective))
    if not np.isfinite(objective[best]):
        return None
    a = candidates[best]
    return StageAssignment(a.dense_by_mode, a.moe_by_mode, a.mtp_mode, float(objective[best]))
