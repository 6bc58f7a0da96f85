"""Tensor-parallel layers (Megatron-Core's ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding and
vocab-parallel cross-entropy) as Cells over `parallel.comm`, usable in graph mode.

Every layer takes the transport of its tensor-parallel group (`transport_for(ProcessGroups(layout, rank).axis(
Axis.TP), device_target)`); the group's size is tp and this rank's position in it is r. Weights are stored [out, in]
in float32 (the project's `Linear` convention) and cast to the compute dtype in the matmul. Each layer initialises
the *full* matrix from `np.random.default_rng(seed)` (normal, std `init_std`) and keeps its own slice, so any tp
computes the function tp=1 computes; `shard_of(full, tp, r)` is that slice (for checkpoints and tests) and
`from_full(full, transport, ...)` builds a layer from a given full weight.

Where the collectives run (forward / backward; "all-gather" and "reduce-scatter" of the sequence axis where
sequence parallelism is on, the input or output then holding this rank's s/tp sequence positions):

| layer | input | forward | backward |
| --- | --- | --- | --- |
| `ColumnParallelLinear` | x [..., in], replicated | identity, matmul [out/tp, in] | matmul, all-reduce of dx |
| `ColumnParallelLinear(sequence_parallel)` | x [b, s/tp, in] | all-gather of s, matmul | matmul, reduce-scatter of s |
| `ColumnParallelLinear(gather_output)` | x [..., in], replicated | + all-gather of the out/tp shards | + own slice of dy |
| `RowParallelLinear` | x [..., in/tp] (a column shard) | matmul [out, in/tp], all-reduce | identity, matmul |
| `RowParallelLinear(sequence_parallel)` | x [b, s, in/tp] | matmul, reduce-scatter of s | all-gather of s, matmul |
| `VocabParallelEmbedding` | ids [b, s] | local rows (zeros outside them), all-reduce | identity, scatter-add |
| `VocabParallelEmbedding(sequence_parallel)` | ids [b, s] | local rows, reduce-scatter of s | all-gather of s |
| `VocabParallelCrossEntropy` | logits [N, V/tp] | all-gather of N maxima (no gradient), 2 all-reduces of [N] | none |

The gradients are those of one loss that every member of the group computes alike (Megatron's convention): a
replicated value's gradient is the same on every member and is not summed again, a shard's gradient is the
member's own. A sequence-parallel layer needs 3-D batch-first activations [b, s, h] with s divisible by tp (the
gathered axis is the sequence: the Cells of `parallel.comm` gather and scatter axis 0, so the layers put the sequence
in front and back again). Dimensions split over tp must be divisible by it; no bias (the model has none).
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from parallel.comm import CopyToGroup, GatherFromGroup, ReduceFromGroup, ReduceScatterToGroup


def full_normal(shape, init_std: float, seed: int) -> np.ndarray:
    """The full weight every tp slices: normal(0, init_std) from a NumPy generator seeded by `seed`, float32."""
    return (np.random.default_rng(seed).standard_normal(tuple(shape)) * init_std).astype(np.float32)


def shard_range(size: int, tp: int, rank: int, what: str = "dimension") -> tuple[int, int]:
    """[begin, end) of rank `rank`'s 1/tp share of `size` (Megatron's contiguous split)."""
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"tensor parallel rank {rank} of {tp}: not a rank of the group")
    if size % tp:
        raise ValueError(f"{what} {size} is not divisible by tensor_parallel {tp}")
    n = size // tp
    return rank * n, (rank + 1) * n


def _tp_of(transport) -> tuple[int, int]:
    return transport.group.size, transport.group.index


def seq_first(x):
    """[b, s, h] -> [s, b, h] (and back: the same permutation)."""
    return ops.transpose(x, (1, 0, 2))


class GatherReplicated(nn.Cell):
    """Megatron's gather_from_tensor_model_parallel_region: all-gather (axis 0) whose result every member then uses
    alike, so the backward keeps this member's slice of the (replicated) gradient and sums nothing. (`parallel.comm`'s
    GatherFromGroup reduce-scatters in its backward: right when members consume the gathered tensor differently, as a
    column-parallel layer does, tp times too much when they consume it alike.)"""

    def __init__(self, transport):
        super().__init__()
        self.t = transport
        self.me = transport.group.index

    def construct(self, x):
        return self.t.all_gather(x)

    def bprop(self, x, out, dout):
        n = x.shape[0]
        return (dout[self.me * n:(self.me + 1) * n],)


class _ShardedLinear(nn.Cell):
    """Shared by the two linear layers: the weight slice, its initialisation and the local matmul."""
    split_axis = 0   # the weight's axis split over tp: rows (output features) or columns (input features)

    def __init__(self, in_features: int, out_features: int, tp_transport, init_std: float, dtype=ms.float32,
                 seed: int = 0, full_weight: np.ndarray | None = None):
        super().__init__()
        self.tp, self.rank = _tp_of(tp_transport)
        self.in_features, self.out_features = in_features, out_features
        full = full_normal((out_features, in_features), init_std, seed) if full_weight is None else full_weight
        if tuple(full.shape) != (out_features, in_features):
            raise ValueError(f"{type(self).__name__}: full weight of shape {tuple(full.shape)}, expected "
                             f"{(out_features, in_features)} ([out, in])")
        self.weight = Parameter(Tensor(self.shard_of(full, self.tp, self.rank)), name="weight")
        self.matmul = ops.MatMul(transpose_b=True)
        self.compute_dtype = dtype
        self.local_out = self.weight.shape[0]

    @classmethod
    def shard_of(cls, full: np.ndarray, tp: int, rank: int) -> np.ndarray:
        """This rank's slice of the full [out, in] weight (or of its gradient)."""
        full = np.asarray(full, np.float32)
        begin, end = shard_range(full.shape[cls.split_axis], tp, rank,
                                 "out_features" if cls.split_axis == 0 else "in_features")
        return np.ascontiguousarray(full[begin:end] if cls.split_axis == 0 else full[:, begin:end])

    @classmethod
    def from_full(cls, full: np.ndarray, tp_transport, dtype=ms.float32, **kwargs):
        """The layer of this rank holding its slice of `full` [out, in]."""
        out_features, in_features = full.shape
        return cls(in_features, out_features, tp_transport, 0.0, dtype, full_weight=np.asarray(full, np.float32),
                   **kwargs)

    def _local(self, x):
        shape = x.shape
        y = self.matmul(x.reshape(-1, shape[-1]).astype(self.compute_dtype), self.weight.astype(self.compute_dtype))
        return y.reshape(shape[:-1] + (self.local_out,))


