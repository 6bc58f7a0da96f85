"""What the planner prices: a model on a cluster at a sequence length and batch (`Workload`, with the bytes of each
kind of tensor in `Precision`), and many candidate layouts as a struct of arrays (`Layouts`), scored at once by
cost_model.py."""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from parallel.layout import EP_SCHEMES, RECOMPUTE, ParallelLayout
from parallel.planner.cluster import Cluster
from parallel.planner.model_shape import ModelShape, master_copy_bytes

FP32 = 4


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor, each stated on its own (e.g. BF16 weights, FP32 gradients, an FP32
    master copy and FP32 moments: param_bytes=2, grad_bytes=4, master_bytes=4, optimizer_bytes=8)."""
    matmul_dtype: str = "bf16"  # selects the cluster's peak FLOP/s for GEMMs and attention
    activation_bytes: int = 2  # stored / communicated activations
    param_bytes: int = 4  # the weights the passes read (MindFormers keeps params_dtype float32, cast per GEMM)
    grad_bytes: int = 4
    optimizer_bytes: int = 8  # Adam's m and v together (fp32 moments: 8)
    master_bytes: int | None = None  # the optimizer's master copy; None: fp32 where the weights are below fp32
    dispatch_bytes: int | None = None  # EP dispatch payload (e.g. 1 for FP8 dispatch); None: activation_bytes
    residual_bytes: int = 4  # the residual stream (the embedding's output, what its tp collectives move)

    @property
    def master(self) -> float:
        return master_copy_bytes(self.param_bytes, self.master_bytes)


@dataclass(frozen=True)
class Workload:
    shape: ModelShape
    cluster: Cluster
    devices: int
    seq_length: int
    global_batch: int  # sequences per step
    precision: Precision = Precision()
    shard_optimizer: bool = True
    overlap_grad_reduce: bool = True  # DP reduce-scatter / all-gather hidden behind the last backward / first forward
    # max/mean routed token copies over the EP ranks (1: balanced, what routing balance alone aims at): the most
    # loaded rank computes that many times the mean copies and the combine waits for it, so it sets every rank's
    # expert time (and its receive sets the exchange's); how an expert placement is priced
    expert_load: float = 1.0
    # share (0..1) of the activations kept for the backward that waits in host memory (module docstring)
    activation_offload: float = 0.0

    def __post_init__(self):
        if not 0 <= self.activation_offload <= 1:
            raise ValueError(f"activation_offload: expected a share between 0 and 1, got {self.activation_offload}")
        if self.activation_offload and self.cluster.host_link_bandwidth <= 0:
            raise ValueError(f"activation_offload: cluster {self.cluster.name} states no host_link.bandwidth")


@dataclass
class Layouts:
    """Candidate ParallelLayouts as a struct of arrays (one entry per layout), for the vectorised model: `row(i)`
    is one as a ParallelLayout, `of(...)` the arrays of given ones. sp is on whenever tp > 1."""
    tp: np.ndarray
    pp: np.ndarray
    vpp: np.ndarray
    dp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    mbs: np.ndarray  # sequences per micro-batch (ParallelLayout.micro_batch_size)
    m: np.ndarray  # micro-batches per step (ParallelLayout.micro_batch_num)
    recompute: np.ndarray  # index into RECOMPUTE
    ep_scheme: np.ndarray  # index into EP_SCHEMES
    ep_overlap: np.ndarray  # 0/1
    devices_per_node: np.ndarray
    cp: np.ndarray = 1  # context parallelism: each rank a 1/cp share of every sequence's positions (parallel/cp)

    def __post_init__(self):
        n = max(np.size(getattr(self, f.name)) for f in fields(self))
        for f in fields(self):
            setattr(self, f.name, np.broadcast_to(np.asarray(getattr(self, f.name), dtype=np.int64), (n,)).copy())

    def __len__(self) -> int:
        return len(self.tp)

    @property
    def edp(self) -> np.ndarray:
        """The expert-data-parallel degree of each layout (ParallelLayout.edp)."""
        return self.dp * self.cp * self.tp // (self.ep * self.etp)

    def take(self, index) -> "Layouts":
        return Layouts(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def row(self, i: int) -> ParallelLayout:
        tp = int(self.tp[i])
        return ParallelLayout(dp=int(self.dp[i]), tp=tp, pp=int(self.pp[i]), vpp=int(self.vpp[i]),
                              ep=int(self.ep[i]), etp=int(self.etp[i]), sp=tp > 1, micro_batch_num=int(self.m[i]),
                              devices_per_node=int(self.devices_per_node[i]), micro_batch_size=int(self.mbs[i]),
                              recompute=RECOMPUTE[self.recompute[i]], ep_scheme=EP_SCHEMES[self.ep_scheme[i]],
                              ep_overlap=bool(self.ep_overlap[i]), cp=int(self.cp[i]))

    @classmethod
    def of(cls, *layouts: ParallelLayout) -> "Layouts":
        return cls(tp=[x.tp for x in layouts], pp=[x.pp for x in layouts], vpp=[x.vpp for x in layouts],
                   dp=[x.dp for x in layouts], ep=[x.ep for x in layouts], etp=[x.etp for x in layouts],
                   mbs=[x.micro_batch_size for x in layouts], m=[x.micro_batch_num for x in layouts],
                   recompute=[RECOMPUTE.index(x.recompute) for x in layouts],
                   ep_scheme=[EP_SCHEMES.index(x.ep_scheme) for x in layouts],
                   ep_overlap=[int(x.ep_overlap) for x in layouts],
                   devices_per_node=[x.devices_per_node for x in layouts], cp=[x.cp for x in layouts])
