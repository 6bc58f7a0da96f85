"""Parallel layouts against one process over a whole run: the same recipe trained by one process and by each layout
under msrun on this machine, their losses side by side, step by step.

Per layout: every step's loss, lm_loss and gradient norm against the one-process run's, as a relative error over
precision/'s float32 chain tolerance for that many steps (a step's error may grow with the steps before it: each
step's update feeds the next); the held-out loss at the end; and `precision.compare` on both runs' tensor dumps at
step 1 (the first step must agree tensor by tensor) and at the last step N with every tolerance times N, the errors
N updates carry (reported, not required: after tens of steps a router score tie may fall the other way when a layout
sums in another order, which the compare names).
With `--control`, one-process runs that differ from the reference only at rounding level (another attention kernel,
the initial weights moved by at most one ulp: `model.initializer_range=0.020000002` for tiny's 0.02) measure where
rounding alone takes the run (a router's discrete decision tipped the other way parts two runs for good); each
layout's error is then also reported against that rounding envelope (precision/envelope.py: the chain tolerance
plus the controls' largest error up to each step) and, against the chain tolerance, from the control it follows
closest, and `precision.compare` runs at the last step against that control (tolerances x N; a control's model
configuration may hash differently, as the one-ulp initializer does); the exit status asks the envelope instead of
the chain tolerance alone.
The second run reads the first one's tokenizer, so both see the same token ids. Runs go one at a time through the
tests' machine-wide msrun lock.

A layout is a quoted list of tokens: dpN, tpN (model_parallel), ppN, vppN (pp_interleave_num), epN, etpN
(expert_model_parallel), cpN (context_parallel), mN (micro_batch_num), sp (use_seq_parallel), hier (the hierarchical
dispatcher, 2 devices a node), or any recipe assignment key=value:

    .venv/bin/python -m bench.layout_agreement --steps 30 --layout "dp2" --layout "dp2 ep2" --layout "pp2 dp2 m4" \\
        [--recipe tiny] [--set parallel_config.optimizer_shard=true] [--out DIR] [--markdown FILE]
"""
from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from oneline import OneLineParser
from precision.compare import compare_runs, first_divergence_text
from precision.envelope import rounding_envelope
from precision.tolerance import chain_tolerance, relative_error
from tests.helpers import msrun, run_cli

KEYS = {"dp": "parallel_config.data_parallel", "tp": "parallel_config.model_parallel",
        "pp": "parallel_config.pipeline_stage", "vpp": "parallel_config.pp_interleave_num",
        "ep": "parallel_config.expert_parallel", "etp": "parallel_config.expert_model_parallel",
        "cp": "parallel_config.context_parallel", "m": "parallel_config.micro_batch_num"}
FLAGS = {"sp": ["parallel_config.use_seq_parallel=true"],
         "hier": ["model.moe_token_dispatcher_type=hierarchical", "parallel_config.devices_per_node=2"]}
# The degrees whose product is the number of processes (ep and etp split ranks that dp and tp already count).
WORLD = ("dp", "tp", "pp", "cp")
COMPARED = ("loss", "lm_loss", "grad_norm")


@dataclass
class Layout:
    name: str
    assignments: list[str]
    world: int


@dataclass
class RunResult:
    """One run's logged records: step -> {loss, lm_loss, grad_norm, ...}, and its held-out loss."""
    steps: dict[int, dict]
    held_out: float


@dataclass
class Agreement:
    layout: Layout
    run: RunResult
    worst_over_tolerance: float          # max over steps and COMPARED of relative error / the step's tolerance
    worst_step: int
    held_out_error: float
    worst_over_envelope: float           # likewise against the rounding envelope (the tolerance without --control)
    worst_envelope_step: int
    nearest: tuple[str, float, int] | None   # the control it follows closest: (name, worst error / tolerance, step)
    first_step: list[str] = field(default_factory=list)   # precision.compare's verdict at step 1
    last_step: list[str] = field(default_factory=list)
    nearest_last_step: list[str] = field(default_factory=list)   # ... at the last step against the nearest control


def parse_layout(text: str) -> Layout:
    """'pp2 dp2 m4 sp' -> the recipe assignments and the process count; a bad token is a usage error."""
    assignments, degrees = [], {}
    for token in text.split():
        if "=" in token:
            assignments.append(token)
        elif token in FLAGS:
            assignments += FLAGS[token]
        else:
            head = token.rstrip("0123456789")
            if head not in KEYS or head == token:
                raise ValueError(f"--layout: unknown token {token!r} in {text!r} (dpN tpN ppN vppN epN etpN cpN mN "
                                 f"sp hier or key=value)")
            degrees[head] = int(token[len(head):])
            assignments.append(f"{KEYS[head]}={degrees[head]}")
    return Layout(text, assignments, math.prod(degrees.get(k, 1) for k in WORLD))


