"""The distributed optimizer's two graph-mode halves (ZeRO-1, after Megatron-Core's DistributedOptimizer; the plan of
buckets is `buckets.py`):

- `ShardedGradients`: the step's gradients cast to float32 and laid end to end per bucket (with what earlier
  micro-batches accumulated in the float32 bucket buffers), each bucket reduce-scattered over its group, so a rank
  keeps the summed gradient of its slice only; the global norm from the slices' squares; the factor that unscales,
  averages and clips. The same contract as the replicated `PrepareGradients`: (gradients, factor, norm, finite).
- `ShardedAdamW`: AdamW on this rank's slices only (the float32 master weights, which float32 weights are
  themselves, and both moments), then each bucket's updated slice all-gathered over its group and written back
  into the working weights in their dtype (float32, or float16 / bfloat16 with a float32 master slice).

On CPU the transports' reduce-scatter and all-gather are emulations made of mccl's AllReduce with the real
contract (parallel/comm/transport.py); on Ascend they are HCCL's ReduceScatter and AllGather on the same groups.
Each bucket's collective is a Cell of its own (`_BucketComm`), so a bucket's reduction depends only on its own
gradients: the graph compiler may start it as soon as the backward has produced them. The reductions are issued
in the order the backward completes the buckets (`BucketPlan.backward_order`), the order in which a communication
stream that runs collectives as issued can overlap each with the rest of the backward
(docs/distributed-optimizer.md, "Overlap with the backward"). Each collective's input depends on the one issued
before it: the ranks of a group compile graphs that differ slightly (a norm mask where a rank's slice holds a
parameter counted on another stage), and without that chain the compiler may order independent collectives
differently on two ranks of one group, which then exchange mismatched buffers (measured: pp=2 x dp=2 on CPU,
"RunRingAllReduce Memcpy error"). The chain orders only the collectives, never the backward's compute.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from dvm_fusion.adamw import adamw_hyper, adamw_slice_update_cpu, adamw_update_cpu
from parallel.optim.buckets import BucketPlan


class _BucketComm(nn.Cell):
    """One bucket's collectives: sum over `pre` first (or not), reduce-scatter / all-gather over `shard`."""

    def __init__(self, shard, pre=None):
        super().__init__()
        self.shard, self.pre = shard, pre

    def construct(self, flat):
        if self.pre is not None:
            flat = self.pre.all_reduce(flat)
        return self.shard.reduce_scatter(flat)

    def gather(self, piece):
        return self.shard.all_gather(piece)


class _NormPart(nn.Cell):
    """The squares of the buckets `members` (one shard group, one norm group), summed over both groups."""

    def __init__(self, members: tuple, shard, over=None):
        super().__init__()
        self.members = members
        self.shard, self.over = shard, over

    def construct(self, each):
        s = ops.zeros((), ms.float32)
        for b in self.members:
            s = s + each[b]
        s = self.shard.all_reduce(s)
        if self.over is not None:
            s = self.over.all_reduce(s)
        return s


def _uncounted_masks(plan: BucketPlan, counted: list[bool], index: dict[str, int]) -> dict[int, np.ndarray]:
    """Per bucket holding an uncounted parameter: 1 on this rank's slice's counted elements, 0 elsewhere."""
    out = {}
    for piece in plan.pieces(index):
        if not counted[piece.param]:
            mask = out.setdefault(piece.bucket, np.ones(plan.buckets[piece.bucket].shard_size, np.float32))
            mask[piece.offset:piece.offset + piece.length] = 0.0
    return out


