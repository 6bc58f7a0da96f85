"""What the planner shows and writes: the ranked table, the step-time-vs-memory picture, a recipe with the pick."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import yaml

from parallel.layout import RECOMPUTE, ParallelLayout
from parallel.planner.refine import Candidate
from parallel.planner.search import SearchResult
from parallel.planner.workload import Workload

GIB = 2 ** 30
# column -> ParallelLayout field
COLUMNS = {"tp": "tp", "pp": "pp", "vpp": "vpp", "dp": "dp", "ep": "ep", "etp": "etp", "mbs": "micro_batch_size",
           "m": "micro_batch_num", "cp": "cp"}


def layout_text(layout: ParallelLayout) -> str:
    parts = [f"{k}={getattr(layout, name)}" for k, name in COLUMNS.items()]
    return ",".join(parts + [f"recompute={layout.recompute}", f"ep_scheme={layout.ep_scheme}",
                             f"ep_overlap={int(layout.ep_overlap)}"])


def table(candidates: list[Candidate]) -> str:
    head = (f"{'#':>3} " + " ".join(f"{c:>4}" for c in COLUMNS) + f" {'recompute':>9} {'ep comm':>12} {'ovl':>3}"
            f" {'schedule':>11} {'step s':>8} {'tok/s/dev':>9} {'MFU':>6} {'mem GiB':>8} {'bubble':>6}")
    lines = [head]
    for i, c in enumerate(candidates, 1):
        lay, sc = c.layout, c.scores
        lines.append(f"{i:>3} " + " ".join(f"{getattr(lay, name):>4}" for name in COLUMNS.values())
                     + f" {lay.recompute:>9} {lay.ep_scheme:>12} {int(lay.ep_overlap):>3}"
                     f" {c.schedule:>11} {sc['step_time']:>8.3f} {sc['tokens_per_s_per_device']:>9.1f}"
                     f" {100 * sc['mfu']:>5.1f}%"
                     f" {sc['memory'] / GIB:>8.1f} {100 * sc['bubble']:>5.1f}%")
    return "\n".join(lines)


def stage_text(c: Candidate) -> str:
    a = c.assignment
    return (f"layers per stage {a.layers_per_stage} (per chunk {a.layers_per_chunk}); full recompute per stage {a.recompute_per_stage(2)}; "
            f"selective per stage {a.recompute_per_stage(1)}; memory per stage (GiB) "
            f"{[round(m / GIB, 1) for m in c.scores['memory_per_stage']]}")


def plot(result: SearchResult, candidates: list[Candidate], w: Workload, path: str,
         max_points: int = 60_000) -> None:
    """Step time against peak memory per device for every scored layout (a sample when there are many)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sc = result.scores
    idx = np.arange(result.scored)
    if idx.size > max_points:
        idx = np.random.default_rng(0).choice(idx, max_points, replace=False)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    fits = sc["fits"][idx].astype(bool)
    ax.scatter(sc["memory"][idx][~fits] / GIB, sc["step_time"][idx][~fits], s=2, c="lightgrey",
               label="does not fit", rasterized=True)
    ax.scatter(sc["memory"][idx][fits] / GIB, sc["step_time"][idx][fits], s=2, c="tab:blue", alpha=0.5,
               label="fits (even split, uniform recompute)", rasterized=True)
    if candidates:
        ax.scatter([c.scores["memory"] / GIB for c in candidates], [c.scores["step_time"] for c in candidates],
                   s=30, c="tab:orange", edgecolor="black", label="top, ILP-balanced", zorder=3)
        best = candidates[0]
        ax.scatter([best.scores["memory"] / GIB], [best.scores["step_time"]], s=160, marker="*", c="red",
                   edgecolor="black", zorder=4, label="pick")
    ax.axvline(w.cluster.usable_memory / GIB, color="red", linestyle="--", linewidth=1, label="usable memory")
    ax.set_yscale("log")
    ax.set_xscale("log")
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"{result.scored:,} layouts, {w.devices} x {w.cluster.name}, seq {w.seq_length}, "
                 f"global batch {w.global_batch}", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def written_recompute(c: Candidate) -> str:
    """The one recompute mode a recipe holds for the pick (the trainer recomputes every layer alike; the ILP may
    have chosen per stage): the most any of its layers was priced with, so that every stage fits."""
    counts = [sum(c.assignment.recompute_per_stage(mode)) for mode in range(len(RECOMPUTE))]
    return RECOMPUTE[max(mode for mode, n in enumerate(counts) if n or mode == 0)]


def recipe_overrides(c: Candidate, w: Workload) -> dict:
    """The recipe sections that the pick changes, in the recipe's own key names: every knob it was priced with
    (degrees, micro-batches, dispatcher scheme, EP overlap as token slices, recompute, pipeline schedule)."""
    lay = c.layout
    recompute = written_recompute(c)
    return {
        "model": {"seq_length": w.seq_length,
                  "moe_token_dispatcher_type": "hierarchical" if lay.ep_scheme == "hierarchical" else "alltoall",
                  # EP overlap is priced as two token slices, each its own exchange (costing.Costing.slices)
                  "moe_comm_chunks": 2 if lay.ep_overlap else 1},
        "parallel_config": {"data_parallel": lay.dp, "model_parallel": lay.tp, "pipeline_stage": lay.pp,
                            "pp_interleave_num": lay.vpp, "expert_parallel": lay.ep,
                            "expert_model_parallel": lay.etp, "context_parallel": lay.cp,
                            "micro_batch_num": lay.micro_batch_num, "use_seq_parallel": lay.tp > 1,
                            "devices_per_node": lay.devices_per_node,
                            # interleaved 1F1B is the trainer's 1f1b with pp_interleave_num > 1
                            "pipeline_scheduler": "1f1b" if c.schedule == "interleaved" else c.schedule},
        "recompute_config": {"recompute": recompute == "full", "select_recompute": recompute == "selective"},
        "training": {"global_batch_size": w.global_batch},
    }


def write_recipe(path: str, base_recipe: Path, c: Candidate, w: Workload, command: str) -> None:
    """A recipe that inherits `base_recipe` and sets the pick; written atomically (all or nothing)."""
    out = Path(path)
    sc = c.scores
    try:
        base = os.path.relpath(base_recipe.resolve(), out.resolve().parent)
    except ValueError:  # another drive
        base = str(base_recipe.resolve())
    header = [
        f"# Written by: {command}",
        f"# Cluster {w.cluster.name}, {w.devices} devices, seq {w.seq_length}, global batch {w.global_batch}.",
        f"# Predicted: step {sc['step_time']:.3f} s, {sc['tokens_per_s_per_device']:.1f} tokens/s/device, "
        f"MFU {100 * sc['mfu']:.1f}%, peak memory {sc['memory'] / GIB:.1f} GiB, bubble {100 * sc['bubble']:.1f}%.",
        f"# Micro-batch size {c.layout.micro_batch_size} sequences; EP scheme {c.layout.ep_scheme}; EP overlap (two "
        f"chunks on two streams): {'on' if c.layout.ep_overlap else 'off'}.",
        f"# Per stage (not yet recipe keys): {stage_text(c)}; written as {written_recompute(c)} recompute for every "
        f"layer.",
    ]
    body = {"base": base, **recipe_overrides(c, w)}
    write_atomically(out, "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False))


def write_atomically(path: Path, text: str) -> None:
    """All or nothing: a failed write leaves whatever `path` held before."""
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
