"""The one object that knows every parallel degree, validates them, and builds device groups; and the rules any
layout obeys, once, as functions over numbers that hold for one layout and for NumPy arrays of candidate layouts
alike (ParallelLayout.validate, a recipe's validation, the planner's search and its one-layout evaluation use them).

Rank order follows Megatron-Core: tensor (fastest), context, data, pipeline (slowest). Expert parallelism
folds over the same ranks as data x context x tensor: the `ep * etp` ranks of an expert group are taken
contiguously inside one pipeline stage, so with `ep * etp <= devices_per_node` an expert group stays in one node
and only the hierarchical scheme's AllGather crosses nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum

from oneline import InputError


class Axis(str, Enum):
    DP = "dp"
    TP = "tp"
    PP = "pp"
    CP = "cp"
    EP = "ep"
    ETP = "etp"
    EDP = "edp"  # expert-data-parallel: replicas of one expert shard


# MindFormers' parallel_config key of each degree: what recipes and the MindFormers export call them (LayoutError's
# `reason(MINDFORMERS_KEYS)` words a message in them).
MINDFORMERS_KEYS = {"dp": "data_parallel", "tp": "model_parallel", "pp": "pipeline_stage", "vpp": "pp_interleave_num",
                    "ep": "expert_parallel", "etp": "expert_model_parallel", "cp": "context_parallel",
                    "sp": "use_seq_parallel", "micro_batch_num": "micro_batch_num",
                    "devices_per_node": "devices_per_node"}
# What the planner chooses beside the degrees: activation recompute, and the expert all-to-all's scheme.
RECOMPUTE = ("none", "selective", "full")
EP_SCHEMES = ("flat", "hierarchical", "node_dedup")
PLANNER_CHOICES = ("micro_batch_size", "recompute", "ep_scheme", "ep_overlap")


class _OwnNames(dict):
    """A caller's names for the degrees; a degree it does not rename keeps its own (tp, ep, micro_batch_num)."""

    def __missing__(self, key: str) -> str:
        return key


class LayoutError(InputError):
    """A parallel layout that cannot exist. `field` is the degree at fault (a ParallelLayout field: "ep",
    "micro_batch_num"; "world_size" for the product of the degrees against the device count); `reason(names)` words
    the message in the caller's names for the degrees (a recipe's keys), str(e) is `field: reason` in their own."""

    def __init__(self, field: str, template: str, **values):
        self.field, self.template, self.values = field, template, values
        super().__init__(f"{field}: {self.reason()}")

    def reason(self, names: dict[str, str] | None = None) -> str:
        return self.template.format(n=_OwnNames(names or {}), **self.values)


# ---- the rules, written once --------------------------------------------------------------------------------
# Functions over numbers that work alike on Python ints (ParallelLayout.validate, one layout to evaluate, a recipe)
# and on NumPy arrays (the planner's vectorised search, one entry per candidate layout): true where a layout can
# exist. `m` is the number of micro-batches per step, `mbs` the sequences per micro-batch; `shape` is the planner's
# ModelShape (parallel.planner.model_shape).
def fills_world(dp, tp, cp, pp, world_size):
    """The dense degrees multiply to the device count."""
    return dp * tp * cp * pp == world_size


def experts_fold_over_dense(dp, cp, tp, ep, etp):
    """An expert group (ep x etp ranks) folds over the dp x cp x tp ranks of one pipeline stage."""
    return (dp * cp * tp) % (ep * etp) == 0


def micro_batches_fill_stages(pp, m):
    return (pp == 1) | (m >= pp)


def interleave_has_stages(pp, vpp):
    """Virtual pipeline chunks need more than one stage."""
    return (vpp == 1) | (pp > 1)


def interleave_fills_stages(pp, vpp, m):
    """Interleaved 1F1B runs the micro-batches in rounds of one per stage."""
    return (vpp == 1) | (m % pp == 0)


def sequence_parallel_has_tp(sp, tp):
    """Sequence parallelism splits the sequence over the tensor-parallel group."""
    return (sp == 0) | (tp > 1)


