"""Parallel strategy planner: `python -m telechat_moe.plan --recipe 1t.yaml --devices 4096 --cluster ascend910b`.

Scores every valid layout of the recipe's model on the cluster, balances the best by ILP, prints the top ones,
and optionally writes the pick into a recipe (`--write`), draws step time against memory (`--png`), or scores one
given layout (`--evaluate tp=8,pp=16,vpp=2,ep=32`, optionally under a pipeline `schedule=`). The search proposes
only what the trainer runs (parallel.planner.trainable, the predicate check_trainable asks), and `--write` writes
every knob the pick was priced with; `--evaluate` prices any layout. `--model NAME` plans a named planner shape (model_shape.NAMED_SHAPES: dense, GQA and published
models) in place of the recipe's model, under the recipe's training settings. `--export-mindformers OUT.yaml`
scores the `--evaluate` layout, or else the recipe's own, and writes its pipeline plan as MindFormers' recipe keys
(parallel.pipeline.mindformers_export). Bad input: one line on stderr, exit code 2. It reads recipes, so it lives
on the application's side of the planner library (parallel.planner), which knows no recipe.
"""
from __future__ import annotations

import dataclasses
import shlex
import sys
import time
from pathlib import Path

import yaml

from oneline import InputError, OneLineParser
from parallel.layout import EP_SCHEMES, RECOMPUTE, LayoutError, ParallelLayout, check_model_fit, global_batch_splits
from parallel.planner.cost_model import evaluate
from parallel.planner.model_shape import NAMED_SHAPES
from parallel.planner.refine import Candidate, devices_that_fit, nearest_device_counts, refine
from parallel.pipeline.mindformers_export import export
from parallel.pipeline.placement import Placement, PlacementOptions, balance, planner_units
from parallel.pipeline.schedules import ScheduleError, build, dualpipe_v_unfit
from parallel.planner.report import GIB, layout_text, plot, stage_text, table, write_atomically, write_recipe
from parallel.planner.search import SearchSpace, search
from parallel.planner.simulate import simulate_layout
from parallel.planner.stage_ilp import (chunk_layout, even_assignment, held_profiles, schedule_name, score_assignment,
                                       solve_ilp)
from parallel.planner.trainable import layout_refusal
from parallel.planner.workload import Layouts, Workload
from telechat_moe.recipe import RecipeError, find_recipe, load_recipe
from telechat_moe.recipe_checks import layout_error_text
from telechat_moe.workload import memory_limit, recipe_ep_scheme, recipe_layout, recipe_workload

PROG = "python -m telechat_moe.plan"
EVALUATE_KEYS = ("tp", "pp", "vpp", "dp", "ep", "etp", "mbs", "m", "cp", "recompute", "ep_scheme", "ep_overlap",
                 "schedule")
# The pipeline schedules the planner balances and prices (placement.step_terms); gpipe only runs in the trainer.
EVALUATE_SCHEDULES = ("1f1b", "interleaved", "overlapped", "dualpipev")


class PlanError(InputError):
    """Bad input to the planner; the message is the one line the user sees."""


def read_recipe(path: str):
    """The recipe through the trainer's own loader (base: inheritance, validation)."""
    try:
        return load_recipe(path), find_recipe(path)
    except RecipeError as e:
        raise PlanError(str(e)) from None


def evaluate_items(text: str) -> dict[str, str]:
    """`tp=8,pp=16,...` as {key: value}."""
    given = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in EVALUATE_KEYS:
            raise PlanError(f"--evaluate: {item!r} is not key=value with key in {', '.join(EVALUATE_KEYS)}")
        given[key] = value.strip()
    return given


