"""Single-process emulations of each parallel dimension's arithmetic, for the alignment harness.

Until the real tensor-, sequence-, pipeline- and expert-parallel paths run (they need Ascend), these reproduce
what those paths compute differently from a plain run, inside one process:

    TP  RowParallelLinear: input features split over tp ranks, partial products summed (the all-reduce)
    SP  sharded_rope_tables: each sequence shard takes RoPE tables at its own global positions
    PP  pipeline_step: the pipeline's own arithmetic, parallel/pipeline/replay.py's executor: the model cut into
        p stages x v chunks, the schedule's actions in its order, activations stored for the backward, each
        stage's gradients accumulated over the micro-batches (`Accumulator.add`)
    EP  ExpertParallelDispatcher: tokens sent to expert-parallel ranks, sorted by local expert there, combine
        weights travelling with the tokens and applied on the expert side
    DP  all_reduce_mean / all_gather_batch: the real collectives, for runs under msrun

Each piece is written so that a broken variant is one overridden method (a test injects a fault by subclassing),
never a flag in the correct code.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Sequence

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from parallel.ep.permute import expert_group_sizes, stable_order
from parallel.pipeline.replay import Accumulator, ReplayResult, replay
from parallel.pipeline.schedules import Schedule
from precision.capture import ForwardCapture


def swap_cell(root: nn.Cell, path: str, new_cell: nn.Cell) -> nn.Cell:
    """Replace the sub-Cell at dotted `path` of `root` by `new_cell`, keeping every parameter's name (MindSpore
    renames parameters that move under a new prefix, which would break alignment by name). Returns the old one."""
    names = {id(p): p.name for p in root.get_parameters()}
    parent_path, _, attr = path.rpartition(".")
    parent = dict(root.cells_and_names())[parent_path] if parent_path else root
    old = getattr(parent, attr)
    setattr(parent, attr, new_cell)
    for p in root.get_parameters():
        if id(p) in names:
            p.name = names[id(p)]
    return old


# ---- TP ------------------------------------------------------------------------------------------------
class RowParallelLinear(nn.Cell):
    """y = x W^T for W [out, in] (the Linear layout), computed as tp partial sums over slices of the input
    features, as a row-parallel layer does on tp ranks before its all-reduce."""

    def __init__(self, weight: Parameter, tp: int, compute_dtype=ms.float32):
        super().__init__(auto_prefix=False)
        if weight.shape[1] % tp:
            raise ValueError(f"tp: {tp} does not divide the {weight.shape[1]} input features of {weight.name}")
        self.weight = weight
        self.tp = tp
        self.shard = weight.shape[1] // tp
        self.compute_dtype = compute_dtype
        self.matmul = ops.MatMul(transpose_b=True)

    def all_reduce(self, partials: list) -> Tensor:
        """The tensor-parallel all-reduce: a sum of the ranks' partial products."""
        total = partials[0]
        for part in partials[1:]:
            total = total + part
        return total

    def construct(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).astype(self.compute_dtype)
        w = self.weight.astype(self.compute_dtype)
        partials = [self.matmul(flat[:, r * self.shard:(r + 1) * self.shard], w[:, r * self.shard:(r + 1) * self.shard])
                    for r in range(self.tp)]
        return self.all_reduce(partials).reshape(shape[:-1] + (self.weight.shape[0],))


# ---- SP ------------------------------------------------------------------------------------------------
def sequence_shard_positions(seq_len: int, shards: int) -> list[np.ndarray]:
    """Global positions held by each of `shards` contiguous sequence shards."""
    if seq_len % shards:
        raise ValueError(f"shards: {shards} does not divide the sequence length {seq_len}")
    local = seq_len // shards
    return [np.arange(r * local, (r + 1) * local, dtype=np.int32) for r in range(shards)]