def heads_split(shape, tp):
    return shape.num_heads % tp == 0


def kv_heads_split(shape, tp):
    """GQA's KV heads split evenly over tp, or tp is a multiple of them (each head then held by tp / kv ranks);
    MLA has no KV heads to split (num_key_value_heads = 0, which every tp divides)."""
    kv = shape.num_key_value_heads
    return (kv % tp == 0) | (tp % max(kv, 1) == 0)


def experts_split(shape, ep, etp=1):
    """ep divides the routed experts; a dense model has none, so no expert groups either: ep = etp = 1."""
    return (shape.num_routed_experts % ep == 0) & ((shape.num_routed_experts > 0) | ((ep == 1) & (etp == 1)))


def layers_fill_chunks(shape, pp, vpp):
    """Every one of the pp x vpp pipeline chunks holds a layer, save that the first may hold the embedding alone and
    the last the head and loss alone (Llama 3 405B ran 126 layers as 16 x 8 chunks so: arXiv:2407.21783, 3.3.2)."""
    return shape.num_layers + 2 >= pp * vpp


def tp_within_node(tp, devices_per_node):
    return tp <= devices_per_node


def global_batch_splits(global_batch, dp, mbs):
    """The global batch splits into dp replicas of whole micro-batches of mbs sequences (equally: of mbs
    micro-batches, the product being what divides)."""
    return global_batch % (dp * mbs) == 0


def check_model_fit(shape, tp: int, pp: int, vpp: int, ep: int, devices_per_node: int, etp: int = 1) -> None:
    """The model-shape rules for one layout, as LayoutErrors in the degrees' own names."""
    dense = not shape.num_routed_experts
    for ok, field, template in (
            (heads_split(shape, tp), "tp", "tp={tp} does not divide the {heads} attention heads"),
            (kv_heads_split(shape, tp), "tp", "tp={tp} neither divides the {kv} KV heads nor is a multiple of them"),
            (experts_split(shape, ep, etp), "etp" if dense and ep == 1 else "ep",
             "ep={ep},etp={etp}: a dense model has no routed experts to split; give ep=1,etp=1" if dense else
             "ep={ep} does not divide the {experts} routed experts"),
            (layers_fill_chunks(shape, pp, vpp), "pp",
             "pp*vpp = {chunks} chunks for only {layers} layers and the embedding and head"),
            (tp_within_node(tp, devices_per_node), "tp", "tp={tp} spans more than one node of {node} devices")):
        if not ok:
            raise LayoutError(field, template, tp=tp, ep=ep, etp=etp, chunks=pp * vpp, heads=shape.num_heads,
                              kv=shape.num_key_value_heads, experts=shape.num_routed_experts,
                              layers=shape.num_layers, node=devices_per_node)