def parse_layout(text: str, w: Workload, recipe) -> ParallelLayout:
    """`tp=8,pp=16,...` into a layout; dp and m follow from devices and global batch when not given."""
    given = evaluate_items(text)
    ints = {}
    for key in ("tp", "pp", "vpp", "dp", "ep", "etp", "mbs", "m", "cp"):
        if key in given:
            if not given[key].isdigit() or int(given[key]) < 1:
                raise PlanError(f"--evaluate: {key} expects a positive integer, got {given[key]!r}")
            ints[key] = int(given[key])
    tp, pp, cp = ints.get("tp", 1), ints.get("pp", 1), ints.get("cp", 1)
    if w.devices % (tp * pp * cp):
        product = f"tp*pp = {tp * pp}" if cp == 1 else f"tp*cp*pp = {tp * cp * pp}"
        raise PlanError(f"--evaluate: {product} does not divide --devices {w.devices}")
    dp = ints.get("dp", w.devices // (tp * pp * cp))
    mbs = ints.get("mbs", 1)
    if "m" in ints:
        m = ints["m"]
    elif not global_batch_splits(w.global_batch, dp, mbs):
        raise PlanError(f"--evaluate: global batch {w.global_batch} is not divisible by dp*mbs = {dp * mbs}")
    else:
        m = w.global_batch // (dp * mbs)
    if dp * mbs * m != w.global_batch:
        raise PlanError(f"--evaluate: dp*mbs*m = {dp}*{mbs}*{m} = {dp * mbs * m}, but the global batch is "
                        f"{w.global_batch}")
    choices = {"recompute": (given.get("recompute", recipe.recompute_config.mode), RECOMPUTE),
               "ep_scheme": (given.get("ep_scheme", recipe_ep_scheme(recipe)), EP_SCHEMES),
               "ep_overlap": (given.get("ep_overlap", "0"), ("0", "1", "false", "true"))}
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise PlanError(f"--evaluate: {key} expects one of {', '.join(allowed)}, got {value!r}")
    layout = ParallelLayout(dp=dp, tp=tp, pp=pp, vpp=ints.get("vpp", 1), ep=ints.get("ep", 1),
                            etp=ints.get("etp", 1), cp=cp, sp=tp > 1, micro_batch_num=m,
                            devices_per_node=w.cluster.devices_per_node, micro_batch_size=mbs,
                            recompute=choices["recompute"][0], ep_scheme=choices["ep_scheme"][0],
                            ep_overlap=choices["ep_overlap"][0] in ("1", "true"))
    try:
        layout.validate(w.devices)
    except LayoutError as e:  # worded in the recipe's keys, as the recipe's own validation words it
        raise PlanError(f"--evaluate: {layout_error_text(e)}") from None
    try:
        check_model_fit(w.shape, tp, pp, layout.vpp, layout.ep, w.cluster.devices_per_node, etp=layout.etp)
    except LayoutError as e:
        raise PlanError(f"--evaluate: {e.reason()}") from None
    return layout


def parse_schedule(text: str, layout: ParallelLayout) -> str:
    """`--evaluate`'s `schedule=` (default `schedule_name`'s) checked against its layout, each rule in the keys the
    user gave."""
    schedule = schedule_name(layout, evaluate_items(text).get("schedule"))
    pp, vpp, m = layout.pp, layout.vpp, layout.micro_batch_num
    if schedule not in EVALUATE_SCHEDULES:
        raise PlanError(f"--evaluate: schedule expects one of {', '.join(EVALUATE_SCHEDULES)}, got {schedule!r}")
    unfit = dualpipe_v_unfit(pp, vpp, m, names={"p": "pp", "v": "vpp", "m": "m"}) if schedule == "dualpipev" else None
    if unfit:
        raise PlanError(f"--evaluate: schedule=dualpipev {unfit[1]}")
    if schedule == "1f1b" and vpp > 1:
        raise PlanError(f"--evaluate: schedule=1f1b runs one chunk per stage, got vpp={vpp}; use interleaved")
    try:
        build(schedule, pp, vpp, m)
    except ScheduleError as e:  # the schedules' own rules, e.g. the overlapped one's micro-batch groups
        raise PlanError(f"--evaluate: schedule={schedule}: {e}") from None
    return schedule


def check_writable(option: str, w: Workload, layout: ParallelLayout, schedule: str) -> None:
    """A written plan must run where it goes: `--write`'s in the trainer (the predicate check_trainable asks,
    parallel.planner.trainable), `--export-mindformers`' in MindFormers, which has no DualPipeV (its export words
    'overlapped' itself)."""
    if option == "--write":
        problem = layout_refusal(w.shape, w.seq_length, layout, schedule)
        if problem:
            raise PlanError(f"--write: the trainer does not run this plan: {problem}")
    elif schedule == "dualpipev":
        raise PlanError(f"{option}: the plan runs the dualpipev schedule; MindFormers has no DualPipeV scheduler; "
                        f"evaluate the layout with schedule=interleaved to write it")


def own_layout(w: Workload, recipe) -> ParallelLayout:
    """The recipe's own layout, which holds only on the recipe's own device count and global batch."""
    lay = recipe.layout
    if w.devices != lay.world_size or w.global_batch % (lay.dp * lay.micro_batch_num):
        raise PlanError(f"--export-mindformers: the recipe's layout is for {lay.world_size} devices and a global "
                        f"batch divisible by {lay.dp * lay.micro_batch_num}; give the layout with --evaluate")
    return recipe_layout(recipe, w)


def recipe_placement(recipe, w: Workload, layout: ParallelLayout, schedule: str | None = None) -> Placement:
    """The placement MILP's cut of the model for `layout`, as the trainer makes it (pipeline_step.stage_plan: the
    planner's units, the step of the layout's micro-batches), here also under the recipe's device memory over the
    micro-batches its schedule holds."""
    options = PlacementOptions(micro_batches=layout.micro_batch_num, memory_limit=memory_limit(recipe, w))
    held = held_profiles(layout.pp, layout.vpp, layout.micro_batch_num, schedule_name(layout, schedule))
    return balance(planner_units(w, layout, options), layout.pp, layout.vpp, options, held)


class _FlowLists(yaml.SafeDumper):
    """Sections in block style, lists in flow style (`offset: [[1, 1], [1, -2]]`), as MindFormers' recipes write
    them."""


_FlowLists.add_representer(list, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))


