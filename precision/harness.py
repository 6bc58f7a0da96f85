"""The alignment harness: run one training step two ways, dump both, and find where they part.

A step is any callable that computes one training step and returns its named tensors (TensorRecords: forward
outputs per layer, loss, gradients, optimizer states). The harness knows nothing of the model: the reference
and the variant (an emulated parallel layout, another dtype, fusion on, a real multi-process run that dumped
to a directory) are given as callables or as dump directories.

    report = align(reference_step, variant_step, workdir, meta_a, meta_b)
    change, report = first_diverging_change(make_step, ["tp=2", "sp", "ep=2"], workdir, meta_for)

`first_diverging_change` applies the changes between two settings one at a time, in order, and stops at the
first one after which the run no longer matches the reference: when a new setting diverges, this names the
change to look at.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Sequence, Union

from precision.compare import CompareReport, compare_runs
from precision.dump import DumpWriter, TensorRecord

Step = Callable[[], Sequence[TensorRecord]]
StepOrDump = Union[Step, str, Path]


def dump_step(step: Step, root, meta: Mapping, step_number: int = 0, rank: int = 0) -> Path:
    """Run `step` once and dump its records to `root`."""
    DumpWriter(root, meta, rank=rank).write(step_number, step())
    return Path(root)


def align(reference: StepOrDump, variant: StepOrDump, workdir, meta_a: Mapping, meta_b: Mapping,
          step_number: int = 0, rtol_scale: float = 1.0, rank: int = 0) -> CompareReport:
    """Dump the reference and the variant (running whichever is a callable) and compare them."""
    workdir = Path(workdir)
    roots = []
    for label, run, meta in (("reference", reference, meta_a), ("variant", variant, meta_b)):
        roots.append(dump_step(run, workdir / label, meta, step_number) if callable(run) else Path(run))
    return compare_runs(roots[0], roots[1], rank=rank, rtol_scale=rtol_scale)


def first_diverging_change(make_step: Callable[[Sequence[str]], Step], changes: Sequence[str], workdir,
                           meta_for: Callable[[Sequence[str]], Mapping]) -> tuple[str | None, CompareReport | None]:
    """Apply `changes` cumulatively to the reference setting (make_step(()) ) and return the first change whose
    run diverges from the reference, with that comparison; (None, None) when all of them agree."""
    workdir = Path(workdir)
    reference = dump_step(make_step(()), workdir / "reference", meta_for(()))
    for i, change in enumerate(changes):
        applied = tuple(changes[:i + 1])
        variant = dump_step(make_step(applied), workdir / f"change_{i}", meta_for(applied))
        report = compare_runs(reference, variant)
        if report.first is not None:
            return change, report
    return None, None