@dataclass(frozen=True)
class ParallelLayout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    sp: bool = False
    micro_batch_num: int = 1
    devices_per_node: int = 8
    # What the planner chooses beside the degrees (a recipe's from its micro-batching, recompute_config and token
    # dispatcher): sequences per micro-batch, activation recompute (none | selective | full), the expert
    # all-to-all's scheme (flat | hierarchical | node_dedup) and whether it overlaps another chunk's compute.
    micro_batch_size: int = 1
    recompute: str = "none"
    ep_scheme: str = "flat"
    ep_overlap: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def edp(self) -> int:
        return self.dp * self.cp * self.tp // (self.ep * self.etp)

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.world_size // self.devices_per_node))

    def degrees(self) -> dict:
        """The layout without what the planner chooses beside it (micro-batch size, recompute, EP scheme): what a
        run's tensor dumps record of how it was split."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in PLANNER_CHOICES}

    def degree(self, axis: Axis) -> int:
        return {Axis.DP: self.dp, Axis.TP: self.tp, Axis.PP: self.pp, Axis.CP: self.cp,
                Axis.EP: self.ep, Axis.ETP: self.etp, Axis.EDP: self.edp}[axis]

    def validate(self, world_size: int | None = None) -> "ParallelLayout":
        for key in ("dp", "tp", "pp", "vpp", "ep", "etp", "cp", "micro_batch_num", "devices_per_node",
                    "micro_batch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(key, "expected a positive integer, got {value!r}", value=value)
        for key, allowed in (("recompute", RECOMPUTE), ("ep_scheme", EP_SCHEMES)):
            if getattr(self, key) not in allowed:
                raise LayoutError(key, "expected one of {allowed}, got {value!r}", allowed=", ".join(allowed),
                                  value=getattr(self, key))
        dp, tp, cp, pp, vpp, ep, etp, m = (self.dp, self.tp, self.cp, self.pp, self.vpp, self.ep, self.etp,
                                           self.micro_batch_num)
        for ok, field, template in (
                (world_size is None or fills_world(dp, tp, cp, pp, world_size), "world_size",
                 "{n[dp]}*{n[tp]}*{n[cp]}*{n[pp]} = {dp}*{tp}*{cp}*{pp} = {world}, but the device count is "
                 "{world_size}"),
                (experts_fold_over_dense(dp, cp, tp, ep, etp), "ep",
                 "{n[ep]}*{n[etp]} = {ep_etp} must divide {n[dp]}*{n[cp]}*{n[tp]} = {dense}"),
                (micro_batches_fill_stages(pp, m), "micro_batch_num",
                 "{m} micro-batches cannot fill {pp} pipeline stages (need at least {pp})"),
                (interleave_has_stages(pp, vpp), "vpp", "virtual pipeline chunks need {n[pp]} > 1"),
                (interleave_fills_stages(pp, vpp, m), "micro_batch_num",
                 "interleaved 1F1B needs {n[micro_batch_num]} ({m}) divisible by {n[pp]} ({pp})"),
                (sequence_parallel_has_tp(self.sp, tp), "sp", "sequence parallelism needs {n[tp]} > 1")):
            if not ok:
                raise LayoutError(field, template, dp=dp, tp=tp, cp=cp, pp=pp, m=m, world=self.world_size,
                                  world_size=world_size, ep_etp=ep * etp, dense=dp * cp * tp)
        return self

    # ---- coordinates and groups -------------------------------------------------------------------
    def coords(self, rank: int) -> dict[Axis, int]:
        """Coordinates of a global rank along tp, cp, dp, pp (and ep/etp/edp within the dp*cp*tp slab)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError("rank", "{rank} outside world of {world}", rank=rank, world=self.world_size)
        tp = rank % self.tp
        cp = rank // self.tp % self.cp
        dp = rank // (self.tp * self.cp) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        slab = rank % (self.tp * self.cp * self.dp)
        etp = slab % self.etp
        ep = slab // self.etp % self.ep
        edp = slab // (self.etp * self.ep)
        return {Axis.TP: tp, Axis.CP: cp, Axis.DP: dp, Axis.PP: pp, Axis.ETP: etp, Axis.EP: ep, Axis.EDP: edp}

    def groups(self, axis: Axis, *more: Axis) -> list[list[int]]:
        """All groups of ranks that vary only along `axis` (and the `more` axes of the same kind: dense or expert),
        each sorted, together covering the world once."""
        buckets: dict[tuple, list[int]] = {}
        dense = (Axis.TP, Axis.CP, Axis.DP, Axis.PP)
        expert = (Axis.ETP, Axis.EP, Axis.EDP, Axis.PP)
        others = [a for a in (expert if axis in expert else dense) if a not in (axis,) + more]
        for rank in range(self.world_size):
            c = self.coords(rank)
            buckets.setdefault(tuple(c[a] for a in others), []).append(rank)
        return list(buckets.values())

    def group_of(self, axis: Axis, rank: int, *more: Axis) -> list[int]:
        return next(g for g in self.groups(axis, *more) if rank in g)

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def describe(self) -> str:
        return (f"dp={self.dp} tp={self.tp} cp={self.cp} pp={self.pp} vpp={self.vpp} ep={self.ep} etp={self.etp} "
                f"edp={self.edp} sp={self.sp} micro_batch_num={self.micro_batch_num} world={self.world_size}")
