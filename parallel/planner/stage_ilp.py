"""Layers and recompute per pipeline chunk for one layout: an integer linear program, and brute force.

Decision: how many MoE layers each (stage, virtual chunk) holds under each recompute mode (none / selective /
full), how the first-k dense layers (at the start of chunk 0 of stage 0) are recomputed, and the recompute mode of
the MTP layer (with head and loss in the last chunk of the last stage).

Chunks of one stage differ by at most one layer (the last chunk of the last stage, with the head, may hold
fewer). Objective, the (interleaved) 1F1B step: in steady state every stage runs chunk 0, then chunk 1, ... of successive
micro-batches in lock-step, so a micro-batch costs the sum over chunks of the slowest stage's chunk time, and
filling / draining the pipeline costs the total work spread over the chunks:
    T = (m - 1/v) * sum_c max_s t[s, c] + sum_{s,c} t[s, c] / v
(for v = 1 the classic (m - 1) * max_s t_s + sum_s t_s; for equal chunks (m + (p-1)/v) * stage time).
Memory: a stage's activation peak only depends on its own order of forwards and backwards, so it is the maximum
over the prefixes of that order of (micro-batches held per chunk) x (activation per chunk): one linear row per
distinct prefix. Plus weights, gradients, optimizer states and the largest transient of a block on the stage.

Every coefficient comes from the cost model itself (one-layer chunks minus empty ones), and `assess` scores any
assignment with the cost model and the schedule directly, so brute force checks the program exactly.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from parallel.pipeline.schedules import Kind, build
from parallel.planner.cost_model import (Layouts, StagePlan, Workload, block_costs, p2p_time, stage_memory,
                                         stage_parts, step_time, summarise, update_time)
from parallel.planner.model_shape import even_layer_split

MODES = 3
GIB = 2.0 ** 30


@dataclass(frozen=True)
class StageAssignment:
    dense_by_mode: tuple[int, ...]  # first-k dense layers (chunk 0 of stage 0) per recompute mode
    moe_by_mode: tuple[tuple[tuple[int, ...], ...], ...]  # [stage][chunk][mode]: MoE layers
    mtp_mode: int
    objective: float = float("nan")  # pipeline seconds (without sends and optimizer), as `assess` computes
    gap: float = 0.0  # relative MIP gap when the solver stopped (0: proven optimal)

    @property
    def layers_per_chunk(self) -> list[list[int]]:
        return [[sum(ch) + (sum(self.dense_by_mode) if s == c == 0 else 0) for c, ch in enumerate(st)]
                for s, st in enumerate(self.moe_by_mode)]

    @property
    def layers_per_stage(self) -> list[int]:
        return [sum(x) for x in self.layers_per_chunk]

    def recompute_per_stage(self, mode: int) -> list[int]:
        """Layers recomputed with `mode` on each stage (MindFormers' per-stage recompute lists)."""
        return [sum(ch[mode] for ch in st) + (self.dense_by_mode[mode] if s == 0 else 0)
                for s, st in enumerate(self.moe_by_mode)]


def schedule_name(layout: dict) -> str:
    return "interleaved" if layout["vpp"] > 1 else "1f1b"


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


def _repeat(layout: dict, n: int) -> Layouts:
    return Layouts(**{k: np.full(n, v) for k, v in Layouts.single(**layout).__dict__.items()})


def chunk_plans(layout: dict, assignments: list[StageAssignment]) -> StagePlan:
    """All chunks of all assignments as one StagePlan, ordered assignment, stage, chunk."""
    pp, v = layout["pp"], layout["vpp"]
    dense, moe, emb, last, mtp, stage = [], [], [], [], [], []
    for a in assignments:
        for s in range(pp):
            for c in range(v):
                dense.append(a.dense_by_mode if s == c == 0 else (0,) * MODES)
                moe.append(a.moe_by_mode[s][c])
                emb.append(s == c == 0)
                last.append(s == pp - 1 and c == v - 1)
                mtp.append(a.mtp_mode)
                stage.append(s)
    return StagePlan(stage=np.array(stage), dense_by_mode=np.array(dense, float).T, moe_by_mode=np.array(moe, float).T,
                     embedding=np.array(emb, float), last=np.array(last, float), mtp_mode=np.array(mtp))


def assess(w: Workload, layout: dict, assignments: list[StageAssignment],
           schedule: str | None = None) -> dict[str, np.ndarray]:
    """Cost-model scores of many assignments in one pass: 'objective' (pipeline seconds, the ILP's objective),
    'memory' [n, pp] (bytes per stage), 'fwd' / 'bwd' [n, pp] (per-micro-batch stage seconds), 'chunk_time'."""
    pp, v, m = layout["pp"], layout["vpp"], layout["m"]
    n = len(assignments)
    lay = _repeat(layout, n * pp * v)
    st = chunk_plans(layout, assignments)
    b = block_costs(w, lay)
    parts = stage_parts(w, b, st)
    shape = (n, pp, v)
    fwd = (parts["fwd_compute"] + parts["fwd_comm"]).reshape(shape)
    bwd = (parts["bwd_compute"] + parts["bwd_comm"]).reshape(shape)
    t = fwd + bwd
    mem = stage_memory(w, lay, b, st)
    static = (mem["weights"] + mem["grads"] + mem["optimizer"]).reshape(shape).sum(axis=2)
    act = mem["activation_per_microbatch"].reshape(shape)
    transient = mem["transient"].reshape(shape).max(axis=2)
    profiles = held_profiles(pp, v, m, schedule or schedule_name(layout))
    peak = np.stack([np.max(act[:, s, :] @ profiles[s].T, axis=1) for s in range(pp)], axis=1)
    objective = (m - 1 / v) * t.max(axis=1).sum(axis=1) + t.sum(axis=(1, 2)) / v
    return {"objective": objective, "memory": static + peak + transient, "fwd": fwd.sum(axis=2),
            "bwd": bwd.sum(axis=2), "chunk_time": t}


def score_assignment(w: Workload, layout: dict, a: StageAssignment) -> dict:
    """The cost model's full score of a layout under an assignment (pipeline, sends, exposed DP, optimizer)."""
    r = assess(w, layout, [a])
    pp = layout["pp"]
    one = Layouts.single(**layout)
    lay = _repeat(layout, pp)
    st = chunk_plans(layout, [a])
    mem = stage_memory(w, _repeat(layout, pp * layout["vpp"]), block_costs(w, _repeat(layout, pp * layout["vpp"])), st)
    per_stage = {k: mem[k].reshape(pp, -1).sum(axis=1) for k in ("dense_params", "expert_params")}
    t = r["chunk_time"][0]
    pipe = step_time(one.m, one.vpp, one.pp, t.max(axis=0).sum(), t.sum(), p2p_time(w, one))
    total = pipe + update_time(w, lay, per_stage, r["fwd"][0], r["bwd"][0]).max()
    scores = summarise(w, one, total, pipe, np.array([t.sum()]), np.array([r["memory"][0].max()]))
    out = {k: float(np.asarray(v).ravel()[0]) for k, v in scores.items()}
    out["memory_per_stage"] = [float(x) for x in r["memory"][0]]
    return out


def even_assignment(w: Workload, layout: dict) -> StageAssignment:
    """Even split of layers over stages, then over each stage's chunks (remainder to the middle), with the
    layout's uniform recompute mode; chunk 0 of stage 0 grows to hold the dense layers if it must."""
    mode = ("none", "selective", "full").index(layout["recompute"])
    unit = lambda n: tuple(n if r == mode else 0 for r in range(MODES))  # noqa: E731
    k, v = w.shape.first_k_dense, layout["vpp"]
    stages = []
    for s, n in enumerate(even_layer_split(w.shape.num_layers, layout["pp"])):
        sizes = even_layer_split(n, v)
        if s == 0 and sizes[0] < k:
            if n < k + v - 1:
                raise ValueError(f"layers_per_stage: stage 0 holds {n} layers, too few for the {k} dense layers "
                                 f"in its first chunk and one layer in each of its other {v - 1} chunks")
            sizes = [k] + even_layer_split(n - k, v - 1)
        stages.append(tuple(unit(size - (k if s == c == 0 else 0)) for c, size in enumerate(sizes)))
    return StageAssignment(unit(k), tuple(stages), mode)


def _coefficients(w: Workload, layout: dict) -> dict[str, np.ndarray]:
    """Time, static memory, activation and transient of: an empty chunk, the embedding, head+MTP per MTP mode,
    one MoE layer per mode and one dense layer per mode, all measured on the cost model."""
    rows = [("empty", (0,) * 3, (0,) * 3, 0, 0, 0), ("embedding", (0,) * 3, (0,) * 3, 1, 0, 0)]
    rows += [(f"head{r}", (0,) * 3, (0,) * 3, 0, 1, r) for r in range(MODES)]
    for r in range(MODES):
        unit = tuple(int(i == r) for i in range(MODES))
        rows += [(f"moe{r}", (0,) * 3, unit, 0, 0, 0), (f"dense{r}", unit, (0,) * 3, 0, 0, 0)]
    n = len(rows)
    lay = _repeat(layout, n)
    st = StagePlan(stage=np.zeros(n, int), dense_by_mode=np.array([r[1] for r in rows], float).T,
                   moe_by_mode=np.array([r[2] for r in rows], float).T, embedding=np.array([r[3] for r in rows], float),
                   last=np.array([r[4] for r in rows], float), mtp_mode=np.array([r[5] for r in rows]))
    b = block_costs(w, lay)
    parts = stage_parts(w, b, st)
    mem = stage_memory(w, lay, b, st)
    t = parts["fwd_compute"] + parts["fwd_comm"] + parts["bwd_compute"] + parts["bwd_comm"]
    static = mem["weights"] + mem["grads"] + mem["optimizer"]
    table = {"t": t, "static": static / GIB, "act": mem["activation_per_microbatch"] / GIB,
             "transient": mem["transient"] / GIB}  # GiB: byte-sized rows beside seconds mislead HiGHS
    name = {r[0]: i for i, r in enumerate(rows)}
    return {f"{key}_{label}": vals[name[label]] - (vals[0] if key != "transient" else 0)
            for key, vals in table.items() for label in name}


def solve_ilp(w: Workload, layout: dict, memory_limit: float | None = None, time_limit: float = 10.0,
              gap: float = 1e-9, schedule: str | None = None) -> StageAssignment | None:
    """Optimal assignment for `layout` (a Layouts.row dict) under pipeline `schedule` (default 1F1B or
    interleaved), or None when none fits in memory."""
    limit = (w.cluster.usable_memory if memory_limit is None else memory_limit) / GIB
    pp, v, m = layout["pp"], layout["vpp"], layout["m"]
    k, n_moe = w.shape.first_k_dense, w.shape.num_layers - w.shape.first_k_dense
    co = _coefficients(w, layout)
    profiles = held_profiles(pp, v, m, schedule or schedule_name(layout))
    var: dict[tuple, int] = {}

    def idx(*key) -> int:
        return var.setdefault(key, len(var))

    for s in range(pp):
        for c in range(v):
            for r in range(MODES):
                idx("x", s, c, r)
    for r in range(MODES):
        idx("y", r), idx("mtp", r)
    for c in range(v):
        idx("Z", c)
    for s in range(pp):
        idx("q", s)
        idx("tr", s)
        for r in range(MODES):
            if s == 0 or r == 2:
                idx("u", s, r)
    for r in range(MODES):
        idx("ud", r)
    rows: list[tuple[dict, float, float]] = []

    def chunk_terms(s: int, c: int, key: str) -> tuple[dict, float]:
        """Linear terms and constant of a chunk's `key` ('t', 'static' or 'act')."""
        terms = {var["x", s, c, r]: co[f"{key}_moe{r}"] for r in range(MODES)}
        const = 0.0
        if s == c == 0:
            terms.update({var["y", r]: co[f"{key}_dense{r}"] for r in range(MODES)})
            const += co[f"{key}_embedding"]
        if s == pp - 1 and c == v - 1:
            terms.update({var["mtp", r]: co[f"{key}_head{r}"] for r in range(MODES)})
        return terms, const

    rows.append(({var["y", r]: 1 for r in range(MODES)}, k, k))
    rows.append(({var["x", s, c, r]: 1 for s in range(pp) for c in range(v) for r in range(MODES)}, n_moe, n_moe))
    rows.append(({var["mtp", r]: 1 for r in range(MODES)}, 1, 1))
    for s in range(pp):
        static: dict[int, float] = {}
        static_const = 0.0
        acts = []
        for c in range(v):
            layers = {var["x", s, c, r]: 1 for r in range(MODES)}
            if s == c == 0:
                layers.update({var["y", r]: 1 for r in range(MODES)})
            rows.append((layers, 1, np.inf))  # no empty virtual stage
            # chunks of a stage differ by at most one layer (the head's chunk may hold fewer): the step-time
            # formula assumes even chunks, and the simulator confirms it only for those
            rows.append(({**layers, var["q", s]: -1.0}, -np.inf if s == pp - 1 and c == v - 1 else 0, 1))
            terms, const = chunk_terms(s, c, "t")
            rows.append(({**terms, var["Z", c]: -1.0}, -np.inf, -const))
            terms, const = chunk_terms(s, c, "static")
            for i, x in terms.items():
                static[i] = static.get(i, 0.0) + x
            static_const += const
            acts.append(chunk_terms(s, c, "act"))
        for h in profiles[s]:
            row = dict(static)
            const = static_const
            for c, (terms, act_const) in enumerate(acts):
                for i, x in terms.items():
                    row[i] = row.get(i, 0.0) + h[c] * x
                const += h[c] * act_const
            row[var["tr", s]] = 1.0
            rows.append((row, -np.inf, limit - const))
        # transient >= that of every block kind present; stages after the first hold only MoE layers (at least
        # one), and recompute none/selective share the base transient, so there only full recompute needs an
        # indicator
        for r in range(MODES):
            layers = {var["x", s, c, r]: 1 for c in range(v)}
            if s > 0 and r < 2:
                rows.append(({var["tr", s]: 1}, co[f"transient_moe{r}"], np.inf))
            else:
                rows.append(({**layers, var["u", s, r]: -n_moe}, -np.inf, 0))
                rows.append(({var["tr", s]: 1, var["u", s, r]: -co[f"transient_moe{r}"]}, 0, np.inf))
            if s == pp - 1:
                rows.append(({var["tr", s]: 1, var["mtp", r]: -co[f"transient_head{r}"]}, 0, np.inf))
    for r in range(MODES):
        rows.append(({var["y", r]: 1, var["ud", r]: -max(k, 1)}, -np.inf, 0))
        rows.append(({var["tr", 0]: 1, var["ud", r]: -co[f"transient_dense{r}"]}, 0, np.inf))
    cost = np.zeros(len(var))
    constant = 0.0
    for c in range(v):
        cost[var["Z", c]] = m - 1 / v
        for s in range(pp):
            terms, const = chunk_terms(s, c, "t")
            for i, x in terms.items():
                cost[i] += x / v
            constant += const / v
    A = np.zeros((len(rows), len(var)))
    for j, (terms, _, _) in enumerate(rows):
        for i, x in terms.items():
            A[j, i] += x
    integrality = np.array([0 if key[0] in ("Z", "tr") else 1 for key in var])
    upper = np.array([1 if key[0] in ("mtp", "u", "ud") else np.inf for key in var])
    res = milp(cost, constraints=LinearConstraint(A, [r[1] for r in rows], [r[2] for r in rows]),
               integrality=integrality, bounds=Bounds(np.zeros(len(var)), upper),
               options={"time_limit": time_limit, "mip_rel_gap": gap})
    if res.x is None:
        return None
    x = np.rint(res.x).astype(int)
    a = StageAssignment(
        dense_by_mode=tuple(int(x[var["y", r]]) for r in range(MODES)),
        moe_by_mode=tuple(tuple(tuple(int(x[var["x", s, c, r]]) for r in range(MODES)) for c in range(v))
                          for s in range(pp)),
        mtp_mode=int(np.argmax([x[var["mtp", r]] for r in range(MODES)])))
    gap = float(getattr(res, "mip_gap", 0.0) or 0.0) if res.status != 0 else 0.0
    return StageAssignment(a.dense_by_mode, a.moe_by_mode, a.mtp_mode,
                           float(assess(w, layout, [a], schedule)["objective"][0]), gap)


def chunks_even(a: StageAssignment) -> bool:
    """The ILP's feasible chunking: no empty chunk, and the chunks of a stage differ by at most one layer, except
    that the last chunk of the last stage (with the head) may hold fewer."""
    rows = a.layers_per_chunk
    for s, sizes in enumerate(rows):
        if min(sizes) < 1:
            return False
        plain = sizes[:-1] if s == len(rows) - 1 else sizes
        if plain and (max(plain) - min(plain) > 1 or sizes[-1] > min(plain) + 1):
            return False
    return True


def _compositions(total: int, parts: int):
    """All tuples of `parts` non-negative integers summing to `total`."""
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        edges = (-1,) + cuts + (total + parts - 1,)
        yield tuple(edges[i + 1] - edges[i] - 1 for i in range(parts))


def brute_force(w: Workload, layout: dict, memory_limit: float | None = None) -> StageAssignment | None:
    """Every assignment scored by `assess`; for small spaces only (it grows combinatorially)."""
    limit = w.cluster.usable_memory if memory_limit is None else memory_limit
    pp, v = layout["pp"], layout["vpp"]
    k, n_moe = w.shape.first_k_dense, w.shape.num_layers - w.shape.first_k_dense
    candidates = []
    for dense in _compositions(k, MODES):
        for flat in _compositions(n_moe, pp * v * MODES):
            moe = tuple(tuple(flat[(s * v + c) * MODES:(s * v + c + 1) * MODES] for c in range(v)) for s in range(pp))
            a = StageAssignment(dense, moe, 0)
            if not chunks_even(a):
                continue
            for mtp in range(MODES if w.shape.mtp_depth else 1):
                candidates.append(StageAssignment(dense, moe, mtp))
    if not candidates:
        return None
    r = assess(w, layout, candidates)
    objective = np.where(r["memory"].max(axis=1) <= limit, r["objective"], np.inf)
    best = int(np.argmin(objective))
    if not np.isfinite(objective[best]):
        return None
    a = candidates[best]
    return StageAssignment(a.dense_by_mode, a.moe_by_mode, a.mtp_mode, float(objective[best]))