class ShardedGradients(nn.Cell):
    """See the module docstring. `transports`: name -> transport of every group the plan's routes name; `dp`: the
    divisor of the summed gradients (the loss is each data-parallel rank's mean); `clip` the global norm's bound
    (<= 0: none); `pp` the pipeline group's transport, whose stages' squares the norm adds, or None;
    `accumulate`: hold float32 bucket buffers that `accumulate` adds micro-batches' gradients into."""

    def __init__(self, plan: BucketPlan, transports: dict, dp: int, clip: float, pp=None, accumulate: bool = False,
                 counted: list[bool] | None = None):
        super().__init__(auto_prefix=False)
        self.members = tuple(b.params for b in plan.buckets)
        self.pads = tuple(b.padded - b.numel for b in plan.buckets)
        # reductions issued in the order the backward completes the buckets; `position[b]`: bucket b's among them
        self.issue = plan.backward_order()
        self.position = tuple(self.issue.index(b) for b in range(len(plan.buckets)))
        self.comms = nn.CellList([_BucketComm(transports[b.route.shard],
                                              transports[b.route.pre_sum] if b.route.pre_sum else None)
                                  for b in plan.buckets])
        pairs: dict[tuple, list[int]] = {}
        for i, b in enumerate(plan.buckets):
            pairs.setdefault((b.route.shard, b.route.norm_sum), []).append(i)
        self.norm_parts = nn.CellList([_NormPart(tuple(idx), transports[shard], transports[over] if over else None)
                                       for (shard, over), idx in pairs.items()])
        # a parameter the norm does not count (a copy counted elsewhere): its elements masked out of the squares
        masks = _uncounted_masks(plan, counted, {n: t.group.index if t.group.size > 1 else 0
                                                 for n, t in transports.items()}) if counted else {}
        self.masks = tuple(Tensor(masks[b]) if b in masks else None for b in range(len(plan.buckets)))
        self.grad_buffers = ParameterTuple([Parameter(Tensor(np.zeros(b.padded, np.float32)), name=f"grad_buffer.{i}",
                                                 requires_grad=False) for i, b in enumerate(plan.buckets)]) \
            if accumulate else None
        self.stages, self.dp, self.clip = pp, dp, clip

    def flatten(self, grads, b: int):
        """Bucket b's gradients in float32, end to end, padded."""
        parts = ()
        for i in self.members[b]:
            parts = parts + (grads[i].astype(ms.float32).reshape((-1,)),)
        if self.pads[b]:
            parts = parts + (ops.zeros((self.pads[b],), ms.float32),)
        return ops.concat(parts)

    def accumulate(self, grads):
        """Adds one micro-batch's gradients into the float32 bucket buffers."""
        for b in range(len(self.members)):
            ops.assign_add(self.grad_buffers[b], self.flatten(grads, b))
        return self.grad_buffers[0][:1] * 0

    def construct(self, grads, grad_scale):
        """-> (this rank's summed slice of each bucket, the factor to multiply them by, the global norm, finite).
        The sums over ranks are linear, so the unscaling, the division by dp and the clipping are one factor
        applied inside the update."""
        issued = ()
        for i in range(len(self.issue)):
            b = self.issue[i]
            flat = self.flatten(grads, b)
            if self.grad_buffers is not None:
                flat = flat + self.grad_buffers[b]
                ops.assign(self.grad_buffers[b], ops.zeros_like(flat))
            if i > 0:   # every rank of a group issues its collectives in one order (module docstring)
                flat = ops.depend(flat, issued[i - 1])
            issued = issued + (self.comms[b](flat),)
        shards = ()
        for b in range(len(self.members)):
            shards = shards + (issued[self.position[b]],)
        each = ()
        for b in range(len(self.members)):
            s = shards[b] if self.masks[b] is None else shards[b] * self.masks[b]
            each = each + ((s * shards[b]).sum().reshape((1,)),)
        each = ops.concat(each)
        squares = ops.zeros((), ms.float32)
        for part in self.norm_parts:
            squares = squares + part(ops.depend(each, squares))
        if self.stages is not None:
            squares = self.stages.all_reduce(squares)
        factor, norm, finite = clip_factor(squares, grad_scale, self.dp, self.clip)
        return shards, factor, norm, finite


