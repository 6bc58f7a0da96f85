"""Layers per pipeline stage and recompute per stage for one layout: an integer linear program, and brute force.

Decision: how many MoE layers each stage holds under each recompute mode (none / selective / full), how the
first-k dense layers (always at the start of stage 0) are recomputed, and the recompute mode of the MTP layer.
Objective: the analytic (interleaved) 1F1B step, (m - 1/v) * max_s t_s + sum_s t_s / v, which is linear with an
auxiliary variable for the slowest stage. Constraint: every stage's memory (weights, gradients, optimizer,
in-flight activations, plus the largest transient of a block it holds) within the device memory.

The coefficients come from the cost model itself, by evaluating one-layer and empty stages, so the program
optimises exactly what `cost_model.stage_time` / `stage_memory` compute; the brute force checks that.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from parallel.planner.cost_model import (Layouts, StagePlan, Workload, block_costs, stage_memory, stage_time)

MODES = 3


@dataclass(frozen=True)
class StageAssignment:
    dense_by_mode: tuple[int, ...]  # first-k dense layers (on stage 0) per recompute mode
    moe_by_mode: tuple[tuple[int, ...], ...]  # per stage: MoE layers per recompute mode
    mtp_mode: int
    objective: float  # analytic pipeline seconds (without point-to-point and optimizer time)

    @property
    def layers_per_stage(self) -> list[int]:
        return [sum(row) + (sum(self.dense_by_mode) if s == 0 else 0) for s, row in enumerate(self.moe_by_mode)]

    def recompute_per_stage(self, mode: int) -> list[int]:
        """Layers recomputed with `mode` on each stage (MindFormers' per-stage recompute lists)."""
        return [row[mode] + (self.dense_by_mode[mode] if s == 0 else 0) for s, row in enumerate(self.moe_by_mode)]


def stage_plans(layout: dict, a: StageAssignment) -> StagePlan:
    """The assignment as a StagePlan over the pp stages (one array entry per stage)."""
    pp = layout["pp"]
    dense = np.zeros((MODES, pp))
    dense[:, 0] = a.dense_by_mode
    return StagePlan(stage=np.arange(pp), dense_by_mode=dense, moe_by_mode=np.array(a.moe_by_mode, float).T,
                     embedding=(np.arange(pp) == 0).astype(float), last=(np.arange(pp) == pp - 1).astype(float),
                     mtp_mode=np.full(pp, a.mtp_mode))


def _repeat(layout: dict, n: int) -> Layouts:
    return Layouts(**{k: np.full(n, v) for k, v in Layouts.single(**layout).__dict__.items()})


def evaluate_assignments(w: Workload, layout: dict, plans: list[StagePlan]) -> tuple[np.ndarray, np.ndarray]:
    """(objective, peak memory) of many assignments, each a StagePlan over the pp stages, in one pass."""
    pp, n = layout["pp"], len(plans)
    lay = _repeat(layout, n * pp)
    st = StagePlan(*(np.concatenate([getattr(p, f) for p in plans], axis=-1) for f in
                     ("stage", "dense_by_mode", "moe_by_mode", "embedding", "last", "mtp_mode")))
    b = block_costs(w, lay)
    f, bw = stage_time(w, b, st)
    t = (f + bw).reshape(n, pp)
    mem = stage_memory(w, lay, b, st)["total"].reshape(n, pp)
    m, v = layout["m"], layout["vpp"]
    return (m - 1 / v) * t.max(axis=1) + t.sum(axis=1) / v, mem.max(axis=1)


def _coefficients(w: Workload, layout: dict):
    """Per stage: time and memory of an empty stage (per MTP mode) and per added layer (per kind and mode),
    and the transient of each block kind and mode, all from the cost model."""
    pp = layout["pp"]
    rows = []  # (stage, dense per mode, moe per mode, mtp mode)
    for s in range(pp):
        for mtp in range(MODES):
            rows.append((s, (0, 0, 0), (0, 0, 0), mtp))
        for r in range(MODES):
            unit = tuple(int(i == r) for i in range(MODES))
            rows.append((s, (0, 0, 0), unit, 0))
            rows.append((s, unit, (0, 0, 0), 0))
    n = len(rows)
    lay = _repeat(layout, n)
    st = StagePlan(stage=np.array([r[0] for r in rows]), dense_by_mode=np.array([r[1] for r in rows], float).T,
                   moe_by_mode=np.array([r[2] for r in rows], float).T,
                   embedding=np.array([r[0] == 0 for r in rows], float),
                   last=np.array([r[0] == pp - 1 for r in rows], float), mtp_mode=np.array([r[3] for r in rows]))
    b = block_costs(w, lay)
    f, bw = stage_time(w, b, st)
    mem = stage_memory(w, lay, b, st)
    t, linear = f + bw, mem["total"] - mem["transient"]
    per_stage = 3 * MODES
    base_t = np.array([[t[s * per_stage + k] for k in range(MODES)] for s in range(pp)])  # [pp, mtp mode]
    base_m = np.array([[linear[s * per_stage + k] for k in range(MODES)] for s in range(pp)])
    base_tr = np.array([[mem["transient"][s * per_stage + k] for k in range(MODES)] for s in range(pp)])
    moe_t = np.array([[t[s * per_stage + MODES + 2 * r] - base_t[s, 0] for r in range(MODES)] for s in range(pp)])
    moe_m = np.array([[linear[s * per_stage + MODES + 2 * r] - base_m[s, 0] for r in range(MODES)] for s in range(pp)])
    dense_t = np.array([t[MODES + 2 * r + 1] - base_t[0, 0] for r in range(MODES)])
    dense_m = np.array([linear[MODES + 2 * r + 1] - base_m[0, 0] for r in range(MODES)])
    moe_tr = np.array([b.moe.transient[r][0] for r in range(MODES)])
    dense_tr = np.array([b.dense.transient[r][0] for r in range(MODES)])
    return base_t, base_m, base_tr, moe_t, moe_m, dense_t, dense_m, moe_tr, dense_tr


def solve_ilp(w: Workload, layout: dict, memory_limit: float | None = None,
              time_limit: float = 10.0) -> StageAssignment | None:
    """Optimal assignment for `layout` (a Layouts.row dict), or None when no assignment fits in memory."""
    limit = w.cluster.usable_memory if memory_limit is None else memory_limit
    pp, v, m = layout["pp"], layout["vpp"], layout["m"]
    L, k = w.shape.num_layers, w.shape.first_k_dense
    n_moe = L - k
    base_t, base_m, base_tr, moe_t, moe_m, dense_t, dense_m, moe_tr, dense_tr = _coefficients(w, layout)
    # variable layout: x[s,r] (pp*3) | y[r] (3) | mtp one-hot (3) | u[s,r] (pp*3) | ud[r] (3) | Z | tr[s] (pp)
    nx, ny, nz = pp * MODES, MODES, MODES
    ix = lambda s, r: s * MODES + r  # noqa: E731
    iy = lambda r: nx + r  # noqa: E731
    imtp = lambda r: nx + ny + r  # noqa: E731
    iu = lambda s, r: nx + ny + nz + s * MODES + r  # noqa: E731
    iud = lambda r: nx + ny + nz + nx + r  # noqa: E731
    iZ = nx + ny + nz + nx + MODES
    itr = lambda s: iZ + 1 + s  # noqa: E731
    nvar = iZ + 1 + pp
    A, lo, hi = [], [], []

    def row(coeffs: dict[int, float], low: float, high: float) -> None:
        r = np.zeros(nvar)
        for i, c in coeffs.items():
            r[i] += c
        A.append(r)
        lo.append(low)
        hi.append(high)

    last = pp - 1
    row({iy(r): 1 for r in range(MODES)}, k, k)
    row({ix(s, r): 1 for s in range(pp) for r in range(MODES)}, n_moe, n_moe)
    row({imtp(r): 1 for r in range(MODES)}, 1, 1)
    for s in range(pp):
        layers = {ix(s, r): 1 for r in range(MODES)}
        if s == 0:
            layers.update({iy(r): 1 for r in range(MODES)})
        row(layers, v, np.inf)  # every virtual chunk holds a layer
        # stage time <= Z (the MTP-mode-dependent base only on the last stage)
        t = {ix(s, r): moe_t[s, r] for r in range(MODES)}
        if s == 0:
            t.update({iy(r): dense_t[r] for r in range(MODES)})
        if s == last:
            t.update({imtp(r): base_t[s, r] - base_t[s, 0] for r in range(MODES)})
        t[iZ] = -1.0
        row(t, -np.inf, -base_t[s, 0])
        # memory: linear part + transient <= limit
        mm = {ix(s, r): moe_m[s, r] for r in range(MODES)}
        if s == 0:
            mm.update({iy(r): dense_m[r] for r in range(MODES)})
        if s == last:
            mm.update({imtp(r): base_m[s, r] - base_m[s, 0] for r in range(MODES)})
        mm[itr(s)] = 1.0
        row(mm, -np.inf, limit - base_m[s, 0])
        # transient >= each present block's transient; indicators forced on by counts
        for r in range(MODES):
            row({ix(s, r): 1, iu(s, r): -n_moe}, -np.inf, 0)
            row({itr(s): 1, iu(s, r): -moe_tr[r]}, 0, np.inf)
            if s == last:
                row({itr(s): 1, imtp(r): -base_tr[s, r]}, 0, np.inf)
        if s == 0:
            for r in range(MODES):
                row({iy(r): 1, iud(r): -max(k, 1)}, -np.inf, 0)
                row({itr(s): 1, iud(r): -dense_tr[r]}, 0, np.inf)
    # objective: (m - 1/v) Z + sum_s t_s / v
    cost = np.zeros(nvar)
    cost[iZ] = m - 1 / v
    for s in range(pp):
        for r in range(MODES):
            cost[ix(s, r)] += moe_t[s, r] / v
        if s == last:
            for r in range(MODES):
                cost[imtp(r)] += (base_t[s, r] - base_t[s, 0]) / v
    for r in range(MODES):
        cost[iy(r)] += dense_t[r] / v
    constant = base_t[:, 0].sum() / v
    integrality = np.ones(nvar)
    integrality[iZ] = 0
    integrality[itr(0):] = 0
    upper = np.full(nvar, np.inf)
    upper[[imtp(r) for r in range(MODES)]] = 1
    upper[[iu(s, r) for s in range(pp) for r in range(MODES)]] = 1
    upper[[iud(r) for r in range(MODES)]] = 1
    res = milp(cost, constraints=LinearConstraint(np.array(A), lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nvar), upper), options={"time_limit": time_limit, "mip_rel_gap": 1e-9})
    if res.x is None:
        return None
    x = np.rint(res.x).astype(int)
    return StageAssignment(dense_by_mode=tuple(int(x[iy(r)]) for r in range(MODES)),
                           moe_by_mode=tuple(tuple(int(x[ix(s, r)]) for r in range(MODES)) for s in range(pp)),
                           mtp_mode=int(np.argmax([x[imtp(r)] for r in range(MODES)])),
                           objective=float(res.fun + constant))


