"""From the vectorised search to a ranked short list: per-stage layers and recompute by ILP for the best layouts,
and the nearest feasible alternatives when nothing fits."""
from __future__ import annotations

import dataclasses
import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from parallel.layout import RECOMPUTE, ParallelLayout
from parallel.pipeline.schedules import dualpipe_v_unfit
from parallel.planner.search import SearchResult, SearchSpace, enumerate_layouts, search
from parallel.planner.simulate import simulate_layout
from parallel.planner.stage_ilp import StageAssignment, schedule_name, score_assignment, solve_ilp
from parallel.planner.trainable import trainable
from parallel.planner.workload import Workload

NEAR_FIT = 1.3  # layouts up to this multiple of the memory limit may still fit once the ILP re-balances them


@dataclass
class Candidate:
    layout: ParallelLayout
    assignment: StageAssignment
    scores: dict
    schedule: str  # the pipeline schedule the assignment was balanced and simulated under (schedules.SCHEDULES)


def schedules_for(w: Workload, layout: ParallelLayout) -> tuple[str, ...]:
    """The schedules `refine` balances a layout under: its default (1F1B, interleaved with virtual chunks), and
    DualPipeV where the layout can run it (schedules.dualpipe_v_unfit: two chunks per stage, its V, and at least 2p
    micro-batches; two chunks have more than one stage to turn at by the layout rules, interleave_has_stages) and
    the trainer runs it (parallel.planner.trainable)."""
    default = schedule_name(layout)
    v_fits = dualpipe_v_unfit(layout.pp, layout.vpp, layout.micro_batch_num) is None and trainable(
        w.shape, w.seq_length, layout.tp, layout.pp, layout.ep, layout.etp, layout.cp, layout.sp, layout.ep_scheme,
        "dualpipev")
    return (default, "dualpipev") if v_fits else (default,)


def balance_and_simulate(w: Workload, layout: ParallelLayout, schedule: str) -> Candidate | None:
    """`layout` balanced by ILP under `schedule`, its recompute the mode most layers got, checked by the
    event-driven simulator; None when no assignment fits."""
    a = solve_ilp(w, layout, schedule=schedule)
    if a is None:
        return None
    counts = [sum(a.recompute_per_stage(r)) for r in range(len(RECOMPUTE))]
    layout = dataclasses.replace(layout, recompute=RECOMPUTE[int(np.argmax(counts))])
    sim = simulate_layout(w, layout, a, schedule)
    if sim.scores["memory"] > w.cluster.usable_memory:
        return None
    analytic = score_assignment(w, layout, a, schedule)
    scores = {**sim.scores, "analytic_step_time": analytic["step_time"], "memory_per_stage": sim.memory_per_stage}
    return Candidate(layout, a, scores, schedule)


def balance_best(w: Workload, layout: ParallelLayout) -> Candidate | None:
    """`layout` balanced under each schedule it can run (`schedules_for`), the fastest simulated; None if none fits."""
    balanced = [c for c in (balance_and_simulate(w, layout, name) for name in schedules_for(w, layout)) if c]
    return min(balanced, key=lambda c: c.scores["step_time"]) if balanced else None


def distinct_per_chunk(rows):
    """`rows` without those that differ from an earlier one only in their uniform recompute."""
    seen = set()
    for row in rows:
        key = dataclasses.replace(row, recompute="none")
        if key not in seen:
            seen.add(key)
            yield row


def refine(w: Workload, result: SearchResult, top: int = 10, pool: int | None = None, progress=None,
           workers: int | None = None) -> list[Candidate]:
    """Balance the best `pool` distinct layouts per chunk by ILP (recompute is re-chosen per chunk, so layouts
    that differ only in their uniform recompute collapse into one), check each with the event-driven simulator,
    and return the `top` by simulated step time; where some of the pool do not fit once balanced, the next layouts
    in the search's order are balanced too, until `top` fit or none are left. A layout DualPipeV can run is
    balanced under it as well and kept under whichever schedule simulates faster (`schedules_for`). Scores are the
    simulator's; 'analytic_step_time' is the ILP's model of the same assignment.

    The layouts are balanced side by side on `workers` threads (default: the CPUs this process may use): HiGHS
    releases the GIL while it solves, and each solve is the same deterministic program whatever runs beside it,
    so the list is the one a single thread gives."""
    pool = pool or max(top + 2, 6)
    sc, lay = result.scores, result.layouts
    near = np.flatnonzero(sc["memory"] <= NEAR_FIT * w.cluster.usable_memory)
    order = near[np.argsort(sc["step_time"][near], kind="stable")]
    rows = distinct_per_chunk(lay.row(int(i)) for i in order)
    out, tried = [], 0
    with ThreadPoolExecutor(workers or len(os.sched_getaffinity(0))) as threads:
        # the pool first, then as many more as places are left (each layout adds at most one), until `top` fit
        while tried < pool or len(out) < top:
            batch = list(itertools.islice(rows, pool - tried if tried < pool else top - len(out)))
            if not batch:
                break
            for c in threads.map(lambda row: balance_best(w, row), batch):
                tried += 1
                if progress:
                    progress(tried, max(pool, tried))
                if c:
                    out.append(c)
    out.sort(key=lambda c: c.scores["step_time"])
    return out[:top]


def nearest_device_counts(w: Workload, space: SearchSpace, tries: int = 64) -> list[int]:
    """Device counts near `w.devices` (multiples of the node size) that have at least one valid layout."""
    step = w.cluster.devices_per_node if w.devices >= w.cluster.devices_per_node else 1
    base = w.devices // step * step
    below, above = [], []
    for d in range(tries):
        for n, bucket in ((base - d * step, below), (base + (d + 1) * step, above)):
            if n >= 1 and not bucket and len(enumerate_layouts(dataclasses.replace(w, devices=n), space)[0]):
                bucket.append(n)
        if below and above:
            break
    return below + above


def devices_that_fit(w: Workload, space: SearchSpace, factors=tuple(2 ** i for i in range(1, 11))) -> int | None:
    """The smallest multiple of the device count (by `factors`) on which some layout fits, or None."""
    for f in factors:
        r = search(dataclasses.replace(w, devices=w.devices * f), space)
        if len(r.ranked()):
            return w.devices * f
    return None
