"""Moving experts between the ranks of an expert-parallel group: a new placement applied as a relabelling.

Rank r of the EP group holds the experts labelled [r*E/ep, (r+1)*E/ep) (the dispatchers send a copy routed to
label e to rank e // (E/ep)). A placement (`parallel.ep.placement.Placement`, one copy per expert) puts expert
`slot_expert[d, s]` in slot s of rank d; applying it relabels: the expert going to slot s of rank d takes label
d*E/ep + s, and every tensor indexed by expert (its weights, the router's rows and bias, their Adam moments) is
permuted alike, so the layer computes the same function with each expert on its new rank. `perm[new] = old`: the
label each new label had before.

A tensor held whole on every rank (the router's) is permuted in place. A tensor split over the group (the experts'
rows) is gathered over the group and each rank keeps its new rows: the CPU transport moves the whole tensor, where
the moves need only the rows that change rank (`moved_rows`; an Ascend transport would send those alone).

With replicas (a placement with more slots than E/ep per rank, some experts in several), each expert keeps one home
copy, which takes its label as above, and the other copies sit in the ranks' spare slots: `homes` picks the home
copies so that every rank has exactly E/ep of them (a bipartite matching of experts to home seats).
"""
from __future__ import annotations

import numpy as np


def relabelling(current_labels: np.ndarray, slot_expert: np.ndarray) -> np.ndarray:
    """perm[new label] = old label: current_labels[label] = the expert (by its original id) holding that label now;
    slot_expert [ranks, slots]: the original id of the expert each slot gets."""
    label_of = np.empty_like(current_labels)
    label_of[current_labels] = np.arange(current_labels.size)
    return label_of[np.asarray(slot_expert).reshape(-1)]


def moved_rows(perm: np.ndarray, ranks: int) -> int:
    """How many experts change rank under `perm`."""
    per = perm.size // ranks
    return int(np.count_nonzero(perm // per != np.arange(perm.size) // per))


def permute_replicated(value: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """A tensor every rank holds whole, indexed by expert along dim 0 (e.g. router rows or the expert bias)."""
    return np.asarray(value)[perm]


def permuted_whole(transport, local: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """A tensor split over the EP group along dim 0 (each rank its `per` rows), gathered over the group and
    permuted: rank i keeps rows [i*per, (i+1)*per) as its new ones."""
    from mindspore import Tensor
    return transport.all_gather(Tensor(np.ascontiguousarray(local))).asnumpy()[perm]


def homes(slot_expert: np.ndarray, per: int) -> tuple[np.ndarray, np.ndarray] | None:
    """slot_expert [ranks, slots] (original ids, -1 empty; every expert at least once) -> (home [ranks, per]: the
    experts whose home copy each rank holds, spare [ranks, slots - per]: its other copies, -1 padded), or None when
    no choice gives every rank `per` home copies (a rank holding fewer than `per` experts, or too many ranks
    sharing the same few)."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_bipartite_matching
    ranks, slots = slot_expert.shape
    experts = ranks * per
    rank_of, expert_of = np.nonzero(slot_expert >= 0)
    expert_of = slot_expert[rank_of, expert_of]
    # expert e may take any of the `per` home seats of a rank holding it
    rows = np.repeat(expert_of, per)
    cols = (rank_of[:, None] * per + np.arange(per)).reshape(-1)
    seat = maximum_bipartite_matching(csr_matrix((np.ones(rows.size), (rows, cols)), shape=(experts, experts)),
                                      perm_type="column")
    if np.any(seat < 0):
        return None
    home = np.empty(experts, np.int64)
    home[seat] = np.arange(experts)
    home = home.reshape(ranks, per)
    spare = np.full((ranks, slots - per), -1, np.int64)
    for r in range(ranks):
        others = [e for e in slot_expert[r] if e >= 0 and e not in home[r]]
        spare[r, :len(others)] = others
    return home, spare
