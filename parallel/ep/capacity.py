"""How many rows an expert exchange sends, and the token drop that bounds the routed copies: one description shared
by the dispatchers (telechat_moe/moe/dispatch.py), the dry run's exchange line and the planner's cost model, so the
three state the same rows.

The exchange is exact: a source sends each member of its group the copies routed to that member's experts, sorted
by expert, and one pad row (token 0 at weight 0, for the member's first expert), so that no send, receive or
grouped matmul is ever empty. Its rows are the routed copies plus one per member, whatever the skew:

- dropless (`moe_expert_capacity_factor` unset, the default): every copy, T x k of T tokens routed top-k.
- a capacity factor c (Megatron's `moe_expert_capacity_factor`): an expert takes at most ceil(c x T x k / E) of the
  copies routed from one source's T tokens, the others are dropped before the dispatch
  (`permute.drop_over_capacity`): at most E x that capacity copies.

The functions take Python numbers or NumPy arrays (the planner prices many layouts at once).
"""
from __future__ import annotations


def _smaller(a, b):
    """min(a, b) of numbers or arrays, in arithmetic a compiled graph can fold (graph mode parses this module)."""
    return a - (a - b) * (a > b)


def expert_capacity(tokens, top_k: int, num_experts, capacity_factor: float):
    """Copies one expert takes from one source's `tokens` routed top-k: ceil(c x tokens x k / E) (>= 1 for c > 0)."""
    return -(-(capacity_factor * tokens * top_k) // num_experts)


def routed_copies(tokens, top_k: int, num_experts, capacity_factor: float | None = None):
    """The copies one source's `tokens` routed top-k over `num_experts` send: all of them dropless, at most every
    expert's capacity with a capacity factor."""
    copies = tokens * top_k
    if capacity_factor is None:
        return copies
    return _smaller(copies, num_experts * expert_capacity(tokens, top_k, num_experts, capacity_factor))


def sent_rows(copies, members):
    """Rows one source's exact exchange sends its group of `members`: its copies and one pad row per member."""
    return copies + members
