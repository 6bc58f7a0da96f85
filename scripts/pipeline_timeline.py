"""A pipeline-parallel training step as it ran, beside the simulator's prediction for the chunk times it measured.

    python -m scripts.pipeline_timeline OUTPUT_DIR [--step N] [--pipeline R] [--png-dir DIR]

Reads OUTPUT_DIR/logs/pipeline_timeline/rank_*.jsonl (under pipeline_stage > 1 the trainer writes a line per step
and rank: what the executor ran and when), takes the stages of one pipeline (the one whose first rank is R, default
0) at step N (default: the last step every stage recorded; the first step compiles), and writes DIR/measured.png
and DIR/simulated.png (DIR: OUTPUT_DIR/logs/pipeline_timeline) with the simulator's Gantt code. Prints per stage its
compute, transfer time, activations held at most (count and bytes) and peak resident set; then the step and the
idle share (the stages' time not spent in forward or backward compute: bubble, transfers and host work) measured
and simulated (the executor's programs with rendezvous transfers, as the CPU transport runs them), the simulated
bubble alone, and the planner's simulator (eager sends) on the same costs (parallel/pipeline/timeline.py).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from oneline import InputError, OneLineParser


def load(out: Path, pipeline: int) -> dict[int, dict[int, dict]]:
    """step -> stage -> the record of that stage's rank, for the pipeline whose first rank is `pipeline`."""
    folder = out / "logs" / "pipeline_timeline"
    files = sorted(folder.glob("rank_*.jsonl"))
    if not files:
        raise InputError(f"{folder}: no pipeline timeline (rank_*.jsonl); a run with pipeline_stage > 1 writes it")
    steps: dict[int, dict[int, dict]] = {}
    for path in files:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                record = json.loads(line)
            except ValueError:
                raise InputError(f"{path}:{n}: not a JSON record") from None
            if record.get("pipeline") == pipeline:
                steps.setdefault(record["step"], {})[record["stage"]] = record
    if not steps:
        raise InputError(f"--pipeline {pipeline}: no pipeline starts at rank {pipeline} in {folder}")
    return steps


def main(argv=None) -> int:
    p = OneLineParser(prog="python -m scripts.pipeline_timeline",
                      description="a measured pipeline step beside its simulation")
    p.add_argument("output_dir", help="the run's output_dir")
    p.add_argument("--step", type=int, default=None, help="which step (default: the last one every stage recorded)")
    p.add_argument("--pipeline", type=int, default=0, help="the first rank of the pipeline to draw")
    p.add_argument("--png-dir", default="", help="where the two PNGs go (default: beside the timelines)")
    args = p.parse_args(argv)
    try:
        from parallel.pipeline.simulator import gantt
        from parallel.pipeline.timeline import StageTimeline, compare, idle_share
        out = Path(args.output_dir)
        steps = load(out, args.pipeline)
        stages = next(iter(next(iter(steps.values())).values()))["stages"]
        whole = sorted(s for s, by_stage in steps.items() if len(by_stage) == stages)
        if not whole:
            raise InputError(f"{out}: no step recorded by all {stages} stages")
        step = whole[-1] if args.step is None else args.step
        if step not in whole:
            raise InputError(f"--step {step}: not recorded by every stage (steps {whole[0]}..{whole[-1]})")
        records = [steps[step][s] for s in range(stages)]
        result = compare([StageTimeline.from_json(r) for r in records])
        png_dir = Path(args.png_dir) if args.png_dir else out / "logs" / "pipeline_timeline"
        png_dir.mkdir(parents=True, exist_ok=True)
        sched = result.measured.schedule
        what = f"{sched.name} p={sched.stages} v={sched.chunks} m={sched.microbatches}, step {step}"
        gantt(result.measured, str(png_dir / "measured.png"),
              f"measured: {what}  {result.measured.step_time:.3f} s, idle {100 * result.measured_idle:.1f}%")
        gantt(result.simulated, str(png_dir / "simulated.png"),
              f"simulated on the measured chunk times: {what}  {result.simulated.step_time:.3f} s, idle "
              f"{100 * result.simulated_idle:.1f}% (bubble {100 * result.simulated.bubble_ratio:.1f}%)")
    except InputError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"pipeline of rank {args.pipeline}, {what}")
    print(f"{'stage':>5} {'rank':>5} {'compute s':>10} {'transfers s':>12} {'in flight':>10} {'held MiB':>9} "
          f"{'peak RSS GiB':>13}")
    for s, r in enumerate(records):
        print(f"{s:>5} {r['rank']:>5} {result.measured.compute[s]:>10.3f} {result.measured.exposed_comm[s]:>12.3f} "
              f"{r['peak_in_flight']:>10} {r['peak_in_flight_bytes'] / 2 ** 20:>9.2f} "
              f"{r['max_rss_bytes'] / 2 ** 30:>13.2f}")
    c = result.costs
    print("chunk times (s), forward / backward per stage and chunk: "
          + "; ".join(f"stage {s}: " + ", ".join(f"{f:.4f}/{b:.4f}" for f, b in zip(c.forward[s], c.backward[s]))
                      for s in range(sched.stages)) + f"; transfer {c.p2p * 1e3:.2f} ms")
    print(f"step: measured {result.measured.step_time:.3f} s, simulated {result.simulated.step_time:.3f} s")
    print(f"idle share: measured {100 * result.measured_idle:.1f}%, simulated {100 * result.simulated_idle:.1f}% "
          f"(difference {100 * (result.measured_idle - result.simulated_idle):+.1f} points); simulated bubble "
          f"{100 * result.simulated.bubble_ratio:.1f}%")
    print(f"eager sends (the planner's simulator where a cluster's sends are eager) on the same costs: step "
          f"{result.eager.step_time:.3f} s, idle {100 * idle_share(result.eager):.1f}%, bubble "
          f"{100 * result.eager.bubble_ratio:.1f}%")
    planned = planner_prediction(out, sched)
    if planned is not None:
        print(f"the planner's prediction (its costs of this run's placement, transfers as its cluster runs them): "
              f"step {planned.step_time:.3f} s, idle {100 * idle_share(planned):.1f}%, compute per stage "
              + ", ".join(f"{c:.3f}" for c in planned.compute) + " s")
    print(f"wrote {png_dir / 'measured.png'} and {png_dir / 'simulated.png'}")
    return 0


def planner_prediction(out: Path, schedule):
    """The planner's simulation of the run's pipeline: the placement the trainer built for the run's recipe
    (logs/recipe.yaml), that placement's per-chunk costs from the cost model on the cluster pricing the device,
    and the transfers as that cluster's transport runs them (`simulate_layout`'s choice); None without the recipe."""
    path = out / "logs" / "recipe.yaml"
    if not path.is_file():
        return None
    from parallel.pipeline.placement import placement_p2p
    from parallel.pipeline.simulator import simulate
    from parallel.pipeline.timeline import simulate_programs
    from telechat_moe.recipe import load_recipe
    from telechat_moe.workload import device_cluster, recipe_layout, recipe_placement, recipe_workload
    recipe = load_recipe(str(path))
    w = recipe_workload(recipe, device_cluster(recipe))
    costs = recipe_placement(recipe).stage_costs(placement_p2p(w, recipe_layout(recipe, w)))
    return (simulate_programs if w.cluster.runtime.rendezvous_transfers else simulate)(schedule, costs)


if __name__ == "__main__":
    sys.exit(main())
