"""Expert-parallel dispatch traffic from routing decisions: flat all-to-all against the hierarchical (two-stage,
node-aware) all-to-all, counted in token copies and converted to bytes. Pure NumPy, vectorised over tokens.

Placement (the dispatchers follow it): E routed experts over an EP group of R ranks, rank r holds experts
[r*E/R, (r+1)*E/R); nodes are runs of `devices_per_node` (D) consecutive ranks, node(r) = r // D, local index
l(r) = r % D. A token routed to its top-k experts makes k (token, expert) copies.

Flat all-to-all: each copy goes from its source rank s straight to the rank holding its expert. A copy whose expert
is on s moves nothing; one to another rank of s's node is intra-node, any other is inter-node.

Hierarchical all-to-all:
  stage 1 (inter-node): the token goes ONCE to each other node m that holds at least one of its experts, to the
          rank (m, l(s)) with the source's local index. Inter-node count: one per (token, remote node touched).
  stage 2 (intra-node): inside each node touched (s's own node for its own experts, m for the others) one copy per
          (token, expert) goes from the rank that holds the token (s, or (m, l(s))) to the rank holding the expert,
          nothing when that is the same rank. So a copy moves inside its node iff l(expert's rank) != l(s).

Attribution: every count belongs to the source rank whose token causes it, stage-2 copies on remote nodes included,
so `outgoing` needs only that rank's own routing and a trainer can sum per-rank counts with one all-reduce
(`Traffic.as_array` / `Traffic.from_array`).

Multipliers: the counts here are the DISPATCH of one MoE layer's forward. The combine moves the same bytes back
(the reverse paths, a combine of weighted expert outputs per copy; the hierarchical combine reduces a node's copies
on (m, l(s)) before the one inter-node send back), and the backward of the dispatch and of the combine each move
the same again (gradients on the reverse paths). One training step therefore moves STEP_MULTIPLIER = 4 times the
dispatch counts, per MoE layer and micro-batch (`Traffic.per_step`), and recomputation of a layer adds one more
forward's dispatch + combine (2x) for each recomputed MoE layer, not counted here.

Why the hierarchical scheme saves inter-node bytes: flat_inter / hier_inter is the mean number of a token's
experts on a remote node it touches (`expected_reduction`); for uniformly random distinct experts that is the
hypergeometric mean given at least one hit (`uniform_expected_reduction`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from math import comb

import numpy as np

STEP_MULTIPLIER = 4     # dispatch + combine, forward + backward


@dataclass(frozen=True)
class EpTopology:
    """E routed experts over an EP group of `ranks` ranks, `devices_per_node` consecutive ranks per node."""
    num_experts: int
    ranks: int
    devices_per_node: int

    def __post_init__(self):
        for name in ("num_experts", "ranks", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"EpTopology.{name}: expected a positive integer, got {value!r}")
        if self.num_experts % self.ranks:
            raise ValueError(f"EpTopology: {self.ranks} ranks do not divide {self.num_experts} experts (each rank "
                             f"holds num_experts / ranks experts; with more ranks than experts use more experts)")
        if self.ranks % self.devices_per_node:
            raise ValueError(f"EpTopology: devices_per_node={self.devices_per_node} does not divide {self.ranks} "
                             f"ranks (nodes hold whole runs of devices_per_node ranks)")

    @property
    def nodes(self) -> int:
        return self.ranks // self.devices_per_node

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ranks

    @property
    def experts_per_node(self) -> int:
        return self.num_experts // self.nodes

    def rank_of(self, experts):
        return np.asarray(experts) // self.experts_per_rank

    def node_of_rank(self, ranks):
        return np.asarray(ranks) // self.devices_per_node

    def local_of_rank(self, ranks):
        return np.asarray(ranks) % self.devices_per_node


@dataclass(frozen=True)
class Traffic:
    """Dispatch traffic of one MoE layer's forward (or a sum of them), in token copies (one copy = one token's hidden
    vector). Add them up over ranks, layers or micro-batches with `+` or `sum(...)`."""
    flat_inter: int = 0
    flat_intra: int = 0
    hier_inter: int = 0
    hier_intra: int = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        if not isinstance(other, Traffic):
            return NotImplemented
        return Traffic(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __radd__(self, other):
        if isinstance(other, (int, np.integer)) and other == 0:     # sum() starts from 0
            return self
        return NotImplemented

    def __mul__(self, factor: int) -> "Traffic":
        if isinstance(factor, bool) or not isinstance(factor, (int, np.integer)):
            return NotImplemented
        return Traffic(*(getattr(self, f.name) * int(factor) for f in fields(self)))

    __rmul__ = __mul__

    def per_step(self) -> "Traffic":
        """What a training step moves for this dispatch: dispatch + combine, forward + backward."""
        return self * STEP_MULTIPLIER

    @property
    def ratio(self) -> float:
        """Inter-node copies of the flat scheme over the hierarchical one (nan when nothing leaves a node)."""
        return self.flat_inter / self.hier_inter if self.hier_inter else float("nan")

    def to_bytes(self, bytes_per_token: int) -> dict[str, int]:
        """The four counts in bytes; `bytes_per_token` = hidden size x bytes of the dispatched dtype
        (`token_bytes`)."""
        return {f.name: getattr(self, f.name) * int(bytes_per_token) for f in fields(self)}

    def as_array(self) -> np.ndarray:
        """int64 [4] in field order, for one all-reduce of every rank's counts. Reduce them as integers (int32 is
        exact to 2^31 copies) or float64: a float32 sum is inexact past 2^24 copies (16.7M)."""
        return np.array([getattr(self, f.name) for f in fields(self)], np.int64)

    @classmethod
    def from_array(cls, values) -> "Traffic":
        values = np.asarray(values).reshape(-1)
        if values.shape != (len(fields(cls)),):
            raise ValueError(f"Traffic.from_array: expected {len(fields(cls))} values, got {values.shape[0]}")
        return cls(*(int(round(float(v))) for v in values))


def token_bytes(hidden_size: int, dtype_bytes: int) -> int:
    """Bytes one dispatched token copy carries (its hidden vector)."""
    return int(hidden_size) * int(dtype_bytes)


# ---- counting ------------------------------------------------------------------------------------------------
def _check_indices(indices, topo: EpTopology) -> np.ndarray:
    idx = np.asarray(indices)
    if idx.ndim < 2 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"indices: expected integer expert ids of shape [tokens, k], got {idx.dtype} {idx.shape}")
    if idx.size and (idx.min() < 0 or idx.max() >= topo.num_experts):
        raise ValueError(f"indices: expert ids must lie in [0, {topo.num_experts}), got "
                         f"[{idx.min()}, {idx.max()}]")
    return idx.astype(np.int64, copy=False)


def _check_rank(source_rank, topo: EpTopology) -> int:
    if isinstance(source_rank, bool) or not isinstance(source_rank, (int, np.integer)) \
            or not 0 <= source_rank < topo.ranks:
        raise ValueError(f"source_rank: expected an integer in [0, {topo.ranks}), got {source_rank!r}")
    return int(source_rank)


def _count(idx: np.ndarray, sources: np.ndarray, topo: EpTopology) -> Traffic:
    """idx [S, T, k] expert ids of S source ranks `sources` [S] -> their summed Traffic."""
    d = topo.devices_per_node
    src = sources.reshape(-1, 1, 1)
    s_node, s_local = src // d, src % d
    dest = idx // topo.experts_per_rank
    d_node, d_local = dest // d, dest % d
    same_node = d_node == s_node
    flat_inter = int(np.count_nonzero(~same_node))
    flat_intra = int(np.count_nonzero(same_node & (dest != src)))
    hier_intra = int(np.count_nonzero(d_local != s_local))
    # distinct nodes per token: sort each token's k node ids, count the changes
    nodes_sorted = np.sort(d_node, axis=-1)
    distinct = 1 + np.count_nonzero(nodes_sorted[..., 1:] != nodes_sorted[..., :-1], axis=-1) if idx.shape[-1] \
        else np.zeros(idx.shape[:-1], np.int64)
    touches_own = same_node.any(axis=-1)
    hier_inter = int(distinct.sum() - np.count_nonzero(touches_own))
    return Traffic(flat_inter, flat_intra, hier_inter, hier_intra)


def outgoing(indices, source_rank: int, topo: EpTopology) -> Traffic:
    """Dispatch traffic that ONE source rank's tokens cause: `indices` [T, k] are the expert ids its router chose.
    Stage-2 copies its tokens cause on remote nodes count here too, so the result depends on this rank's routing
    alone."""
    idx = _check_indices(indices, topo)
    if idx.ndim != 2:
        raise ValueError(f"indices: expected [tokens, k], got shape {idx.shape}")
    return _count(idx[None], np.array([_check_rank(source_rank, topo)]), topo)


def total(indices_by_rank, topo: EpTopology) -> Traffic:
    """Dispatch traffic of the whole EP group: `indices_by_rank` [R, T, k], rank r's tokens in row r (or a sequence
    of R arrays [T_r, k] of different lengths). Equals the sum of `outgoing` over the ranks."""
    if isinstance(indices_by_rank, (list, tuple)) and len({np.shape(x) for x in indices_by_rank}) > 1:
        if len(indices_by_rank) != topo.ranks:
            raise ValueError(f"indices_by_rank: expected one array per rank ({topo.ranks}), got "
                             f"{len(indices_by_rank)}")
        return sum(outgoing(x, r, topo) for r, x in enumerate(indices_by_rank))
    idx = _check_indices(indices_by_rank, topo)
    if idx.ndim != 3 or idx.shape[0] != topo.ranks:
        raise ValueError(f"indices_by_rank: expected [ranks={topo.ranks}, tokens, k], got shape {idx.shape}")
    return _count(idx, np.arange(topo.ranks), topo)


def split_by_rank(indices, topo: EpTopology) -> np.ndarray:
    """A trace of N tokens [N, k] dealt to the ranks as contiguous runs, N // R tokens each (the tail dropped):
    [R, N // R, k], as data-parallel ranks hold whole sequences."""
    idx = np.asarray(indices)
    per = idx.shape[0] // topo.ranks
    if per == 0:
        raise ValueError(f"indices: {idx.shape[0]} tokens cannot give each of {topo.ranks} ranks one")
    return idx[:per * topo.ranks].reshape(topo.ranks, per, *idx.shape[1:])


# ---- the reduction -------------------------------------------------------------------------------------------
def expected_reduction(indices, topo: EpTopology, source_rank: int | None = None) -> float:
    """The trace's mean number of a token's experts on one node, over the (token, remote node touched) pairs:
    how many flat inter-node copies one hierarchical stage-1 send replaces, so flat_inter / hier_inter.
    `indices`: [T, k] of `source_rank`, or [R, T, k] by rank (source_rank None). Counted per pair (not from the
    Traffic totals); nan when no token touches a remote node."""
    idx = _check_indices(indices, topo)
    if source_rank is None:
        if idx.ndim != 3 or idx.shape[0] != topo.ranks:
            raise ValueError(f"indices: expected [ranks={topo.ranks}, tokens, k] without source_rank, got shape "
                             f"{idx.shape}")
        sources = np.arange(topo.ranks)
    else:
        if idx.ndim != 2:
            raise ValueError(f"indices: expected [tokens, k] with a source_rank, got shape {idx.shape}")
        idx, sources = idx[None], np.array([_check_rank(source_rank, topo)])
    s, t, k = idx.shape
    node = topo.node_of_rank(topo.rank_of(idx))                                     # [S, T, k]
    token = np.arange(s * t).reshape(s, t, 1)
    remote = node != topo.node_of_rank(sources).reshape(-1, 1, 1)
    pair = (np.broadcast_to(token, node.shape) * topo.nodes + node)[remote]         # one key per remote copy
    if pair.size == 0:
        return float("nan")
    _, per_pair = np.unique(pair, return_counts=True)
    return float(per_pair.mean())


def uniform_expected_reduction(k: int, nodes: int, experts: int, ranks: int | None = None) -> float:
    """The analytic `expected_reduction` for top-k experts drawn uniformly at random without repeats: a node holds
    n = E / nodes experts, the number X of a token's k experts on a given node is hypergeometric, and the mean
    given the node is touched is E[X] / P(X >= 1) = (k n / E) / (1 - C(E - n, k) / C(E, k)). The same for every
    node, so for the remote ones. `ranks` (optional) is only checked against the placement: the value does not
    depend on how a node's experts are spread over its ranks."""
    if ranks is not None:
        if ranks % nodes:
            raise ValueError(f"uniform_expected_reduction: {nodes} nodes do not divide {ranks} ranks")
        EpTopology(experts, ranks, ranks // nodes)
    if nodes < 1 or experts % nodes:
        raise ValueError(f"uniform_expected_reduction: {nodes} nodes do not divide {experts} experts")
    if not 1 <= k <= experts:
        raise ValueError(f"uniform_expected_reduction: k={k} must lie in [1, {experts}]")
    n = experts // nodes
    miss = comb(experts - n, k) / comb(experts, k)
    return (k * n / experts) / (1.0 - miss)