def clip_factor(squares, grad_scale, dp: int, clip: float):
    """(factor, norm, finite) from the summed squares of the scaled, summed gradients: the factor that unscales
    them (loss scale and the mean over `dp` ranks) and clips the global norm to `clip` (0: no clipping)."""
    unscale = grad_scale / dp
    norm = ops.sqrt(squares) * unscale
    factor = clip / ops.maximum(norm, clip) * unscale if clip > 0 else unscale
    return factor, norm, ops.isfinite(norm)


class ShardedAdamW(nn.Cell):
    """AdamW (torch.optim.AdamW's update) on this rank's slices, then the working weights all-gathered back.

    `params`: the working weights in the plan's parameter order; `transports[name].group.index`: this rank's
    position in each shard group. Float32 weights are their own master, as in Megatron-Core: the rank steps the
    elements of its slice in place (CPU: dvm_fusion's AdamWSlice kernel) and the all-gather brings the others'.
    Below float32 (float16 / bfloat16) a float32 master slice per bucket is held and stepped, and the gathered
    master is cast into the weights. `global_step` and `learning_rate` keep the replicated optimizer's names, so
    checkpoints of either load into the other. `fused`: the CPU kernels, else the update as MindSpore ops (Ascend)."""

    def __init__(self, params: list, plan: BucketPlan, transports: dict, learning_rate: float, betas, eps: float,
                 fused: bool, threads: int = 1):
        super().__init__(auto_prefix=False)
        self.plan = plan
        self.parameters = ParameterTuple(params)
        self.members = tuple(b.params for b in plan.buckets)
        self.starts = tuple(b.starts for b in plan.buckets)
        self.pads = tuple(b.padded - b.numel for b in plan.buckets)
        self.shapes = tuple(tuple(p.shape) for p in params)
        self.sizes = tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)
        self.dtypes = tuple(p.dtype for p in params)
        self.index = {name: t.group.index if t.group.size > 1 else 0 for name, t in transports.items()}
        self.comms = nn.CellList([_BucketComm(transports[b.route.shard]) for b in plan.buckets])
        self.lo = tuple(self.shard_index(b) * bucket.shard_size for b, bucket in enumerate(plan.buckets))
        self.his = tuple(lo + b.shard_size for lo, b in zip(self.lo, plan.buckets))
        self.lo_tensors = tuple(Tensor([lo], ms.int64) for lo in self.lo)
        slices = [self._slice_of(params, b) for b in range(len(plan.buckets))]
        self.master = ParameterTuple([Parameter(Tensor(m), name=f"master.{b}", requires_grad=False)
                                      for b, m in enumerate(slices)]) \
            if any(d != ms.float32 for d in self.dtypes) else None
        self.exp_avg = ParameterTuple([Parameter(Tensor(np.zeros_like(m)), name=f"adam_m.{b}", requires_grad=False)
                                       for b, m in enumerate(slices)])
        self.exp_avg_sq = ParameterTuple([Parameter(Tensor(np.zeros_like(m)), name=f"adam_v.{b}",
                                                    requires_grad=False) for b, m in enumerate(slices)])
        decays = np.array([b.route.weight_decay for b in plan.buckets], np.float32)
        self.weight_decays = Tensor(decays)
        self.bucket_decays = tuple(Tensor(decays[b:b + 1]) for b in range(len(decays)))
        self.learning_rate = Parameter(Tensor(learning_rate, ms.float32), name="learning_rate", requires_grad=False)
        self.global_step = Parameter(Tensor([0], ms.int32), name="global_step", requires_grad=False)
        self.beta1, self.beta2 = Tensor(float(betas[0]), ms.float32), Tensor(float(betas[1]), ms.float32)
        self.eps = Tensor(float(eps), ms.float32)
        self.fused = fused
        self.threads = Tensor(threads, ms.float32)

    def shard_index(self, b: int) -> int:
        return self.index[self.plan.buckets[b].route.shard]

    def _slice_of(self, params, b: int) -> np.ndarray:
        """This rank's slice of bucket b's weights (float32), from the weights' values."""
        bucket = self.plan.buckets[b]
        flat = np.zeros(bucket.padded, np.float32)
        for p, start in zip(bucket.params, bucket.starts):
            flat[start:start + self.sizes[p]] = params[p].asnumpy().astype(np.float32).reshape(-1)
        lo = self.shard_index(b) * bucket.shard_size
        return flat[lo:lo + bucket.shard_size]

    def weights_slice(self, b: int):
        """This rank's slice of bucket b's working weights, in float32, inside the graph."""
        parts = ()
        for p in self.members[b]:
            parts = parts + (self.parameters[p].astype(ms.float32).reshape((-1,)),)
        if self.pads[b]:
            parts = parts + (ops.zeros((self.pads[b],), ms.float32),)
        return ops.concat(parts)[self.lo[b]:self.his[b]]

    def corrections(self):
        step = self.global_step.astype(ms.float32)
        return 1.0 - ops.pow(self.beta1, step), ops.sqrt(1.0 - ops.pow(self.beta2, step))

    def construct(self, shards, factor, finite):
        ops.assign_add(self.global_step, finite.astype(ms.int32))
        bc1, root_bc2 = self.corrections()
        if self.fused:
            hyper = adamw_hyper(self.learning_rate, self.beta1, self.beta2, self.eps, factor, bc1, root_bc2,
                                self.threads, finite)
        status = ops.zeros((1,), ms.float32)
        gathered = status
        if self.fused and self.master is not None:      # every bucket's master slice in one call
            status = adamw_update_cpu(self.master, self.exp_avg, self.exp_avg_sq, shards, hyper, self.weight_decays)
        for b in range(len(self.members)):
            if self.fused:
                if self.master is None:
                    held = ()
                    for p in self.members[b]:
                        held = held + (self.parameters[p],)
                    done = adamw_slice_update_cpu(held, self.exp_avg[b], self.exp_avg_sq[b], shards[b], hyper,
                                                  self.bucket_decays[b], self.lo_tensors[b])
                    new = ops.depend(self.weights_slice(b), done)
                else:
                    new = ops.depend(self.master[b], status)
            else:
                new = self.step_slice(b, shards[b] * factor, finite, bc1, root_bc2)
            # the all-gathers in one order on every rank, as the reduce-scatters
            gathered = self.comms[b].gather(ops.depend(new, gathered))
            self.write_back(b, gathered)
        return status

    def step_slice(self, b: int, grad, finite, bc1, root_bc2):
        """Bucket b's slice stepped as MindSpore ops (torch.optim.AdamW's order), its moments (and master) assigned
        where the step is finite; -> the new slice of the weights in float32."""
        p = self.weights_slice(b) if self.master is None else self.master[b]
        lr = self.learning_rate
        m = self.beta1 * self.exp_avg[b] + (1.0 - self.beta1) * grad
        v = self.beta2 * self.exp_avg_sq[b] + (1.0 - self.beta2) * grad * grad
        stepped = p * (1.0 - lr * self.bucket_decays[b]) - lr / bc1 * m / (ops.sqrt(v) / root_bc2 + self.eps)
        new = ops.select(finite, stepped, p)
        ops.assign(self.exp_avg[b], ops.select(finite, m, self.exp_avg[b]))
        ops.assign(self.exp_avg_sq[b], ops.select(finite, v, self.exp_avg_sq[b]))
        if self.master is not None:
            ops.assign(self.master[b], new)
        return new

    def write_back(self, b: int, whole):
        """The gathered bucket into its weights, in their dtypes."""
        for j in range(len(self.members[b])):
            p = self.members[b][j]
            start = self.starts[b][j]
            value = whole[start:start + self.sizes[p]].reshape(self.shapes[p]).astype(self.dtypes[p])
            ops.assign(self.parameters[p], value)
