"""The planner's rating of a recipe's own layout beside the best layout it finds for the same devices: the dry run's
line, so a recipe's layout is never far from what its cluster can do without anyone noticing.

One pricing, the planner's final one, on the Ascend cluster the recipe is for: the recipe's layout as
`python -m telechat_moe.plan --recipe R --evaluate <layout>` scores it (layers and recompute per chunk by the
stage ILP, then the event-driven simulator, under its default schedule), the best as the first row of
`python -m telechat_moe.plan --recipe R` (the search's best layouts balanced and simulated alike: refine.refine)."""
from __future__ import annotations

from parallel.planner.refine import refine
from parallel.planner.report import layout_text
from parallel.planner.search import search
from parallel.planner.simulate import simulate_layout
from parallel.planner.stage_ilp import schedule_name, solve_ilp
from telechat_moe.workload import recipe_layout, recipe_workload

CLUSTER = "ascend910b"


def rating_line(r) -> str:
    """"planner on <cluster> (ILP-balanced, simulated): own layout step <s> s, MFU <m>%; best for <n> devices step
    <s> s, MFU <m>% (<layout>, <schedule>); own / best <x>x"."""
    w = recipe_workload(r, CLUSTER)
    layout = recipe_layout(r, w)
    schedule = schedule_name(layout)
    line = f"planner on {CLUSTER} (ILP-balanced, simulated): own layout "
    a = solve_ilp(w, layout, schedule=schedule)
    own = None if a is None else simulate_layout(w, layout, a, schedule).scores
    line += "fits no layers/recompute assignment" if own is None else \
        f"step {own['step_time']:.3f} s, MFU {100 * own['mfu']:.1f}%"
    ranked = refine(w, search(w))
    if not ranked:
        return line + f"; no layout of {w.devices} devices fits"
    best = ranked[0]
    line += (f"; best for {w.devices} devices step {best.scores['step_time']:.3f} s, MFU "
             f"{100 * best.scores['mfu']:.1f}% ({layout_text(best.layout)}, {best.schedule})")
    return line if own is None else line + f"; own / best {own['step_time'] / best.scores['step_time']:.2f}x"
