"""The dispatch traffic of `traffic.outgoing`, counted inside the step's graph from the router's decisions: for
one source rank's tokens, the copies a flat all-to-all sends inside and across nodes and those the hierarchical
one would send, as a float32 vector [flat_inter, flat_intra, hier_inter, hier_intra] (the field order of
`traffic.Traffic`). A copy dropped to capacity (expert -1) is not sent and not counted. `traffic.py` is its NumPy reference (tests/test_ep_traffic.py compares them)."""
from __future__ import annotations

import mindspore as ms
from mindspore import ops


def dispatch_counts(indices, source_rank: int, experts_per_rank: int, devices_per_node: int, nodes: int):
    """indices [T, k] int32 (global expert ids, -1: dropped) -> [4] float32 copies, as the module docstring says."""
    sent = indices >= 0
    rank = indices // experts_per_rank
    node = ops.where(sent, rank // devices_per_node, nodes)          # a dropped copy: no node
    home, local = source_rank // devices_per_node, source_rank % devices_per_node
    remote = ops.logical_and(sent, ops.not_equal(node, home))
    flat_inter = remote.astype(ms.float32).sum()
    flat_intra = ops.logical_and(ops.logical_and(sent, ops.logical_not(remote)),
                                 ops.not_equal(rank, source_rank)).astype(ms.float32).sum()
    touched = ops.amax(ops.one_hot(node, nodes, ops.ones((), ms.float32), ops.zeros((), ms.float32)), 1)  # [T, nodes]
    hier_inter = touched.sum() - touched[:, home].sum()
    hier_intra = ops.logical_and(sent, ops.not_equal(rank % devices_per_node, local)).astype(ms.float32).sum()
    return ops.stop_gradient(ops.stack((flat_inter, flat_intra, hier_inter, hier_intra)))
