"""The tensor-parallel collectives of one micro-batch, piece by piece, as parallel/tp's layers and mappings issue
them in a Megatron-Core style MLA + MoE decoder: the one list that the planner's cost model prices
(`costing.Costing.tp_time`) and that telechat_moe/parallel_report.py lists per module (tests/test_show_parallel.py
checks those against a model built with recording transports, and the planner's volumes against the report's).

Each function returns the `TPCollective`s of one piece over a tp group of `t` ranks, for a micro-batch of `b`
sequences of `s` tokens and hidden size `h`; `sp`: sequence parallelism (the planner always assumes it for t > 1).
Numbers may be NumPy arrays (the cost model's layouts): a split of the sequence is then a true division. At t = 1
there is nothing to exchange and every function returns ().

Shapes are the tensor as it enters the collective, in the layout of parallel/comm's Cells (they gather and scatter
axis 0, so a sequence collective sees [s, b, h]): an all-gather's input (its output is t times larger), a
reduce-scatter's full input. `dtype` is a role, not a name: COMPUTE (the compute dtype: what a region's linear
layers take and give), RESIDUAL (the residual stream: the embedding's output; float32 in this model) or FLOAT32
(the head, which computes in float32, the cross-entropy's statistics, the router's sums).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

COMPUTE, RESIDUAL, FLOAT32 = "compute", "residual", "float32"
DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class TPCollective:
    direction: str      # forward | backward
    kind: str           # all_gather | reduce_scatter | all_reduce
    shape: tuple        # as it enters the collective (numbers or NumPy arrays)
    dtype: str          # COMPUTE | RESIDUAL | FLOAT32
    what: str

    def payload(self, t, dtype_bytes):
        """Bytes of the full buffer: an all-gather's output, a reduce-scatter's input, an all-reduce's tensor."""
        n = prod(self.shape) * dtype_bytes
        return n * t if self.kind == "all_gather" else n


def _share(n, t):
    """n / t: exact for Python integers (the model's shapes), true division for arrays (the planner's)."""
    if isinstance(n, (int, np.integer)) and isinstance(t, (int, np.integer)):
        return n // t
    return n / t


def _active(t) -> bool:
    return bool(np.any(np.asarray(t) > 1))


def region_entry(s, b, t, h, sp: bool, width=None, dtype: str = COMPUTE, what: str = "EnterRegion"):
    """EnterRegion or a column-parallel layer's own input (cast to `dtype` first): under sequence parallelism the
    all-gather of the sequence shards (backward: reduce-scatter of the input gradient), otherwise CopyToGroup
    (backward: all-reduce of the input gradient)."""
    if not _active(t):
        return ()
    w = h if width is None else width
    if sp:
        return (TPCollective("forward", "all_gather", (_share(s, t), b, w), dtype,
                             f"{what}: all-gather of the sequence shards"),
                TPCollective("backward", "reduce_scatter", (s, b, w), dtype,
                             f"{what}: reduce-scatter of the input gradient"))
    return (TPCollective("backward", "all_reduce", (b, s, w), dtype,
                         f"{what} (CopyToGroup): sum of the input gradient"),)


def _sum_over_ranks(s, b, t, h, sp: bool, dtype, what: str, parts: str):
    """A layer whose ranks' outputs are partial and summed (dtype `dtype`): reduce-scatter over the sequence
    (backward: all-gather of the output gradient), or all-reduce."""
    if not _active(t):
        return ()
    if sp:
        return (TPCollective("forward", "reduce_scatter", (s, b, h), dtype, f"{what}: reduce-scatter of {parts}"),
                TPCollective("backward", "all_gather", (_share(s, t), b, h), dtype,
                             f"{what}: all-gather of the output gradient"))
    return (TPCollective("forward", "all_reduce", (b, s, h), dtype, f"{what}: all-reduce of {parts}"),)


def row_parallel_exit(s, b, t, h, sp: bool):
    """RowParallelLinear's output (compute dtype): its partial sums summed over the ranks."""
    return _sum_over_ranks(s, b, t, h, sp, COMPUTE, "RowParallelLinear", "the partial sums")


def region(s, b, t, h, sp: bool):
    """A whole region of a decoder layer (attention, a SwiGLU FFN): its entry and its row-parallel exit."""
    return region_entry(s, b, t, h, sp) + row_parallel_exit(s, b, t, h, sp)


def embedding_lookup(s, b, t, h, sp: bool):
    """VocabParallelEmbedding (residual dtype): the ranks' rows (zeros for tokens they do not hold) summed."""
    return _sum_over_ranks(s, b, t, h, sp, RESIDUAL, "VocabParallelEmbedding", "the ranks' rows")


