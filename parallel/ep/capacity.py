"""How many token copies an expert exchange moves, and the token drop that bounds them: one description shared by
the dispatchers (telechat_moe/moe/dispatch.py), the `--show-parallel` report and the planner's cost model, so the
three state the same bytes.

Graph mode needs static shapes, so each exchange of the dispatchers sends a buffer of the same rows to every member
of its group, whatever the routing. Two ways to size it:

- dropless (`moe_expert_capacity_factor` unset, the default): the most copies one source can send one destination,
  each of its rows to at most min(k, experts there) of that destination's experts. No copy is ever dropped; the
  buffer is ep x min(k, E/ep) / k times what the copies need (the padding moves too).
- a capacity factor c (Megatron's `moe_expert_capacity_factor`): an expert takes at most ceil(c x T x k / E) of the
  copies routed from one source's T tokens, the others are dropped before the dispatch
  (`permute.drop_over_capacity`), so a destination gets at most its experts' capacity and the buffer is about
  c x T x k rows, what the copies need when the routing is balanced.

`expert_capacity`, `rows_per_destination` and `exchange_rows` take Python numbers (a graph folds them into shapes) or NumPy arrays
(the planner prices many layouts at once).
"""
from __future__ import annotations


def _smaller(a, b):
    """min(a, b) of numbers or arrays, in arithmetic a compiled graph can fold."""
    return a - (a - b) * (a > b)


def expert_capacity(tokens, top_k: int, num_experts, capacity_factor: float):
    """Copies one expert takes from one source's `tokens` routed top-k: ceil(c x tokens x k / E) (>= 1 for c > 0)."""
    return -(-(capacity_factor * tokens * top_k) // num_experts)


def rows_per_destination(rows, top_k: int, per_member, per_expert=None):
    """Rows an exchange sends each group member holding `per_member` experts, from `rows` rows whose copies go to
    at most top_k experts each, at most `per_expert` copies per expert (None: no capacity, dropless)."""
    worst = rows * _smaller(top_k, per_member)
    return worst if per_expert is None else _smaller(worst, per_member * per_expert)


def exchange_rows(rows, top_k: int, per_member, num_experts, capacity_factor: float | None = None, sources=1):
    """Rows per destination of an exchange of `rows` rows that come from `sources` ranks' tokens (rows/sources
    each) routed top-k over `num_experts`: dropless (capacity_factor None), or each expert's capacity of every
    source's tokens."""
    per_expert = None if capacity_factor is None else \
        sources * expert_capacity(rows // sources, top_k, num_experts, capacity_factor)
    return rows_per_destination(rows, top_k, per_member, per_expert)