class ColumnParallelLinear(_ShardedLinear):
    """y = x W^T with W [out, in] split by rows: this rank holds rows [r*out/tp, (r+1)*out/tp) and computes those
    output features.

    Forward: `CopyToGroup` (identity) then the local matmul; the output is this rank's [..., out/tp] shard (the input
    of a `RowParallelLinear`, or vocab-parallel logits). Backward: the local matmul's dx is this rank's share of the
    input gradient, and CopyToGroup's all-reduce sums the shares.
    `sequence_parallel=True`: the input is this rank's sequence shard [b, s/tp, in]; `GatherFromGroup` all-gathers the
    sequence in the forward (the full [b, s, in] on every rank), its backward reduce-scatters dx back to [b, s/tp, in]
    (summing the shares and keeping this rank's positions in one collective).
    `gather_output=True`: the output shards are all-gathered into the full [..., out] on every rank (backward: this
    rank's slice of dy, no collective); not with sequence_parallel (Megatron's rule: sequence-parallel output goes to a
    row-parallel layer).
    `input_ready=True`: the caller has already placed the input's collective (`parallel.tp.mappings.EnterRegion`,
    one copy or gather shared by the region's layers, e.g. gate and up of an FFN or MLA's q_b and kv_b).
    """
    split_axis = 0

    def __init__(self, in_features: int, out_features: int, tp_transport, init_std: float, dtype=ms.float32,
                 sequence_parallel: bool = False, gather_output: bool = False, seed: int = 0,
                 full_weight: np.ndarray | None = None, input_ready: bool = False):
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output with sequence_parallel (the output of a "
                             "sequence-parallel column layer is a row-parallel layer's input)")
        super().__init__(in_features, out_features, tp_transport, init_std, dtype, seed, full_weight)
        self.sequence_parallel, self.gather_output = sequence_parallel, gather_output
        self.input_ready = input_ready
        self.copy = CopyToGroup(tp_transport)
        self.seq_gather = GatherFromGroup(tp_transport)
        self.out_gather = GatherReplicated(tp_transport)

    def construct(self, x):
        if not self.input_ready:
            x = x.astype(self.compute_dtype)      # the collective moves what the matmul takes
            if self.sequence_parallel:
                x = seq_first(self.seq_gather(seq_first(x)))
            else:
                x = self.copy(x)
        y = self._local(x)
        if self.gather_output:
            shape = y.shape
            flat = y.reshape(-1, self.local_out)
            full = self.out_gather(ops.transpose(flat, (1, 0)))        # [out, M]: the shards in rank order
            y = ops.transpose(full, (1, 0)).reshape(shape[:-1] + (self.out_features,))
        return y


