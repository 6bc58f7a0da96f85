"""The one object that knows every parallel degree, validates them, and builds device groups.

Rank order follows Megatron-Core: tensor (fastest), context, data, pipeline (slowest). Expert parallelism
folds over the same ranks as data x context x tensor: the `ep * etp` ranks of an expert group are taken
contiguously inside one pipeline stage, so with `ep * etp <= devices_per_node` an expert group stays in one node
and only the hierarchical scheme's AllGather crosses nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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


class LayoutError(InputError):
    """A parallel layout that cannot exist; the message names the field."""


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
    # Names of the recipe keys, so errors point at what the user wrote.
    names: dict = field(default_factory=lambda: {
        "dp": "parallel_config.data_parallel", "tp": "parallel_config.model_parallel",
        "pp": "parallel_config.pipeline_stage", "vpp": "parallel_config.pp_interleave_num",
        "ep": "parallel_config.expert_parallel", "etp": "parallel_config.expert_model_parallel",
        "cp": "parallel_config.context_parallel", "micro_batch_num": "parallel_config.micro_batch_num",
        "devices_per_node": "parallel_config.devices_per_node"}, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def edp(self) -> int:
        return self.dp * self.cp * self.tp // (self.ep * self.etp)

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.world_size // self.devices_per_node))

    def degree(self, axis: Axis) -> int:
        return {Axis.DP: self.dp, Axis.TP: self.tp, Axis.PP: self.pp, Axis.CP: self.cp,
                Axis.EP: self.ep, Axis.ETP: self.etp, Axis.EDP: self.edp}[axis]

    def validate(self, world_size: int | None = None) -> "ParallelLayout":
        for key in ("dp", "tp", "pp", "vpp", "ep", "etp", "cp", "micro_batch_num", "devices_per_node"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{self.names[key]}: expected a positive integer, got {value!r}")
        if world_size is not None and self.world_size != world_size:
            raise LayoutError(
                f"parallel_config: data_parallel*model_parallel*context_parallel*pipeline_stage = "
                f"{self.dp}*{self.tp}*{self.cp}*{self.pp} = {self.world_size}, but the device count is {world_size}")
        if (self.dp * self.cp * self.tp) % (self.ep * self.etp):
            raise LayoutError(
                f"{self.names['ep']}: expert_parallel*expert_model_parallel = {self.ep * self.etp} must divide "
                f"data_parallel*context_parallel*model_parallel = {self.dp * self.cp * self.tp}")
        if self.pp > 1 and self.micro_batch_num < self.pp:
            raise LayoutError(f"{self.names['micro_batch_num']}: {self.micro_batch_num} micro-batches cannot fill "
                              f"{self.pp} pipeline stages (need at least {self.pp})")
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"{self.names['vpp']}: virtual pipeline chunks need pipeline_stage > 1")
        if self.vpp > 1 and self.micro_batch_num % self.pp:
            raise LayoutError(f"{self.names['micro_batch_num']}: interleaved 1F1B needs micro_batch_num "
                              f"({self.micro_batch_num}) divisible by pipeline_stage ({self.pp})")
        if self.sp and self.tp == 1:
            raise LayoutError("parallel_config.use_seq_parallel: sequence parallelism needs model_parallel > 1")
        return self

    # ---- coordinates and groups -------------------------------------------------------------------
    def coords(self, rank: int) -> dict[Axis, int]:
        """Coordinates of a global rank along tp, cp, dp, pp (and ep/etp/edp within the dp*cp*tp slab)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of {self.world_size}")
        tp = rank % self.tp
        cp = rank // self.tp % self.cp
        dp = rank // (self.tp * self.cp) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        slab = rank % (self.tp * self.cp * self.dp)
        etp = slab % self.etp
        ep = slab // self.etp % self.ep
        edp = slab // (self.etp * self.ep)
        return {Axis.TP: tp, Axis.CP: cp, Axis.DP: dp, Axis.PP: pp, Axis.ETP: etp, Axis.EP: ep, Axis.EDP: edp}

    def groups(self, axis: Axis) -> list[list[int]]:
        """All groups of ranks that vary only along `axis`, each sorted, together covering the world once."""
        buckets: dict[tuple, list[int]] = {}
        dense = (Axis.TP, Axis.CP, Axis.DP, Axis.PP)
        expert = (Axis.ETP, Axis.EP, Axis.EDP, Axis.PP)
        others = [a for a in (expert if axis in expert else dense) if a != axis]
        for rank in range(self.world_size):
            c = self.coords(rank)
            buckets.setdefault(tuple(c[a] for a in others), []).append(rank)
        return list(buckets.values())

    def group_of(self, axis: Axis, rank: int) -> list[int]:
        return next(g for g in self.groups(axis) if rank in g)

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def describe(self) -> str:
        return (f"dp={self.dp} tp={self.tp} cp={self.cp} pp={self.pp} vpp={self.vpp} ep={self.ep} etp={self.etp} "
                f"edp={self.edp} sp={self.sp} micro_batch_num={self.micro_batch_num} world={self.world_size}")
