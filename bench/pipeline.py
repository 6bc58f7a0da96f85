"""Simulated step time and bubble of 1F1B, interleaved 1F1B and the overlapped variant over a grid of (p, v, m),
optionally the Gantt charts, and the layer placement of a recipe (balanced against the equal-layer split).

    .venv/bin/python -m bench.pipeline                                   # the grid table
    .venv/bin/python -m bench.pipeline --gantt-dir docs/img              # + docs/img/pipeline_*.png (p=4, v=2, m=8)
    .venv/bin/python -m bench.pipeline --recipe recipes/1t.yaml          # + placement of the 1t layout
    .venv/bin/python -m bench.pipeline --p 16 --v 2 --m 64 --recipe recipes/1t.yaml --cluster ascend910b

Grid costs per stage and micro-batch: forward 1, backward 2 (time units), split evenly over the stage's chunks; an
in-pass communication (the expert all-to-all) of --comm-fraction of compute and a point-to-point transfer of --p2p.
The placement takes its costs from the planner's cost model for the recipe's layout on --cluster and its memory
limit from the recipe's context.max_device_memory_gb (else the cluster's usable memory).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from oneline import InputError, OneLineParser
from parallel.pipeline.placement import PlacementOptions, balance, equal_layer_split, placement_p2p, planner_units
from parallel.pipeline.schedules import build, validate
from parallel.pipeline.simulator import StageCosts, gantt, simulate, theoretical_bubble
from telechat_moe.workload import memory_limit, recipe_layout, recipe_workload

SCHEDULES = ("1f1b", "interleaved", "overlapped")


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


def grid_table(ps, vs, ms, comm: float, p2p: float) -> list[str]:
    lines = [f"{'p':>3} {'v':>2} {'m':>4} | " + " | ".join(f"{n:^27}" for n in SCHEDULES) + " | theory 1f1b / interl.",
             f"{'':>12} | " + " | ".join(f"{'step':>7} {'bubble':>7} {'comm':>5} {'act0':>4}" for _ in SCHEDULES)
             + " |"]
    for p in ps:
        for v in vs:
            for m in ms:
                if m % p:
                    lines.append(f"{p:>3} {v:>2} {m:>4} | skipped: the interleaved schedules need m divisible by p")
                    continue
                cells = []
                for name in SCHEDULES:
                    sched = build(name, p, v, m)
                    r = simulate(sched, StageCosts.uniform(p, sched.chunks, p2p=p2p, comm_fraction=comm))
                    cells.append(f"{r.step_time:7.2f} {100 * r.bubble_ratio:6.1f}% {100 * r.exposed_comm_ratio:4.1f}%"
                                 f" {validate(sched).peak_in_flight[0]:4d}")
                lines.append(f"{p:>3} {v:>2} {m:>4} | " + " | ".join(cells) +
                             f" | {100 * theoretical_bubble(p, m):5.1f}% / {100 * theoretical_bubble(p, m, v):4.1f}%")
    return lines


def write_gantts(directory: str, comm: float, p2p: float) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name in SCHEDULES:
        sched = build(name, 4, 2, 8)
        r = simulate(sched, StageCosts.uniform(4, sched.chunks, p2p=p2p, comm_fraction=comm))
        path = os.path.join(directory, f"pipeline_{name}.png")
        gantt(r, path, f"{name}: p=4 v={sched.chunks} m=8, F=1 B=2 per stage, all-to-all {comm:.0%} of compute, "
                       f"p2p {p2p}\nstep {r.step_time:.2f}, bubble {100 * r.bubble_ratio:.1f}%, "
                       f"exposed comm {100 * r.exposed_comm_ratio:.1f}%")
        paths.append(path)
    return paths


def placement_report(recipe_path: str, cluster: str) -> list[str]:
    from telechat_moe.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    w = recipe_workload(recipe, cluster)
    layout = recipe_layout(recipe, w)
    limit = memory_limit(recipe, w)
    name = "interleaved" if layout.vpp > 1 else "1f1b"
    sched = build(name, layout.pp, layout.vpp, layout.micro_batch_num)
    in_flight = validate(sched).peak_in_flight_by_chunk
    p2p = placement_p2p(w, layout)
    gib = 2 ** 30
    lines = [f"placement of {recipe_path} on {cluster} (planner cost model): {layout.describe()}, {name} schedule, "
             f"memory limit {limit / gib:.1f} GiB"]
    for options in (PlacementOptions(memory_limit=limit),
                    PlacementOptions(mtp_apart_from_head=True, memory_limit=limit),
                    PlacementOptions(mtp_apart_from_head=True, mtp_embedding_on_first_stage=True, memory_limit=limit)):
        units = planner_units(w, layout, options)
        start = time.perf_counter()
        balanced = balance(units, layout.pp, layout.vpp, options, in_flight)
        solve = time.perf_counter() - start
        naive = equal_layer_split(units, layout.pp, layout.vpp, in_flight)
        sims = [simulate(sched, pl.stage_costs(p2p)) for pl in (naive, balanced)]
        label = (f"mtp {'apart from' if options.mtp_apart_from_head else 'with'} head"
                 + (", mtp embedding on stage 0" if options.mtp_embedding_on_first_stage else ""))
        lines.append(f"  {label}:")
        for title, pl, sim in (("equal layers", naive, sims[0]), ("balanced", balanced, sims[1])):
            peak = [f + a for f, a in zip(pl.stage_fixed_memory, sim.peak_activation)]
            lines.append(f"    {title:<13} slowest/mean {pl.slowest_over_mean:.4f}  simulated pipeline step "
                         f"{sim.step_time:.3f} s  peak memory {max(peak) / gib:.1f} GiB (bound "
                         f"{max(pl.stage_memory) / gib:.1f}) of {limit / gib:.1f}"
                         + (f"  MILP {solve:.2f} s" if pl is balanced else ""))
    lines.append("  balanced placement (last options), memory = weights, gradients, optimizer, transient and the "
                 "activations of the most micro-batches each chunk holds:")
    lines += ["    " + r for r in balanced.describe().splitlines()]
    return lines


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int_list, default=[2, 4, 8, 16], help="pipeline stages (comma-separated)")
    ap.add_argument("--v", type=int_list, default=[2, 4], help="chunks per stage for the interleaved schedules")
    ap.add_argument("--m", type=int_list, default=[16, 32, 64], help="micro-batches")
    ap.add_argument("--comm-fraction", type=fraction, default=0.3, help="in-pass communication / compute")
    ap.add_argument("--p2p", type=fraction, default=0.02, help="point-to-point transfer time")
    ap.add_argument("--gantt-dir", help="write pipeline_<schedule>.png for p=4, v=2, m=8 here")
    ap.add_argument("--recipe", help="also place the layers of this recipe (balanced vs equal-layer split)")
    ap.add_argument("--cluster", default="ascend910b",
                    help="cluster of the placement's costs (parallel/planner/clusters)")
    args = ap.parse_args(argv)
    try:
        print("\n".join(grid_table(args.p, args.v, args.m, args.comm_fraction, args.p2p)))
        print("step: simulated step time; bubble: idle share of stage time; comm: exposed communication share; "
              "act0: activations in flight on stage 0 (chunk-micro-batches)")
        if args.gantt_dir:
            for path in write_gantts(args.gantt_dir, args.comm_fraction, args.p2p):
                print(f"wrote {path}")
        if args.recipe:
            print("\n".join(placement_report(args.recipe, args.cluster)))
    except InputError as e:  # a recipe, cluster, schedule or placement that cannot be used: its message names it
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