class RowParallelLinear(_ShardedLinear):
    """y = x W^T with W [out, in] split by columns: this rank holds columns [r*in/tp, (r+1)*in/tp) and its input is
    the matching [..., in/tp] shard (a `ColumnParallelLinear`'s output).

    Forward: the local matmul (a partial sum of every output feature) then `ReduceFromGroup`'s all-reduce: the full
    [..., out] on every rank. Backward: identity (dy is the same on every rank), then the local matmul.
    `sequence_parallel=True`: `ReduceScatterToGroup` over the sequence instead: each rank gets the summed [b, s/tp,
    out] of its sequence positions; its backward all-gathers dy over the sequence.
    """
    split_axis = 1

    def __init__(self, in_features: int, out_features: int, tp_transport, init_std: float, dtype=ms.float32,
                 sequence_parallel: bool = False, seed: int = 0, full_weight: np.ndarray | None = None):
        super().__init__(in_features, out_features, tp_transport, init_std, dtype, seed, full_weight)
        self.sequence_parallel = sequence_parallel
        self.reduce = ReduceFromGroup(tp_transport)
        self.seq_scatter = ReduceScatterToGroup(tp_transport)

    def construct(self, x):
        y = self._local(x)
        if self.sequence_parallel:
            return seq_first(self.seq_scatter(seq_first(y)))
        return self.reduce(y)


class VocabParallelEmbedding(nn.Cell):
    """Token embedding with the table [vocab, hidden] split by rows: this rank holds the rows of tokens
    [r*V/tp, (r+1)*V/tp).

    Forward: each rank looks its tokens up in its rows, tokens outside them give zeros, and `ReduceFromGroup`'s
    all-reduce sums the ranks' parts: every token's row on every rank. Backward: identity, then the lookup's
    scatter-add into this rank's rows (zero for the tokens it does not hold).
    `sequence_parallel=True`: `ReduceScatterToGroup` over the sequence instead (ids [b, s] -> [b, s/tp, hidden], the
    input of a sequence-parallel column layer); backward all-gathers dy over the sequence.
    """

    def __init__(self, vocab_size: int, hidden: int, tp_transport, init_std: float, sequence_parallel: bool = False,
                 seed: int = 0, full_weight: np.ndarray | None = None):
        super().__init__()
        self.tp, self.rank = _tp_of(tp_transport)
        full = full_normal((vocab_size, hidden), init_std, seed) if full_weight is None else full_weight
        if tuple(full.shape) != (vocab_size, hidden):
            raise ValueError(f"VocabParallelEmbedding: full table of shape {tuple(full.shape)}, expected "
                             f"{(vocab_size, hidden)}")
        self.vocab_start, self.vocab_end = shard_range(vocab_size, self.tp, self.rank, "vocab_size")
        self.weight = Parameter(Tensor(self.shard_of(full, self.tp, self.rank)), name="weight")
        self.sequence_parallel = sequence_parallel
        self.reduce = ReduceFromGroup(tp_transport)
        self.seq_scatter = ReduceScatterToGroup(tp_transport)

    @staticmethod
    def shard_of(full: np.ndarray, tp: int, rank: int) -> np.ndarray:
        """This rank's rows of the full [vocab, hidden] table (or of its gradient)."""
        begin, end = shard_range(full.shape[0], tp, rank, "vocab_size")
        return np.ascontiguousarray(np.asarray(full, np.float32)[begin:end])

    @classmethod
    def from_full(cls, full: np.ndarray, tp_transport, **kwargs):
        vocab_size, hidden = full.shape
        return cls(vocab_size, hidden, tp_transport, 0.0, full_weight=np.asarray(full, np.float32), **kwargs)

    def construct(self, ids):
        outside = ops.logical_or(ids < self.vocab_start, ids >= self.vocab_end)
        local = ops.select(outside, ops.zeros_like(ids), ids - self.vocab_start)
        rows = ops.gather(self.weight, local, 0)
        rows = rows * ops.logical_not(outside).astype(rows.dtype).expand_dims(-1)
        if self.sequence_parallel:
            return seq_first(self.seq_scatter(seq_first(rows)))
        return self.reduce(rows)