def cross_entropy(s, b, t):
    """VocabParallelCrossEntropy over b*s tokens: all-gather of the ranks' maxima (no gradient), all-reduces of the
    sum of exp and of the label's logit; nothing in the backward."""
    if not _active(t):
        return ()
    n = b * s
    return (TPCollective("forward", "all_gather", (n,), FLOAT32,
                         "VocabParallelCrossEntropy: all-gather of the ranks' maxima (no gradient)"),
            TPCollective("forward", "all_reduce", (n,), FLOAT32, "VocabParallelCrossEntropy: sum of exp"),
            TPCollective("forward", "all_reduce", (n,), FLOAT32, "VocabParallelCrossEntropy: label logit"))


def router_sums(b, t, experts, device_aux: bool, z_loss: bool):
    """The router's loss statistics summed over tp (each rank routes its own positions), forward only: the
    sequence aux loss' expert counts and score sums per sequence (always computed), the device aux loss' expert
    load and score sums, the z-loss sum."""
    if not _active(t):
        return ()
    def total(shape, what):
        return TPCollective("forward", "all_reduce", shape, FLOAT32, f"router: {what} over tp")
    out = (total((b, experts), "sequence aux-loss expert counts"), total((b, experts), "sequence aux-loss score sums"))
    if device_aux:
        out += (total((experts,), "device aux-loss expert load"), total((experts,), "device aux-loss score sums"))
    if z_loss:
        out += (total((), "z-loss sum"),)
    return out


def moe_token_split(s, b, t, h, sp: bool):
    """Without sequence parallelism each tp rank routes its 1/tp of the replicated positions: SplitSequence's
    backward all-gathers the shares' gradient, GatherSequenceReplicated all-gathers the routed outputs (the
    residual dtype: they are cast to the layer input's). Under sequence parallelism the rank routes its shard: none."""
    if not _active(t) or sp:
        return ()
    local = _share(s, t)
    return (TPCollective("backward", "all_gather", (local, b, h), RESIDUAL,
                         "SplitSequence: all-gather of the token shares' gradient"),
            TPCollective("forward", "all_gather", (local, b, h), RESIDUAL,
                         "GatherSequenceReplicated: all-gather of the routed outputs"))


def mtp_projection(s, b, t, h, sp: bool):
    """MTP's eh_proj [2h -> h], column-parallel, input cast to the compute dtype: under sequence parallelism
    (SequenceParallelProjection) the all-gather of the [s/t, b, 2h] input and of the [h/t] output columns (backward:
    reduce-scatters of both gradients); otherwise CopyToGroup (backward: all-reduce of the input gradient) and
    gather_output's all-gather of the columns."""
    if not _active(t):
        return ()
    if sp:
        return (TPCollective("forward", "all_gather", (_share(s, t), b, 2 * h), COMPUTE,
                             "SequenceParallelProjection: all-gather of the sequence"),
                TPCollective("forward", "all_gather", (_share(h, t), b, s), COMPUTE,
                             "SequenceParallelProjection: all-gather of the hidden columns"),
                TPCollective("backward", "reduce_scatter", (s, b, 2 * h), COMPUTE,
                             "SequenceParallelProjection: reduce-scatter of the input gradient"),
                TPCollective("backward", "reduce_scatter", (h, b, s), COMPUTE,
                             "SequenceParallelProjection: reduce-scatter of the columns' gradient"))
    return (TPCollective("backward", "all_reduce", (b, s, 2 * h), COMPUTE,
                         "ColumnParallelLinear input (CopyToGroup): sum of the input gradient"),
            TPCollective("forward", "all_gather", (_share(h, t), b * s), COMPUTE,
                         "ColumnParallelLinear gather_output: all-gather of the output columns"))


# ---- blocks: what the planner prices per block kind ------------------------------------------------------------
def dense_layer(s, b, t, h, sp: bool = True):
    """A dense decoder layer: the attention region and the FFN region."""
    return region(s, b, t, h, sp) + region(s, b, t, h, sp)


def moe_layer(s, b, t, h, sp: bool = True):
    """An MoE decoder layer's tensor-parallel part: the attention region, the token split (without sequence
    parallelism) and the shared expert's region. The router's sums are `router_sums` over the ranks routing a
    sequence's positions (tp, times cp under context parallelism); the routed experts' all-to-alls are EP's."""
    return region(s, b, t, h, sp) + moe_token_split(s, b, t, h, sp) + region(s, b, t, h, sp)


def head(s, b, t, h, tied: bool, sp: bool = True):
    """The output head (its column-parallel input in float32, unless tied to the embedding) and the cross-entropy."""
    entry = () if tied else region_entry(s, b, t, h, sp, dtype=FLOAT32, what="ColumnParallelLinear input")
    return entry + cross_entropy(s, b, t)


def mtp_extra(s, b, t, h, sp: bool = True):
    """An MTP depth beyond its decoder layer and the shared head: the next tokens' embedding lookup and eh_proj."""
    return embedding_lookup(s, b, t, h, sp) + mtp_projection(s, b, t, h, sp)
