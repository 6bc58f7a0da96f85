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


def permute_sharded(transport, local: np.ndarray, perm: np.ndarray, index: int):
    """This rank's new rows of a tensor split over the EP group along dim 0 (rank `index` holds rows
    [index*per, (index+1)*per)): the whole tensor gathered over the group, permuted, this rank's rows kept."""
    from mindspore import Tensor
    per = local.shape[0]
    whole = transport.all_gather(Tensor(np.ascontiguousarray(local))).asnumpy()
    return whole[perm[index * per:(index + 1) * per]]