def read_run(out: Path) -> RunResult:
    steps, held_out = {}, math.nan
    for line in (out / "logs" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            steps[record["step"]] = record
        if "eval_lm_loss" in record:
            held_out = record["eval_lm_loss"]
    return RunResult(steps, held_out)


def trained_with(out: Path, recipe: str, assignments: list[str]) -> bool:
    """Whether the run in `out` is this recipe with exactly these assignments: its resolved recipe (logs/recipe.yaml)
    equals the one they resolve to here. A folder of another layout or other settings is not this run, whatever its
    position in the bench's list was, also where it holds every one of these assignments and more (pp2 tp2 m4's
    folder holds pp2 m4's)."""
    from telechat_moe.recipe import load_recipe
    try:
        resolved = yaml.safe_load((out / "logs" / "recipe.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    return resolved == yaml.safe_load(yaml.safe_dump(load_recipe(recipe, assignments).to_dict(), sort_keys=False))


def finished(out: Path, steps: int, recipe: str, assignments: list[str]) -> bool:
    """A run in `out` of these assignments that logged every step and its held-out loss (an interrupted bench's runs
    that need no rerun)."""
    try:
        run = read_run(out)
    except (OSError, ValueError):
        return False
    return len(run.steps) == steps and not math.isnan(run.held_out) and (out / "dump").is_dir() and \
        trained_with(out, recipe, assignments)


def train(layout: Layout, common: list[str], out: Path, tokenizer: Path | None, reuse: bool, steps: int) -> RunResult:
    assignments = [*common[1:], *layout.assignments, f"output_dir={out}"] + (
        [f"data.tokenizer={tokenizer}"] if tokenizer else [])
    if reuse and finished(out, steps, common[0], assignments):
        print(f"[agreement] {layout.name or 'one process'}: reusing {out}", flush=True)
        return read_run(out)
    args = ["run_train.py", "--recipe", common[0]]
    for assignment in assignments:
        args += ["--set", assignment]
    print(f"[agreement] {layout.name or 'one process'}: {layout.world} process(es) ...", flush=True)
    if layout.world == 1:
        proc = run_cli(*args, timeout=3600)
        logs = proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        proc, logs = msrun(layout.world, out.parent / f"{out.name}_logs", *args, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"bench.layout_agreement: {layout.name or 'one process'} failed (exit {proc.returncode}):"
                         f"\n{logs}")
    return read_run(out)


def tokens_per_step(recipe: str, sets: list[str]) -> int:
    from telechat_moe.recipe import load_recipe
    r = load_recipe(recipe, sets)
    return r.training.global_batch_size * r.model.seq_length


def worst_ratio(one: RunResult, run: RunResult, bound: dict) -> tuple[float, int]:
    """(max over steps and COMPARED of the relative error over bound[key][step], the step)."""
    worst, worst_step = 0.0, 0
    for step, base in one.steps.items():
        for key in COMPARED:
            ratio = relative_error(run.steps[step][key], base[key]) / bound[key][step]
            if ratio > worst:
                worst, worst_step = ratio, step
    return worst, worst_step


def agree(layout: Layout, one: RunResult, run: RunResult, tokens: int, one_dir: Path, out: Path,
          controls: list[tuple[Layout, RunResult]], control_dirs: list[Path]) -> Agreement:
    chain = {step: chain_tolerance("float32", [tokens] * step).rtol for step in one.steps}
    envelope = {key: rounding_envelope({s: r[key] for s, r in one.steps.items()},
                                       [{s: r[key] for s, r in c.steps.items()} for _, c in controls], chain)
                for key in COMPARED}
    bound = {key: chain for key in COMPARED}
    nearest = min(((c.name, *worst_ratio(control, run, bound), d) for (c, control), d in zip(controls, control_dirs)),
                  key=lambda x: x[1], default=None)
    last = max(one.steps)
    # the run it follows closest, tensor by tensor at the last step: the dumps say whether the whole state (every
    # weight's gradient and Adam moment), not only the logged losses, stayed within rounding of that control
    nearest_last = first_divergence_text(compare_runs(nearest[3] / "dump", out / "dump", step=last, rtol_scale=last,
                                                      same_model=False)) if nearest else []
    return Agreement(layout, run, *worst_ratio(one, run, bound), relative_error(run.held_out, one.held_out),
                     *worst_ratio(one, run, envelope), nearest[:3] if nearest else None,
                     first_divergence_text(compare_runs(one_dir / "dump", out / "dump", step=1)),
                     first_divergence_text(compare_runs(one_dir / "dump", out / "dump", step=last, rtol_scale=last)),
                     nearest_last)


def table(one: RunResult, results: list[Agreement], controls: list[tuple[Layout, RunResult]]) -> list[str]:
    """Markdown: the loss of every step, one column per run (the controls' marked), then the summary rows."""
    runs = [(f"control: {layout.name}", run) for layout, run in controls] + [(a.layout.name, a.run) for a in results]
    lines = ["| step | one process | " + " | ".join(name for name, _ in runs) + " |", "|" + " --- |" * (2 + len(runs))]

    def row(label, cells):
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for step in sorted(one.steps):
        row(step, [f"{one.steps[step]['loss']:.6f}"] + [f"{run.steps[step]['loss']:.6f}" for _, run in runs])
    row("held-out", [f"{one.held_out:.6f}"] + [f"{run.held_out:.6f}" for _, run in runs])
    blank = ["-"] * (1 + len(controls))
    row("worst error / tolerance (step)", blank + [f"{a.worst_over_tolerance:.3f} ({a.worst_step})" for a in results])
    if controls:
        row("worst error / rounding envelope (step)",
            blank + [f"{a.worst_over_envelope:.3f} ({a.worst_envelope_step})" for a in results])
        row("worst error / tolerance from the nearest control (step, control)",
            blank + [f"{a.nearest[1]:.3f} ({a.nearest[2]}, {a.nearest[0]})" for a in results])
    row("compare at step 1", blank + [a.first_step[0].split(":")[0] for a in results])
    return lines


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m bench.layout_agreement", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layout", action="append", required=True, help="e.g. 'dp2 ep2' (repeatable)")
    ap.add_argument("--control", action="append", default=[], help="a one-process run differing from the reference "
                    "only at rounding level, e.g. 'model.attention_kernel=dense' (repeatable): the rounding envelope")
    ap.add_argument("--set", action="append", default=[], help="a recipe assignment for every run (repeatable)")
    ap.add_argument("--out", help="keep the runs here (default: a temporary folder, removed)")
    ap.add_argument("--markdown", help="also write the table to this file")
    ap.add_argument("--reuse", action="store_true", help="keep the runs in --out that finished (same tree and "
                    "options assumed: for an interrupted bench), train the rest")
    args = ap.parse_args(argv)
    try:
        layouts = [parse_layout(text) for text in args.layout]
        control_layouts = [parse_layout(text) for text in args.control]
    except ValueError as error:
        ap.error(str(error))
    if any(c.world != 1 for c in control_layouts):
        ap.error("--control: expected one-process runs (recipe assignments, no parallel degree)")
    if args.reuse and not args.out:
        ap.error("--reuse: needs --out, the folder of the runs to keep")
    common = [args.recipe, f"training.train_steps={args.steps}", f"training.dump_steps=1,{args.steps}",
              "training.log_interval=1", f"training.eval_interval={args.steps}",
              "training.save_interval=0", *args.set]
    root = Path(args.out or tempfile.mkdtemp(prefix="layout_agreement."))
    try:
        one_dir = root / "one"
        one = train(Layout("", [], 1), common, one_dir, None, args.reuse, args.steps)
        tokens = tokens_per_step(args.recipe, common[1:])
        control_dirs = [root / f"control{i}" for i in range(len(control_layouts))]
        controls = [(c, train(c, common, d, one_dir / "tokenizer.model", args.reuse, args.steps))
                    for c, d in zip(control_layouts, control_dirs)]
        results = []
        for i, layout in enumerate(layouts):
            out = root / f"layout{i}"
            results.append(agree(layout, one, train(layout, common, out, one_dir / "tokenizer.model", args.reuse,
                                                   args.steps), tokens,
                                 one_dir, out, controls, control_dirs))
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    lines = [f"{args.recipe}, {args.steps} steps, every run with: {' '.join(args.set) or '(recipe as written)'}", "",
             *table(one, results, controls), ""]
    for a in results:
        lines += [f"{a.layout.name} ({a.layout.world} processes): held-out relative error {a.held_out_error:.2e}",
                  *(f"  step 1: {line}" for line in a.first_step),
                  *(f"  step {args.steps} (tolerances x {args.steps}): {line}" for line in a.last_step),
                  *(f"  step {args.steps} against the nearest control, {a.nearest[0]} (tolerances x {args.steps}): "
                    f"{line}" for line in a.nearest_last_step)]
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0 if all(a.first_step[0].startswith("no divergence") and a.worst_over_envelope <= 1 for a in results) \
        else 1


if __name__ == "__main__":
    raise SystemExit(main())
