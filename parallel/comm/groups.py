"""Process groups: the ranks a process exchanges with along each axis of a `ParallelLayout`, named once.

Every group is a sorted tuple of world ranks. `ProcessGroups(layout, rank)` answers the groups of one process: the
layout's axes (dp, tp, cp, pp, ep, etp, edp), the two levels of the EP group that a hierarchical all-to-all uses
(the EP ranks inside this rank's node, and the EP ranks in other nodes at the same position inside theirs), and the
pair of two ranks that a point-to-point transfer runs on. MindSpore's communication groups are created on first
use, once per process (`create_group` must be called by every member of a group, and only once); a group of one
rank needs no collective and none is created.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from parallel.layout import Axis, LayoutError, ParallelLayout

_created: set[str] = set()


@dataclass(frozen=True)
class Group:
    """A communication group as one of its members sees it."""
    name: str                   # MindSpore's group name ("" for a group of one rank: nothing to create)
    ranks: tuple[int, ...]      # world ranks, sorted
    rank: int                   # this process's world rank

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        """This process's position in the group (its rank inside the group)."""
        return self.ranks.index(self.rank)


def world_group_name() -> str:
    from mindspore.communication import GlobalComm
    return GlobalComm.WORLD_COMM_GROUP


def _name(kind: str, ranks: tuple[int, ...], world: int) -> str:
    if len(ranks) == 1:
        return ""
    if len(ranks) == world:
        return world_group_name()
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    return f"{kind}_{ranks[0]}_{len(ranks)}_{digest}"


def _create(group: Group) -> Group:
    if group.name and group.name != world_group_name() and group.name not in _created:
        from mindspore.communication import create_group
        create_group(group.name, list(group.ranks))
        _created.add(group.name)
    return group


class ProcessGroups:
    """The groups of world rank `rank` under `layout`. `create=False` only names them (tests, the dry run)."""

    def __init__(self, layout: ParallelLayout, rank: int, create: bool = True):
        self.layout, self.rank, self.create = layout, rank, create

    def _group(self, kind: str, ranks) -> Group:
        ranks = tuple(sorted(ranks))
        g = Group(_name(kind, ranks, self.layout.world_size), ranks, self.rank)
        return _create(g) if self.create else g

    def axis(self, axis: Axis, *more: Axis) -> Group:
        """The ranks that vary along `axis` (and the `more` axes: data x context for the dense gradients, tensor x
        context for a sequence's tokens) and share this rank's other coordinates."""
        ranks = self.layout.group_of(axis, self.rank, *more)
        if more and len(ranks) == len(self.layout.group_of(axis, self.rank)):
            more = ()       # the `more` axes of degree 1: the one axis's group, named and created once
        return self._group("_".join(a.value for a in (axis,) + more), ranks)

    def expert(self) -> Group:
        """The ep x etp ranks of this rank's expert group, which together hold every routed expert of its stage
        once (the expert shards' sums, such as the gradient norm's); the EP group itself where etp = 1."""
        if self.layout.etp == 1:
            return self.axis(Axis.EP)
        c = self.layout.coords(self.rank)
        return self._group("expert", [r for r in range(self.layout.world_size) if
                                      (self.layout.coords(r)[Axis.EDP], self.layout.coords(r)[Axis.PP]) ==
                                      (c[Axis.EDP], c[Axis.PP])])

    def ep_in_node(self) -> Group:
        """The EP ranks that share this rank's node: the second level of a hierarchical all-to-all."""
        node = self.layout.node_of(self.rank)
        return self._group("ep_node", [r for r in self.layout.group_of(Axis.EP, self.rank)
                                       if self.layout.node_of(r) == node])

    def ep_across_nodes(self) -> Group:
        """One EP rank per node, each at this rank's position among its node's EP ranks: the first level."""
        ep = self.layout.group_of(Axis.EP, self.rank)
        by_node: dict[int, list[int]] = {}
        for r in ep:
            by_node.setdefault(self.layout.node_of(r), []).append(r)
        sizes = {len(v) for v in by_node.values()}
        if len(sizes) != 1:
            raise LayoutError("devices_per_node", "a hierarchical all-to-all needs as many EP ranks in every "
                              "node; the EP group {ranks} spreads over nodes as {split}", ranks=ep,
                              split={n: len(v) for n, v in by_node.items()})
        mine = by_node[self.layout.node_of(self.rank)].index(self.rank)
        return self._group("ep_inter", [v[mine] for v in by_node.values()])

    def pair(self, peer: int) -> Group:
        """This rank and `peer`: the group a point-to-point transfer between them runs on."""
        if peer == self.rank or not 0 <= peer < self.layout.world_size:
            raise LayoutError("rank", "no point-to-point pair of {rank} and {peer}", rank=self.rank, peer=peer)
        return self._group("p2p", (self.rank, peer))