class VocabParallelCrossEntropy(nn.Cell):
    """Masked mean cross-entropy of logits split over the vocabulary, no rank ever holding a full row of logits.

    `construct(logits, labels, mask)`: logits [..., V/tp] (this rank's vocabulary columns [r*V/tp, (r+1)*V/tp), e.g.
    a `ColumnParallelLinear` head's output), labels and mask of the leading shape (mask 1 for counted tokens), the
    same on every rank. Returns sum(mask * (logsumexp(logits) - logits[label])) / max(sum(mask), 1), the same on
    every rank and equal to the plain cross-entropy over the full vocabulary.

    Forward: each token's maximum over the vocabulary from the ranks' maxima (`GatherFromGroup`: N values per rank;
    a shift only, outside the gradient, since the loss does not depend on it), the sum of exp(logit - max) over the
    vocabulary (local sum, then `ReduceFromGroup`'s all-reduce) and the label's logit (picked by the rank holding it,
    zero elsewhere, then the same all-reduce). Backward: no collective (both all-reduces pass the replicated gradient
    through), so each rank's logits get softmax - onehot over its own columns, times mask / count.
    """

    def __init__(self, tp_transport):
        super().__init__()
        self.tp, self.rank = _tp_of(tp_transport)
        self.gather = GatherFromGroup(tp_transport)
        self.reduce_sum_exp = ReduceFromGroup(tp_transport)
        self.reduce_target = ReduceFromGroup(tp_transport)

    def construct(self, logits, labels, mask):
        width = logits.shape[-1]
        logits = logits.reshape(-1, width).astype(ms.float32)
        labels = labels.reshape(-1)
        mask = mask.reshape(-1).astype(ms.float32)
        local_max = ops.stop_gradient(ops.amax(logits, -1))
        shift = ops.stop_gradient(ops.amax(self.gather(local_max).reshape(self.tp, -1), 0))
        shifted = logits - shift.expand_dims(-1)
        sum_exp = self.reduce_sum_exp(ops.exp(shifted).sum(-1))
        start = self.rank * width
        outside = ops.logical_or(labels < start, labels >= start + width)
        local = ops.select(outside, ops.zeros_like(labels), labels - start)
        picked = ops.gather_elements(shifted, 1, local.expand_dims(-1)).squeeze(-1)
        target = self.reduce_target(picked * ops.logical_not(outside).astype(ms.float32))
        per_token = ops.log(sum_exp) - target
        return (per_token * mask).sum() / ops.maximum(mask.sum(), 1.0)


def vocab_parallel_cross_entropy(logits_shard, labels, mask, cross_entropy: VocabParallelCrossEntropy):
    """The masked mean loss of `VocabParallelCrossEntropy` (built once per group, e.g. in a model's __init__):
    `vocab_parallel_cross_entropy(logits_shard [N, V/tp], labels [N], mask [N], self.cross_entropy)`."""
    return cross_entropy(logits_shard, labels, mask)