def write_mindformers(path: str, recipe, w: Workload, layout: ParallelLayout, schedule: str, command: str) -> None:
    """The layout's pipeline plan under `schedule` as MindFormers' recipe keys, in a YAML file (atomically)."""
    placement = recipe_placement(recipe, w, layout, schedule)
    keys = export(placement, schedule, layout.micro_batch_num, layout).recipe_keys()
    header = [f"# Written by: {command}",
              f"# MindFormers' pipeline keys for {recipe.name} at {layout_text(layout)}, {schedule} "
              f"schedule, on {w.cluster.name}; merge them into a MindFormers recipe.",
              "# Placement (the placement MILP, as the trainer cuts the model):",
              *(f"#   {line}" for line in placement.describe().splitlines())]
    write_atomically(Path(path), "\n".join(header) + "\n"
                     + yaml.dump(keys, Dumper=_FlowLists, sort_keys=False))


def progress(label: str):
    """A progress line on a terminal; nothing when stderr is a file or pipe (it must stay one line on errors)."""
    def report(done: int, total: int) -> None:
        if sys.stderr.isatty():
            print(f"\r{label} {done:,}/{total:,}", end="\n" if done == total else "", file=sys.stderr, flush=True)
    return report


def run_evaluate(w: Workload, layout: ParallelLayout, schedule: str) -> list[Candidate]:
    even = evaluate(w, Layouts.of(layout))
    default = schedule_name(layout)
    print(f"layout {layout_text(layout)}, {schedule} schedule")
    if schedule != default:  # the search's analytic model knows the default schedule only
        print(f"  (even split, analytic: the search's model, under the {default} schedule)")
    print(f"  even split, analytic   : step {even['step_time'][0]:.3f} s, {even['tokens_per_s_per_device'][0]:.1f} "
          f"tokens/s/device, MFU {100 * even['mfu'][0]:.1f}%, peak memory {even['memory'][0] / GIB:.1f} GiB "
          f"(usable {w.cluster.usable_memory / GIB:.1f}), bubble {100 * even['bubble'][0]:.1f}%")
    sim = simulate_layout(w, layout, even_assignment(w, layout, chunk_layout(layout, schedule)), schedule)
    print(f"  even split, simulated  : step {sim.step_time:.3f} s, bubble {100 * sim.result.bubble_ratio:.1f}%, "
          f"memory per stage (GiB) {[round(m / GIB, 1) for m in sim.memory_per_stage]}")
    a = solve_ilp(w, layout, schedule=schedule)
    if a is None:
        print("  ILP: no layers/recompute assignment fits in memory")
        return []
    analytic = score_assignment(w, layout, a, schedule)
    sim = simulate_layout(w, layout, a, schedule)
    c = Candidate(layout, a, {**sim.scores, "analytic_step_time": analytic["step_time"],
                              "memory_per_stage": sim.memory_per_stage}, schedule)
    print(f"  ILP-balanced, analytic : step {analytic['step_time']:.3f} s\n"
          f"  ILP-balanced, simulated: step {sim.step_time:.3f} s, {sim.scores['tokens_per_s_per_device']:.1f} "
          f"tokens/s/device, MFU {100 * sim.scores['mfu']:.1f}%, peak memory {sim.scores['memory'] / GIB:.1f} GiB, "
          f"bubble {100 * sim.scores['bubble']:.1f}%\n  {stage_text(c)}")
    return [c]