def _compositions(total: int, parts: int):
    """All tuples of `parts` non-negative integers summing to `total`."""
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        edges = (-1,) + cuts + (total + parts - 1,)
        yield tuple(edges[i + 1] - edges[i] - 1 for i in range(parts))


def brute_force(w: Workload, layout: dict, memory_limit: float | None = None) -> StageAssignment | None:
    """Every assignment scored by the cost model; for small spaces only (it grows combinatorially)."""
    limit = w.cluster.usable_memory if memory_limit is None else memory_limit
    pp, v = layout["pp"], layout["vpp"]
    L, k = w.shape.num_layers, w.shape.first_k_dense
    candidates = []
    for dense in _compositions(k, MODES):
        for flat in _compositions(L - k, pp * MODES):
            moe = tuple(flat[s * MODES:(s + 1) * MODES] for s in range(pp))
            counts = [sum(moe[s]) + (k if s == 0 else 0) for s in range(pp)]
            if min(counts) < v:
                continue
            for mtp in range(MODES if w.shape.mtp_depth else 1):
                candidates.append(StageAssignment(dense, moe, mtp, 0.0))
    if not candidates:
        return None
    objective, memory = evaluate_assignments(w, layout, [stage_plans(layout, a) for a in candidates])
    objective = np.where(memory <= limit, objective, np.inf)
    best = int(np.argmin(objective))
    if not np.isfinite(objective[best]):
        return None
    a = candidates[best]
    return StageAssignment(a.dense_by_mode, a.moe_by_mode, a.mtp_mode, float(objective[best]))
