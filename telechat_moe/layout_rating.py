"""The planner's rating of a recipe's own layout beside the best layout it finds for the same devices: the dry run's
line, so a recipe's layout is never far from what its cluster can do without anyone noticing.

Both are scored by the search's model (parallel/planner/cost_model.evaluate: analytic, even layer split), on the
Ascend cluster the recipe is for; `python -m telechat_moe.plan --recipe R` refines
the best ones with the placement ILP and the event simulator (a few minutes for the big recipes)."""
from __future__ import annotations

from parallel.planner.cost_model import evaluate
from parallel.planner.report import layout_text
from parallel.planner.search import search
from parallel.planner.workload import Layouts
from telechat_moe.workload import recipe_layout, recipe_workload

CLUSTER = "ascend910b"


def rating_line(r) -> str:
    """"planner on <cluster>: own layout <step> s, MFU <m>%; best for <n> devices <step> s, MFU <m>% (<layout>)"."""
    cluster = CLUSTER
    w = recipe_workload(r, cluster)
    own = evaluate(w, Layouts.of(recipe_layout(r, w)))
    result = search(w)
    ranked = result.ranked()
    line = (f"planner on {cluster} (analytic, even layer split): own layout step {own['step_time'][0]:.3f} s, "
            f"MFU {100 * own['mfu'][0]:.1f}%")
    if not len(ranked):
        return line + f"; no layout of {w.devices} devices fits"
    best = ranked[0]
    step, mfu = result.scores["step_time"][best], result.scores["mfu"][best]
    return (line + f"; best for {w.devices} devices step {step:.3f} s, MFU {100 * mfu:.1f}% "
            f"({layout_text(result.layouts.row(best))}); own / best {own['step_time'][0] / step:.2f}x")
