"""Compare two tensor dumps and find the first tensor that diverges.

    python -m precision.compare RUN_A RUN_B [--rank 0] [--step N] [--rtol-scale 1] [--png FILE] [--all]

Tensors are aligned by name and walked in computation order: forward outputs in forward order, the loss,
gradients in backward order (reverse of the order they were dumped in), then optimizer states. Each tensor's
tolerance is the chain tolerance of the computation that produced it: the layers upstream of it in the forward,
and for gradients the whole forward, the loss and the backward from the loss down to their layer; never the
number of tensors dumped (precision/TOLERANCES.md). The first tensor over its tolerance is reported with its
layer, operator and the parallel-risk category that its error signature and the two runs' layouts point to
(precision/signatures.py; "inconclusive" where they do not decide), then a summary table per kind and layer,
and a PNG of the per-layer relative error. Exit status: 0 no divergence, 1 a divergence, 2 runs that cannot
be compared (missing tensors, shape mismatches, different models, unreadable dumps), with a one-line message.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from oneline import OneLineParser
from precision.dump import DumpError, DumpRun, IndexEntry, open_run
from precision.signatures import NUMERIC_FACTOR, Diagnosis, diagnose
from precision.tolerance import UNIT_ROUNDOFF, mean_relative_error, relative_error, tolerance

WALK = ("forward", "loss", "grad", "optimizer")


class CompareError(DumpError):
    """Two runs that cannot be compared; one line that says why."""


@dataclass(frozen=True)
class TensorComparison:
    entry: IndexEntry
    max_rel_error: float
    mean_rel_error: float
    rtol: float

    @property
    def diverged(self) -> bool:
        return not self.max_rel_error <= self.rtol


@dataclass
class CompareReport:
    run_a: str
    run_b: str
    rank: int
    step: int
    steps_compared: list[int]
    rows: list[TensorComparison] = field(default_factory=list)
    first: TensorComparison | None = None
    diagnosis: Diagnosis | None = None
    # the first tensor of that step beyond NUMERIC_FACTOR tolerances, where it is not `first`: a small concentrated
    # difference (a few Adam-normalised elements) can come before the difference that changes the run (a routing
    # tie), and each has its own cause
    gross: TensorComparison | None = None
    gross_diagnosis: Diagnosis | None = None


def walk_order(entries: Sequence[IndexEntry]) -> list[IndexEntry]:
    """Computation order: forward, loss, gradients backwards (they are dumped in parameter order), optimizer."""
    by_kind = {kind: sorted((e for e in entries if e.kind == kind), key=lambda e: e.order) for kind in WALK}
    by_kind["grad"].reverse()
    return [e for kind in WALK for e in by_kind[kind]]


def outside_layers_first(entries: Sequence[IndexEntry]) -> Callable[[IndexEntry], bool]:
    """A test telling whether a tensor outside the decoder layers (layer None) comes before them (embedding) or
    after them (final norm, head, MTP). Tensors of one kind are dumped in forward or parameter order, and the
    optimizer's one state after another, so each is placed by its order against the first layered tensor of
    its kind and operator (of its kind, when none of its operator is layered)."""
    first: dict = {}
    for e in entries:
        if e.layer is not None:
            for key in ((e.kind, e.operator), e.kind):
                first[key] = min(first.get(key, e.order), e.order)
    return lambda e: e.order < first.get((e.kind, e.operator), first.get(e.kind, -1))


def depth_chains(walk: Sequence[IndexEntry], terms: Sequence[float]) -> list[float]:
    """Each tensor's chain tolerance along the computation that produced it. `walk` is in walk order, `terms[i]`
    the tolerance of the operator that produced walk[i] (tolerance(dtype, k)).

    The forward tensors fall into stages, runs of consecutive tensors of one layer (the embedding, each layer,
    the final norm and head), and a stage costs the sum of its tensors' terms. A forward tensor's chain: the
    stages before its own, plus its own stage up to and including it. The loss: the whole forward F plus its own
    term. A gradient of a parameter in stage s: F, the largest loss term, the backward from the loss down to s
    (the stages s..last again: a layer's backward runs the transposes of its forward operators) and its own
    term; tensors of other layers' gradients are beside it, not upstream, and add nothing. An optimizer state is
    at most quadratic in its gradient (Adam's second moment doubles the gradient's relative error): twice its
    gradient's chain."""
    chains = [0.0] * len(walk)
    costs: list[float] = []
    stage_of_layer: dict[int, int] = {}
    last_layered = -1
    for i, (e, term) in enumerate(zip(walk, terms)):
        if e.kind != "forward":
            continue
        if not costs or e.layer != walk[i - 1].layer:
            costs.append(0.0)
            if e.layer is not None:
                stage_of_layer.setdefault(e.layer, len(costs) - 1)
                last_layered = len(costs) - 1
        costs[-1] += term
        chains[i] = sum(costs)
    forward = sum(costs)
    loss = max((t for e, t in zip(walk, terms) if e.kind == "loss"), default=0.0)
    before_layers = outside_layers_first(walk)
    for i, (e, term) in enumerate(zip(walk, terms)):
        if e.kind == "loss":
            chains[i] = forward + term
        elif e.kind in ("grad", "optimizer"):
            # a layer the forward did not dump, or a parameter before the layers: the whole backward
            stage = stage_of_layer.get(e.layer, 0) if e.layer is not None else \
                0 if before_layers(e) else last_layered + 1
            gradient = forward + loss + sum(costs[stage:]) + term
            chains[i] = gradient if e.kind == "grad" else 2 * gradient
    return chains


def _looser_dtype(a: str, b: str) -> str | None:
    """The less precise float format of the two; None when either is not floating point (compare exactly)."""
    names = [d for d in (a, b) if d in UNIT_ROUNDOFF]
    if len(names) < 2:
        return None
    return max(names, key=lambda d: UNIT_ROUNDOFF[d])


def _check_comparable(run_a: DumpRun, run_b: DumpRun) -> None:
    hash_a, hash_b = run_a.meta.get("model_config_hash"), run_b.meta.get("model_config_hash")
    if hash_a and hash_b and hash_a != hash_b:
        raise CompareError(f"runs are of different models: model_config_hash {hash_a} ({run_a.root}) != "
                           f"{hash_b} ({run_b.root})")


def _align(run_a: DumpRun, run_b: DumpRun, step: int, rank: int) -> list[tuple[IndexEntry, IndexEntry]]:
    for run in (run_a, run_b):
        if rank not in run.index[step]:
            raise CompareError(f"{run.root}: no dump of rank {rank} at step {step} (ranks {run.ranks(step)})")
    a = {e.name: e for e in run_a.entries(step, rank)}
    b = {e.name: e for e in run_b.entries(step, rank)}
    for here, there, where in ((a, b, run_b.root), (b, a, run_a.root)):
        missing = [n for n in here if n not in there]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CompareError(f"tensor {missing[0]!r} of step {step} is missing from {where}{more}")
    for name, ea in a.items():
        eb = b[name]
        if ea.shape != eb.shape:
            raise CompareError(f"tensor {name!r} of step {step}: shape {list(ea.shape)} in {run_a.root} vs "
                               f"{list(eb.shape)} in {run_b.root}")
        if ea.kind != eb.kind:
            raise CompareError(f"tensor {name!r} of step {step}: kind {ea.kind} in {run_a.root} vs {eb.kind} in "
                               f"{run_b.root}")
    return [(ea, b[ea.name]) for ea in walk_order(list(a.values()))]


def _compare_step(run_a: DumpRun, run_b: DumpRun, step: int, rank: int, rtol_scale: float):
    """Rows in walk order, and the two values of the first diverging tensor and of the first one beyond
    NUMERIC_FACTOR tolerances (kept for their diagnoses)."""
    rows: list[TensorComparison] = []
    first_values: tuple[np.ndarray, np.ndarray] | None = None
    gross_values: tuple[np.ndarray, np.ndarray] | None = None
    pairs = _align(run_a, run_b, step, rank)
    dtypes = [_looser_dtype(ea.dtype, eb.dtype) for ea, eb in pairs]
    terms = [0.0 if dtype is None else tolerance(dtype, ea.k).rtol for (ea, _), dtype in zip(pairs, dtypes)]
    chains = depth_chains([ea for ea, _ in pairs], terms)
    for (ea, eb), dtype, chain in zip(pairs, dtypes, chains):
        a, b = run_a.load(ea), run_b.load(eb)
        rtol = 0.0 if dtype is None else chain * rtol_scale
        rows.append(TensorComparison(ea, relative_error(b, a), mean_relative_error(b, a), rtol))
        if rows[-1].diverged and first_values is None:
            first_values = (a, b)
        if _gross(rows[-1]) and gross_values is None:
            gross_values = (a, b)
    return rows, first_values, gross_values


def _gross(row: TensorComparison) -> bool:
    return row.diverged and not row.max_rel_error <= NUMERIC_FACTOR * row.rtol


def _replicas(run: DumpRun, step: int, rank: int, entry: IndexEntry) -> dict[int, np.ndarray]:
    replicas = {}
    for other in run.ranks(step):
        if other == rank:
            continue
        match = [e for e in run.entries(step, other) if e.name == entry.name]
        if match:
            replicas[other] = run.load(match[0])
    return replicas


def compare_runs(dir_a, dir_b, rank: int = 0, step: int | None = None, rtol_scale: float = 1.0,
                 same_model: bool = True) -> CompareReport:
    """Compare every step both runs dumped (or `step`); report the first divergence of the earliest step.
    `same_model=False` compares runs whose model configurations differ (a control run whose initial weights were
    moved by one ulp through the initializer's range hashes as another model)."""
    run_a, run_b = open_run(dir_a), open_run(dir_b)
    if same_model:
        _check_comparable(run_a, run_b)
    common = sorted(set(run_a.steps) & set(run_b.steps))
    if step is not None:
        if step not in common:
            raise CompareError(f"--step {step}: not dumped by both runs (A: {run_a.steps}, B: {run_b.steps})")
        common = [step]
    if not common:
        raise CompareError(f"no step was dumped by both runs (A: {run_a.steps}, B: {run_b.steps})")
    report = CompareReport(str(dir_a), str(dir_b), rank, common[-1], common)
    for current in common:
        rows, first_values, gross_values = _compare_step(run_a, run_b, current, rank, rtol_scale)
        first = next((r for r in rows if r.diverged), None)
        report.rows, report.step = rows, current
        if first is None:
            continue
        layouts = [run_a.meta.get("layout", {}), run_b.meta.get("layout", {})]

        def diagnosis(row: TensorComparison, values) -> Diagnosis:
            forward_clean = row.entry.kind in ("grad", "optimizer")  # the walk puts forward and loss first
            replicas = _replicas(run_b, current, rank, row.entry) if row.entry.kind == "grad" else None
            return diagnose(row.entry.name, row.entry.kind, row.entry.operator, row.entry.dims, *values, row.rtol,
                            layouts, forward_clean, replicas)
        report.first, report.diagnosis = first, diagnosis(first, first_values)
        gross = next((r for r in rows if _gross(r)), None)
        if gross is not None and gross is not first:
            report.gross, report.gross_diagnosis = gross, diagnosis(gross, gross_values)
        break
    return report


# ---- reporting ----------------------------------------------------------------------------------------
def _layer_text(layer) -> str:
    return "-" if layer is None else str(layer)


def summary_table(report: CompareReport, every_tensor: bool = False) -> list[str]:
    lines = [f"{'kind':<9} {'layer':>5} {'tensors':>7} {'max rel err':>11} {'rtol':>9} {'err/rtol':>9}  "
             f"{'worst tensor':<44} status"]
    if every_tensor:
        groups = [[r] for r in report.rows]
    else:
        keyed: dict[tuple, list[TensorComparison]] = {}
        for r in report.rows:
            keyed.setdefault((r.entry.kind, r.entry.layer), []).append(r)
        groups = list(keyed.values())
    for group in groups:
        worst = max(group, key=lambda r: r.max_rel_error / r.rtol if r.rtol else
                    (np.inf if r.max_rel_error else 0.0))
        ratio = worst.max_rel_error / worst.rtol if worst.rtol else (0.0 if not worst.max_rel_error else np.inf)
        status = "DIVERGED" if any(r.diverged for r in group) else "ok"
        lines.append(f"{worst.entry.kind:<9} {_layer_text(worst.entry.layer):>5} {len(group):>7} "
                     f"{worst.max_rel_error:11.3e} {worst.rtol:9.2e} {ratio:9.3g}  {worst.entry.name[:44]:<44} "
                     f"{status}")
    return lines


def first_divergence_text(report: CompareReport) -> list[str]:
    if report.first is None:
        return [f"no divergence: {len(report.rows)} tensors within tolerance at steps {report.steps_compared} "
                f"(rank {report.rank})"]
    e = report.first.entry
    lines = [f"first divergence: step {e.step}, rank {report.rank}, {e.kind} tensor {e.name!r}",
             f"  layer {_layer_text(e.layer)}, operator {e.operator or '-'}, shape {list(e.shape)}, dtype {e.dtype}",
             f"  max rel err {report.first.max_rel_error:.3e} vs rtol {report.first.rtol:.2e}, "
             f"mean rel err {report.first.mean_rel_error:.3e}"]
    if report.diagnosis:
        lines += [f"  category: {report.diagnosis.risk.value}", f"  evidence: {report.diagnosis.evidence}"]
    if report.gross is not None:
        g = report.gross
        lines += [f"first divergence beyond {NUMERIC_FACTOR:g} tolerances: {g.entry.kind} tensor {g.entry.name!r}, "
                  f"layer {_layer_text(g.entry.layer)}, max rel err {g.max_rel_error:.3e} vs rtol {g.rtol:.2e}",
                  f"  category: {report.gross_diagnosis.risk.value}",
                  f"  evidence: {report.gross_diagnosis.evidence}"]
    return lines


def plot_layer_errors(report: CompareReport, path) -> Path:
    """PNG of the worst relative error per layer for each kind, beside its tolerance."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    # Tensors outside the decoder layers sit at -1 when they come before layer 0 (embedding) and one past the
    # last layer when they come after it (final norm, head).
    last_layer = max((r.entry.layer for r in report.rows if r.entry.layer is not None), default=-1)
    before_layers = outside_layers_first([r.entry for r in report.rows])

    def position(entry):
        if entry.layer is not None:
            return entry.layer
        return -1 if before_layers(entry) else last_layer + 1

    fig, ax = plt.subplots(figsize=(8, 5))
    # exact agreement (error 0) is drawn on a floor three decades under the smallest tolerance
    floor = 1e-3 * min([r.rtol for r in report.rows if r.rtol > 0] or [1e-6])
    for kind, color in zip(WALK, ("tab:blue", "tab:purple", "tab:orange", "tab:green")):
        rows = [r for r in report.rows if r.entry.kind == kind]
        if not rows:
            continue
        xs = sorted({position(r.entry) for r in rows})
        err = [max(max(r.max_rel_error, floor) for r in rows if position(r.entry) == x) for x in xs]
        tol = [max(r.rtol for r in rows if position(r.entry) == x) for x in xs]
        ax.plot(xs, err, "o-", color=color, label=f"{kind} max rel err")
        ax.plot(xs, tol, "--", color=color, alpha=0.5, label=f"{kind} tolerance")
    if report.first:
        e = report.first.entry
        ax.plot([position(e)], [max(report.first.max_rel_error, floor)], "r*", markersize=16,
                label="first divergence")
        risk = report.diagnosis.risk.name if report.diagnosis else ""
        title = f"first divergence: {e.name} ({risk})"
    else:
        title = "no divergence"
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"layer (-1: before layer 0, {last_layer + 1}: after the last layer; "
                  f"errors of 0 sit on the bottom line)")
    ax.set_ylabel("max relative error, B vs A")
    ax.set_title(f"step {report.step}: {title}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _divergence_json(row: TensorComparison | None, diagnosis: Diagnosis | None) -> dict | None:
    return None if row is None else {
        "name": row.entry.name, "kind": row.entry.kind, "layer": row.entry.layer, "operator": row.entry.operator,
        "max_rel_error": row.max_rel_error, "rtol": row.rtol,
        "category": diagnosis.risk.name if diagnosis else None, "evidence": diagnosis.evidence if diagnosis else None}


def report_json(report: CompareReport) -> dict:
    return {
        "run_a": report.run_a, "run_b": report.run_b, "rank": report.rank, "step": report.step,
        "steps_compared": report.steps_compared,
        "first_divergence": _divergence_json(report.first, report.diagnosis),
        "first_gross_divergence": _divergence_json(report.gross, report.gross_diagnosis),
        "tensors": [{"name": r.entry.name, "kind": r.entry.kind, "layer": r.entry.layer,
                     "max_rel_error": r.max_rel_error, "rtol": r.rtol, "diverged": r.diverged}
                    for r in report.rows],
    }


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m precision.compare", description=__doc__.split("\n")[0])
    parser.add_argument("run_a", help="dump directory of the reference run")
    parser.add_argument("run_b", help="dump directory of the run to check")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--step", type=int)
    parser.add_argument("--rtol-scale", type=float, default=1.0, help="widen (>1) or tighten every tolerance")
    parser.add_argument("--png", default="precision_compare.png", help="per-layer error plot ('' for none)")
    parser.add_argument("--json", help="also write the report as JSON")
    parser.add_argument("--all", action="store_true", help="one table row per tensor, not per kind and layer")
    args = parser.parse_args(argv)
    if not args.rtol_scale > 0:
        print(f"precision.compare: --rtol-scale: expected a positive number, got {args.rtol_scale}",
              file=sys.stderr)
        return 2
    try:
        report = compare_runs(args.run_a, args.run_b, args.rank, args.step, args.rtol_scale)
    except DumpError as error:
        print(f"precision.compare: {error}", file=sys.stderr)
        return 2
    print("\n".join(summary_table(report, args.all)))
    print("\n".join(first_divergence_text(report)))
    if args.png:
        print(f"plot: {plot_layer_errors(report, args.png)}")
    if args.json:
        Path(args.json).write_text(json.dumps(report_json(report), indent=1), encoding="utf-8")
    return 1 if report.first else 0


if __name__ == "__main__":
    sys.exit(main())
