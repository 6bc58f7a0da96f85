"""One layout through the event-driven pipeline simulator (parallel.pipeline) with the cost model's own costs.

`pipeline_costs` turns a layout and a layers/recompute assignment into per-(stage, chunk) forward/backward
compute, in-pass communication and activation memory of one micro-batch: the form any pipeline simulator can
consume. A stage's layers are split over its virtual chunks as evenly as possible, dense layers first on stage 0;
the embedding sits in chunk 0 of stage 0, head, loss and MTP in the last chunk of the last stage.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parallel.pipeline.schedules import build
from parallel.pipeline.simulator import SimResult, StageCosts, simulate
from parallel.planner.cost_model import (Layouts, StagePlan, Workload, block_costs, p2p_time, stage_memory,
                                         stage_parts, summarise, update_time)
from parallel.planner.model_shape import even_layer_split
from parallel.planner.stage_ilp import MODES, StageAssignment, stage_plans


def even_assignment(w: Workload, layout: dict) -> StageAssignment:
    """Even layer split (remainder to the middle stages) with the layout's uniform recompute mode."""
    mode = ("none", "selective", "full").index(layout["recompute"])
    counts = even_layer_split(w.shape.num_layers, layout["pp"])
    k = w.shape.first_k_dense
    unit = lambda n: tuple(n if r == mode else 0 for r in range(MODES))  # noqa: E731
    moe, first = [], 0
    for n in counts:
        dense = max(0, min(first + n, k) - first)
        moe.append(unit(n - dense))
        first += n
    if sum(counts[:1]) < k:
        raise ValueError(f"layers_per_stage: stage 0 holds {counts[0]} layers, fewer than the {k} dense layers")
    return StageAssignment(unit(k), tuple(moe), mode, float("nan"))


def _chunk_plans(layout: dict, a: StageAssignment) -> list[tuple[int, int, tuple, tuple, bool, bool]]:
    """(stage, chunk, dense per mode, moe per mode, holds embedding, holds head) for every chunk."""
    pp, v = layout["pp"], layout["vpp"]
    out = []
    for s in range(pp):
        modes = ([("dense", r) for r in range(MODES) for _ in range(a.dense_by_mode[r])] if s == 0 else [])
        modes += [("moe", r) for r in range(MODES) for _ in range(a.moe_by_mode[s][r])]
        sizes = even_layer_split(len(modes), v) if len(modes) >= v else [1] * len(modes) + [0] * (v - len(modes))
        sizes = sorted(sizes, reverse=True)
        start = 0
        for c, n in enumerate(sizes):
            part = modes[start:start + n]
            start += n
            dense = tuple(sum(1 for kind, r in part if kind == "dense" and r == m) for m in range(MODES))
            moe = tuple(sum(1 for kind, r in part if kind == "moe" and r == m) for m in range(MODES))
            out.append((s, c, dense, moe, s == 0 and c == 0, s == pp - 1 and c == v - 1))
    return out


def pipeline_costs(w: Workload, layout: dict, a: StageAssignment) -> StageCosts:
    """Per-(stage, chunk) costs of one micro-batch: seconds and activation bytes."""
    pp, v = layout["pp"], layout["vpp"]
    rows = _chunk_plans(layout, a)
    lay = Layouts(**{k: np.full(len(rows), val) for k, val in Layouts.single(**layout).__dict__.items()})
    st = StagePlan(stage=np.array([r[0] for r in rows]), dense_by_mode=np.array([r[2] for r in rows], float).T,
                   moe_by_mode=np.array([r[3] for r in rows], float).T,
                   embedding=np.array([r[4] for r in rows], float), last=np.array([r[5] for r in rows], float),
                   mtp_mode=np.full(len(rows), a.mtp_mode))
    b = block_costs(w, lay)
    parts = stage_parts(w, b, st)
    act = stage_memory(w, lay, b, st)["activation_per_microbatch"]
    grid = lambda x: tuple(tuple(float(x[s * v + c]) for c in range(v)) for s in range(pp))  # noqa: E731
    return StageCosts(forward=grid(parts["fwd_compute"]), backward=grid(parts["bwd_compute"]),
                      forward_comm=grid(parts["fwd_comm"]), backward_comm=grid(parts["bwd_comm"]),
                      activation=grid(act), p2p=float(p2p_time(w, Layouts.single(**layout))[0]))


@dataclass
class Simulation:
    result: SimResult
    step_time: float
    memory_per_stage: list[float]  # bytes: weights, gradients, optimizer, peak activations, transient
    scores: dict  # the same keys as cost_model.evaluate, for this one layout


def simulate_layout(w: Workload, layout: dict, a: StageAssignment | None = None,
                    schedule: str | None = None) -> Simulation:
    """Step time and per-stage peak memory of one layout from the event-driven simulator."""
    a = a or even_assignment(w, layout)
    name = schedule or ("interleaved" if layout["vpp"] > 1 else "1f1b")
    sim = simulate(build(name, layout["pp"], layout["vpp"], layout["m"]), pipeline_costs(w, layout, a))
    plans = stage_plans(layout, a)
    lay = Layouts(**{k: np.full(layout["pp"], val) for k, val in Layouts.single(**layout).__dict__.items()})
    b = block_costs(w, lay)
    mem = stage_memory(w, lay, b, plans)
    parts = stage_parts(w, b, plans)
    fwd, bwd = parts["fwd_compute"] + parts["fwd_comm"], parts["bwd_compute"] + parts["bwd_comm"]
    update = update_time(w, lay, mem, fwd, bwd)
    step = sim.step_time + float(update.max())
    static = mem["weights"] + mem["grads"] + mem["optimizer"] + mem["transient"]
    memory = [float(x) for x in static + np.array(sim.peak_activation)]
    one = Layouts.single(**layout)
    busiest = float((fwd + bwd).max())
    scores = summarise(w, one, np.array([step]), np.array([sim.step_time]), np.array([busiest]),
                       np.array([max(memory)]))
    return Simulation(sim, step, memory, {k: float(v[0]) for k, v in scores.items()})