def run_search(w: Workload, space: SearchSpace, top: int):
    result = search(w, space, progress=progress("scoring layouts"))
    rate = result.scored / max(result.seconds, 1e-9) * 60
    print(f"scored {result.scored:,} layouts (of {result.raw_size:,} combinations before pruning) in "
          f"{result.seconds:.2f} s: {rate:,.0f} layouts/minute")
    if result.scored == 0:
        near = nearest_device_counts(w, space)
        raise PlanError(f"--devices: no layout of this model divides {w.devices} devices with global batch "
                        f"{w.global_batch}; nearest device counts with layouts: {', '.join(map(str, near)) or 'none'}")
    t0 = time.perf_counter()
    candidates = refine(w, result, top, progress=progress("ILP-balancing the best layouts"))
    print(f"ILP-balanced {min(len(candidates), top)} of the best layouts in {time.perf_counter() - t0:.2f} s")
    if not candidates:
        least = float(result.scores["memory"].min())
        more = devices_that_fit(w, space)
        hint = f"; some layout fits on {more} devices" if more else ""
        raise PlanError(f"the model fits nowhere: the leanest layout needs {least / GIB:.1f} GiB per device, "
                        f"{w.cluster.name} has {w.cluster.usable_memory / GIB:.1f} GiB usable{hint}")
    return result, candidates


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="recipe file (1t.yaml finds recipes/1t.yaml)")
    parser.add_argument("--model", help=f"plan this model instead of the recipe's, under the recipe's training "
                                        f"settings: {', '.join(NAMED_SHAPES)}")
    parser.add_argument("--devices", type=int, help="device count (default: the recipe's layout)")
    parser.add_argument("--cluster", default="ascend910b", help="cluster name or YAML path (default ascend910b)")
    parser.add_argument("--seq", type=int, help="sequence length (default: the recipe's)")
    parser.add_argument("--global-batch", type=int, help="sequences per step (default: the recipe's)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16", "fp8"), help="GEMM dtype (default: recipe)")
    parser.add_argument("--precision", help="bytes per tensor kind, e.g. weights=bf16,master=fp32,grads=fp32,"
                                            "moments=fp32,activations=bf16 (default: the recipe's dtypes)")
    parser.add_argument("--top", type=int, default=10, help="layouts to list (default 10)")
    parser.add_argument("--write", help="write the best layout into this recipe file (inherits --recipe)")
    parser.add_argument("--evaluate", help="score one layout, e.g. tp=8,pp=16,vpp=2,ep=32,mbs=1,recompute=full; "
                                           f"schedule= one of {', '.join(EVALUATE_SCHEDULES)} (default by vpp)")
    parser.add_argument("--png", help="draw step time against memory for the scored layouts")
    parser.add_argument("--export-mindformers", metavar="OUT.yaml",
                        help="write the pipeline plan of the --evaluate layout (default: the recipe's own) as "
                             "MindFormers' recipe keys")
    args = parser.parse_args(argv)
    try:
        for name in ("devices", "seq", "global_batch", "top"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise PlanError(f"--{name.replace('_', '-')}: expected a positive integer, got {value}")
        if args.model and args.model not in NAMED_SHAPES:
            raise PlanError(f"--model: unknown model {args.model!r}; known: {', '.join(NAMED_SHAPES)}")
        if args.model and args.write:
            raise PlanError(f"--write: a recipe inheriting --recipe trains the recipe's model, not --model "
                            f"{args.model}; write MindFormers' keys with --export-mindformers instead")
        recipe, recipe_path = read_recipe(args.recipe)
        for option, out in (("--write", args.write), ("--export-mindformers", args.export_mindformers)):
            if out and recipe_path.resolve() == Path(out).resolve():
                raise PlanError(f"{option}: refusing to overwrite the input recipe; name a new file")
        args.devices = args.devices or recipe.layout.world_size
        w = recipe_workload(recipe, args.cluster, args.devices, args.seq, args.global_batch, args.dtype,
                            args.precision)
        if args.model:
            w = dataclasses.replace(w, shape=dataclasses.replace(NAMED_SHAPES[args.model], seq_length=w.seq_length))
        experts = (f"{w.shape.num_routed_experts} experts top-{w.shape.top_k}" if w.shape.num_routed_experts
                   else "dense")
        print(f"model {args.model or recipe.name}: {w.shape.num_layers} layers, {experts}; {w.devices} x "
              f"{w.cluster.name} ({w.cluster.usable_memory / GIB:.1f} GiB usable), "
              f"seq {w.seq_length}, global batch {w.global_batch}, GEMMs in {w.precision.matmul_dtype}")
        command = f"{PROG} " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        if args.evaluate or args.export_mindformers:
            if args.evaluate:
                layout = parse_layout(args.evaluate, w, recipe)
                schedule = parse_schedule(args.evaluate, layout)
            elif args.model:
                raise PlanError(f"--export-mindformers: the recipe's layout is for its own model; give one for "
                                f"--model {args.model} with --evaluate")
            else:
                layout = own_layout(w, recipe)
                schedule = schedule_name(layout)
            for option, out in (("--write", args.write), ("--export-mindformers", args.export_mindformers)):
                if out:
                    check_writable(option, w, layout, schedule)
            candidates = run_evaluate(w, layout, schedule)
            result = None
        else:
            result, candidates = run_search(w, SearchSpace(), args.top)
            print(table(candidates))
            print(f"best: {layout_text(candidates[0].layout)}, {candidates[0].schedule} schedule\n"
                  f"  {stage_text(candidates[0])}")
            sim = simulate_layout(w, candidates[0].layout, candidates[0].assignment, candidates[0].schedule)
            print(f"  event-driven simulator on the best: step {sim.step_time:.3f} s, bubble "
                  f"{100 * sim.result.bubble_ratio:.1f}%, peak memory {max(sim.memory_per_stage) / GIB:.1f} GiB")
        if args.png and result is not None:
            plot(result, candidates, w, args.png)
            print(f"wrote {args.png}")
        if args.write:
            if not candidates:
                raise PlanError("--write: nothing to write, no layout fits")
            check_writable("--write", w, candidates[0].layout, candidates[0].schedule)
            write_recipe(args.write, recipe_path, candidates[0], w, command)
            print(f"wrote {args.write}")
        if args.export_mindformers:
            write_mindformers(args.export_mindformers, recipe, w, layout, schedule, command)
            print(f"wrote MindFormers' pipeline keys to {args.export_mindformers}")
    except (InputError, OSError) as e:
        print(f"telechat_moe.plan: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
