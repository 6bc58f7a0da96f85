"""One layout through the event-driven pipeline simulator (parallel.pipeline) with the cost model's own costs.

`pipeline_costs` turns a layout and a per-chunk layers/recompute assignment into per-(stage, chunk) forward and
backward compute, in-pass communication and activation memory of one micro-batch: the form any pipeline
simulator can consume. The embedding sits in the chunk holding the first virtual stage, head, loss and MTP in the
one holding the last, as the schedule's ChunkLayout places them (interleaved: chunk 0 of stage 0 and the last
chunk of the last stage; DualPipeV: both on stage 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parallel.layout import ParallelLayout
from parallel.pipeline.schedules import ChunkLayout, build
from parallel.pipeline.simulator import SimResult, StageCosts, simulate
from parallel.pipeline.timeline import simulate_programs
from parallel.planner.blocks import block_costs
from parallel.planner.cost_model import p2p_time, stage_memory, stage_parts, summarise, update_time
from parallel.planner.stage_ilp import StageAssignment, chunk_layout, chunk_plans, even_assignment, schedule_name
from parallel.planner.workload import Layouts, Workload


def pipeline_costs(w: Workload, layout: ParallelLayout, a: StageAssignment,
                   chunks: ChunkLayout = ChunkLayout.INTERLEAVED) -> StageCosts:
    """Per-(stage, chunk) costs of one micro-batch: seconds and activation bytes."""
    pp, v = layout.pp, layout.vpp
    lay = Layouts.of(layout).take(np.zeros(pp * v, int))
    st = chunk_plans(layout, [a], chunks)
    b = block_costs(w, lay)
    parts = stage_parts(w, b, st)
    act = stage_memory(w, lay, b, st)["activation_per_microbatch"]
    grid = lambda x: tuple(tuple(float(x[s * v + c]) for c in range(v)) for s in range(pp))  # noqa: E731
    return StageCosts(forward=grid(parts["fwd_compute"]), backward=grid(parts["bwd_compute"]),
                      forward_comm=grid(parts["fwd_comm"]), backward_comm=grid(parts["bwd_comm"]),
                      activation=grid(act), p2p=float(p2p_time(w, Layouts.of(layout))[0]))


@dataclass
class Simulation:
    result: SimResult
    step_time: float
    memory_per_stage: list[float]  # bytes: weights, gradients, optimizer, peak activations, transient
    scores: dict  # the same keys as cost_model.evaluate, for this one layout


def simulate_layout(w: Workload, layout: ParallelLayout, a: StageAssignment | None = None,
                    schedule: str | None = None) -> Simulation:
    """Step time and per-stage peak memory of one layout from the event-driven simulator: eager sends, or where
    the cluster's transfers are rendezvous (the CPU transport) the stages' executor programs."""
    chunks = chunk_layout(layout, schedule)
    a = a or even_assignment(w, layout, chunks)
    pp, v = layout.pp, layout.vpp
    # the transfers as the cluster's transport runs them (cluster.Runtime.rendezvous_transfers)
    run = simulate_programs if w.cluster.runtime.rendezvous_transfers else simulate
    sim = run(build(schedule_name(layout, schedule), pp, v, layout.micro_batch_num),
              pipeline_costs(w, layout, a, chunks))
    lay = Layouts.of(layout).take(np.zeros(pp * v, int))
    b = block_costs(w, lay)
    st = chunk_plans(layout, [a], chunks)
    mem = stage_memory(w, lay, b, st)
    parts = stage_parts(w, b, st)
    per_stage = lambda x: x.reshape(pp, v).sum(axis=1)  # noqa: E731
    fwd = per_stage(parts["fwd_compute"] + parts["fwd_comm"])
    bwd = per_stage(parts["bwd_compute"] + parts["bwd_comm"])
    params = {k: per_stage(mem[k]) for k in ("dense_params", "expert_params", "replicated_params", "pair_params")}
    step = sim.step_time + float(update_time(w, lay.take(np.zeros(pp, int)), params, fwd, bwd).max())
    static = per_stage(mem["static"]) + mem["transient"].reshape(pp, v).max(axis=1)
    memory = [float(x) for x in static + np.array(sim.peak_activation)]
    scores = summarise(w, Layouts.of(layout), np.array([step]), np.array([sim.step_time]),
                       np.array([float((fwd + bwd).sum())]), np.array([max(memory)]))
    out = {k: float(v[0]) for k, v in scores.items()}
    out["bubble"] = sim.bubble_ratio  # idle share of all stages, from the timeline
    return Simulation(sim, step, memory, out)