def sharded_rope_tables(cos_table: Tensor, sin_table: Tensor, shard_positions: Sequence[np.ndarray]):
    """cos/sin rows for the whole sequence, gathered shard by shard at each shard's positions: what the
    sequence-parallel ranks apply, concatenated."""
    cos = ops.cat([ops.gather(cos_table, Tensor(p), 0) for p in shard_positions], 0)
    sin = ops.cat([ops.gather(sin_table, Tensor(p), 0) for p in shard_positions], 0)
    return cos, sin


# ---- PP ------------------------------------------------------------------------------------------------
@contextmanager
def unhooked(capture: ForwardCapture):
    """`capture` (entered) with its hooks off for the duration; what it recorded so far stays."""
    capture.__exit__(None, None, None)
    try:
        yield
    finally:
        capture.__enter__()


def pipeline_step(schedule: Schedule, chunks: Sequence, loss_fn: Callable, microbatches: Sequence[tuple],
                  capture: ForwardCapture, accumulator: Accumulator | None = None) -> ReplayResult:
    """One step's loss and accumulated gradients through the pipeline replay executor (chunks, loss_fn and
    micro-batches as replay() takes them). The backward re-runs each chunk's forward; `capture` is unhooked
    there, so that it records every forward pass once, micro-batches joined in order as in a plain step."""
    return replay(schedule, chunks, loss_fn, microbatches, accumulator, recompute=lambda: unhooked(capture))


# ---- EP ------------------------------------------------------------------------------------------------
class ExpertParallelDispatcher(nn.Cell):
    """Dropless dispatch over `ep` expert-parallel ranks (experts split contiguously), with the dispatcher
    interface of telechat_moe/moe/dispatch.py: dispatch(x, indices, weights) -> (tokens sorted by expert, group
    sizes, state); combine(expert_out, state) -> weighted sum per token; sent_rows(state) -> rows exchanged.

    Dispatch is two permutations, as the All-to-All path does: token copies grouped by destination rank in
    token order (the send), then sorted by local expert on each rank (the receive). Combine applies the routing
    weights on the expert side, in dispatch order (the weights travel with the tokens), sends the rows back to
    token order and sums each token's k copies."""

    def __init__(self, num_experts: int, top_k: int, ep: int):
        super().__init__()
        if num_experts % ep:
            raise ValueError(f"ep: {ep} does not divide the {num_experts} experts")
        self.num_experts, self.top_k, self.ep = num_experts, top_k, ep
        self.per_rank = num_experts // ep

    def dispatch(self, x, indices, weights):
        flat_expert = indices.reshape(-1)
        send = stable_order(flat_expert // self.per_rank)
        receive = stable_order(ops.gather(flat_expert, send, 0))
        order = ops.gather(send, receive, 0)
        tokens = ops.gather(x, order // self.top_k, 0)
        return tokens, expert_group_sizes(flat_expert, self.num_experts), (order, weights)

    def sent_rows(self, state):
        """Rows the exchange moves (the step log's count): every token copy, as the exact exchange sends them."""
        return ops.ones_like(state[0]).astype(ms.float32).sum()

    def weights_in_dispatch_order(self, weights, order):
        """The routing weight of each dispatched row: the weights are permuted exactly as the tokens were."""
        return ops.gather(weights.reshape(-1), order, 0)

    def combine(self, expert_out, state):
        order, weights = state
        t, k = weights.shape
        weighted = expert_out * ops.expand_dims(self.weights_in_dispatch_order(weights, order), -1).astype(
            expert_out.dtype)
        inverse = ops.sort(order.astype(ms.float32))[1]  # dispatch row of each (token, slot)
        return ops.gather(weighted, inverse, 0).reshape(t, k, -1).sum(1)


# ---- DP (real collectives, under msrun) -----------------------------------------------------------------
def all_reduce_mean(values: Sequence[Tensor], world: int) -> list[Tensor]:
    """Data-parallel gradient averaging over the world group."""
    reduce = ops.AllReduce()
    return [reduce(v) / world for v in values]


def all_gather_batch(value: np.ndarray) -> np.ndarray:
    """Concatenate every rank's `value` along axis 0, in rank order (AllGather: the world group on CPU)."""
    return ops.AllGather()(Tensor(value)).asnumpy()
