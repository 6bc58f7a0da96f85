"""Pipeline parallelism in the trainer (`pipeline_stage > 1`): the model cut into p x v chunks by the placement MILP,
this rank's stage built and run by `parallel.pipeline.executor` over the schedule of the recipe
(`parallel_config.pipeline_scheduler`: 1f1b, which is interleaved 1F1B when pp_interleave_num > 1, gpipe, or
dualpipev: DeepSeek's DualPipeV, pp_interleave_num 2 in a V), then one graph that reduces, clips and applies the
accumulated gradients.

- Placement: `balance` (parallel/pipeline/placement.py) over the planner's units of the recipe's model on the
  cluster that prices this machine (`clusters/cpu.yaml` on CPU, ascend910b on Ascend): segment k = chunk k // p of
  stage k % p (under dualpipev the V: segments k and 2p-1-k on stage k, so stage 0 holds the embedding and the
  head, and MTP reads the one embedding table there); the embedding is in the first segment, the final norm, head and MTP in the last, and any segment may
  hold any number of layers (also none).
- Chunk k: `StageChunk`, (input, labels, loss mask, segments, positions) -> (activation, loss part, stats): the
  embedding first on chunk 0, its decoder layers, and on the last chunk the tail and the losses. A chunk's own
  auxiliary and z losses are its loss part (their gradients stay on its stage); the last chunk's is the whole
  LM + MTP loss with its own auxiliary terms. Stats: the loss parts (total, lm, mtp, aux, z) and the routing
  statistics of the chunk's routers, which the trainer sums over chunks, micro-batches and ranks.
- MTP looks up the embedding of the next tokens on the last stage: that stage holds a copy of the embedding table
  (same seed and name, so it starts equal), and the two copies' gradients are summed over the pair (first stage,
  last stage) before the update, so they stay equal; the norm counts it once (the first stage's).
- The gradient norm adds every stage's squares over the pipeline group.
- Every step checks that the stage ran its actions in the schedule's order and held no more activations than the
  validator allows (the executor records both).
- Recompute: the executor runs each chunk's forward once per micro-batch and its backward from what that forward
  kept (MindSpore's PyNative autograd over the compiled chunk), so a layer's forward runs again only where
  recompute_config marks it (selective or full), inside the chunk's graph, as in one process.
- Tensor dumps: the chunks' layer outputs come from a forward-only pass through the pipeline before the step
  (`layer_outputs`), the reduced gradients from the update (`return_grads`); the trainer puts the stages together.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import mindspore as ms
from mindspore import ParameterTuple, nn, ops

from parallel.comm import AllReduce, ProcessGroups, transport_for
from parallel.layout import Axis
from parallel.pipeline.executor import PipelineExecutor, PipelineResult
from parallel.pipeline.schedules import ChunkLayout, build, validate
from telechat_moe.model import StageParts, TeleChatMoE
from telechat_moe.moe.layer import ROUTING_STATS


LOSS_PARTS = 5      # total, lm, mtp, aux, z


@dataclass(frozen=True)
class StagePlan:
    """Layers [start, end) of each chunk k (= segment k of the placement), this rank's stage, and which segments
    a stage holds (DualPipeV's V: segments k and 2p-1-k on stage k)."""
    bounds: tuple[tuple[int, int], ...]
    stages: int
    chunks: int
    stage: int
    description: str
    chunk_layout: ChunkLayout = ChunkLayout.INTERLEAVED

    def mine(self) -> list[int]:
        return [self.chunk_layout.virtual_stage(self.stages, self.stage, c) for c in range(self.chunks)]

    def parts(self, mtp: bool) -> StageParts:
        last = self.stages * self.chunks - 1
        layers = frozenset(i for k in self.mine() for i in range(*self.bounds[k]))
        first_here, last_here = 0 in self.mine(), last in self.mine()
        return StageParts(layers, first_here or (last_here and mtp), last_here)


def stage_plan(recipe, rank: int) -> StagePlan:
    """The placement MILP's cut of the recipe's model for its layout (see the module docstring)."""
    from telechat_moe.workload import recipe_placement
    placement = recipe_placement(recipe)
    bounds, at = [], 0
    for seg in placement.segments:
        n = sum(u.kind in ("dense", "moe") for u in seg)
        bounds.append((at, at + n))
        at += n
    stage = sorted(recipe.layout.group_of(Axis.PP, rank)).index(rank)
    return StagePlan(tuple(bounds), placement.stages, placement.chunks, stage, placement.describe(),
                     placement.chunk_layout)


def activation_positions(recipe) -> int:
    """The positions of a sequence that a stage's activation holds, and so the next stage's receive buffer: the
    rank's context-parallel shard, cut again over tp under sequence parallelism. (A buffer of the whole sequence
    under cp made the receiver wait for the rest of a message that never came.)"""
    lay = recipe.layout
    return recipe.model.seq_length // lay.cp // (lay.tp if recipe.parallel_config.use_seq_parallel and lay.tp > 1
                                                 else 1)


def reuse_layers(recipe, plan: StagePlan | None) -> bool:
    """Whether the decoder layers share one compiled graph per kind (context.lazy_inline). Not under pp x ep where a
    chunk holds two layers or more (MTP's block counts on the last): the expert exchange's sizes depend on the data,
    and under the executor's PyNative autograd such a chunk met the other layer's size in its backward
    ("UnsortedSegmentSum: segment_ids value should be [0, 505)" at step 1, pp2 x dp2 x ep2); with a graph per layer
    it trains (docs/pipeline.md)."""
    if plan is None or recipe.layout.ep == 1:
        return recipe.context.lazy_inline
    last = len(plan.bounds) - 1
    mtp = recipe.model.num_nextn_predict_layers
    crowded = any(end - start + (mtp if k == last else 0) > 1 for k, (start, end) in enumerate(plan.bounds))
    return recipe.context.lazy_inline and not crowded


class StageChunk(nn.Cell):
    """Chunk k on its stage (see the module docstring)."""

    def __init__(self, model: TeleChatMoE, start: int, end: int, first: bool, last: bool):
        super().__init__(auto_prefix=False)
        self.model, self.start, self.end, self.first, self.last = model, start, end, first, last
        self.zero = ms.Tensor(0.0, ms.float32)

    def construct(self, x, labels, loss_mask, segment_ids, position_ids):
        m = self.model
        cos, sin = m.rope(position_ids)
        bias = m.attention_mask(segment_ids)
        h = m.embed(x) if self.first else x
        h, aux, z, loads = m.run_layers(h, cos, sin, bias, self.start, self.end)
        aux, z = self.zero + aux, self.zero + z
        if self.last:
            if len(loads) == 0 and len(m.mtp) == 0:
                # head_losses stacks the routers' statistics (each MTP block adds its own): one zero row, which no
                # router reads
                loads = [ops.zeros(m.cfg.n_routed_experts + ROUTING_STATS, ms.float32)]
            total, lm, mtp, aux, z, stacked = m.head_losses(h, labels, loss_mask, cos, sin, bias, aux, z, loads)
            parts = ops.stack((total, lm, mtp, aux, z))
            return self.zero, total, ops.stop_gradient(ops.concat((parts, stacked.reshape(-1))))
        total = aux + z
        parts = ops.stack((total, self.zero, self.zero, aux, z))
        if len(loads) > 0:
            parts = ops.concat((parts, ops.stack(loads).reshape(-1)))
        return h, total, ops.stop_gradient(parts)


class LayerOutputsChunk(StageChunk):
    """Chunk k for a tensor dump, run forward-only: (the stream for the next chunk, zero, its `chunk_outputs`
    stacked [outputs, b, s', h]; a chunk without outputs, a middle one with no layers, returns its input once,
    which nobody reads)."""

    def construct(self, x, labels, loss_mask, segment_ids, position_ids):
        m = self.model
        cos, sin = m.rope(position_ids)
        h, outs = m.chunk_outputs(x, cos, sin, m.attention_mask(segment_ids), self.start, self.end, self.first,
                                  self.last)
        if len(outs) == 0:
            return h, self.zero, ops.expand_dims(h, 0)
        return h, self.zero, ops.stack(outs)


def chunk_output_count(bounds, k: int) -> int:
    """How many `chunk_outputs` chunk k of a cut with these layer bounds has (embedding, two per layer, norm)."""
    start, end = bounds[k]
    return 2 * (end - start) + (k == 0) + (k == len(bounds) - 1)


def router_index(model: TeleChatMoE, start: int, end: int, last: bool) -> list[int]:
    """The global router indices (the model's expert-load order: MoE layers, then MTP) of a chunk's routers."""
    moe = [i for i in range(model.cfg.num_hidden_layers) if model.cfg.is_moe_layer(i)]
    out = [moe.index(i) for i in range(start, end) if i in moe]
    if last:
        out += [len(moe) + d for d in range(model.cfg.num_nextn_predict_layers)]
    return out


class SumShared(nn.Cell):
    """The shared embedding's accumulated gradient summed over its two copies' stages, in place: its own graph, run
    before the update on both ends, so that no other collective can come between them."""

    def __init__(self, accumulators: list, pair):
        super().__init__(auto_prefix=False)
        self.accumulators = ParameterTuple(accumulators)
        self.pair_sum = AllReduce(pair)

    def construct(self):
        for i in range(len(self.accumulators)):
            ops.assign(self.accumulators[i], self.pair_sum(self.accumulators[i] * 1))
        return self.accumulators[0] * 1


class PipelineUpdate(nn.Cell):
    """After the schedule: the accumulated gradients reduced (PrepareGradients, with the pipeline group in the
    norm), the optimizer applied (skipped on overflow), the accumulators zeroed."""

    def __init__(self, accumulators: ParameterTuple, prepare, optimizer):
        super().__init__(auto_prefix=False)
        self.accumulators, self.prepare, self.optimizer = accumulators, prepare, optimizer
        self.map = ops.HyperMap()

    def construct(self, grad_scale, lr, return_grads: bool):
        grads = ()
        for i in range(len(self.accumulators)):
            grads = grads + (self.accumulators[i] * 1,)
        grads, factor, norm, finite = self.prepare(grads, grad_scale)
        ops.assign(self.optimizer.learning_rate, lr)
        # the norm returned after the update: on CPU the kernels' statuses are all the graph would keep them by
        norm = ops.depend(norm, self.optimizer(grads, factor, finite))
        self.map(_zero, self.accumulators)
        if return_grads:        # a dump step: the reduced gradients (TrainStep returns them only then too)
            return norm, finite, self.map(ops.partial(ops.mul, factor), grads)
        return norm, finite


def _zero(p):
    return ops.assign(p, ops.zeros_like(p))


@dataclass
class PipelineStepResult:
    loss_parts: np.ndarray          # this rank's loss parts summed over its chunks, per micro-batch mean [5]
    loads: np.ndarray               # its routers' statistics [routers, E + ROUTING_STATS]
    norm: Any                       # the global gradient norm (a Tensor)
    finite: bool
    record: PipelineResult          # what the executor ran and when (order, timeline, activations held)
    grads: tuple | None = None      # the reduced gradients, on a dump step


class PipelineTrainStep:
    """One optimizer step of this rank's stage: the executor over the micro-batches, then PipelineUpdate."""

    def __init__(self, recipe, rank: int, model: TeleChatMoE, plan: StagePlan, weights, make_prepare, optimizer,
                 device: str):
        p = plan.stages
        self.plan, self.model, self.cfg = plan, model, recipe.model
        last = p * plan.chunks - 1
        chunks = [None] * (p * plan.chunks)
        self.routers = {}
        for k in plan.mine():
            start, end = plan.bounds[k]
            chunks[k] = StageChunk(model, start, end, k == 0, k == last)
            self.routers[k] = router_index(model, start, end, k == last)
        self.accumulators = weights.clone(prefix="grad_accum", init="zeros")
        by_id = {id(w): a for w, a in zip(weights, self.accumulators)}
        scheduler = recipe.parallel_config.pipeline_scheduler
        name = scheduler if scheduler in ("gpipe", "dualpipev") else "interleaved" if plan.chunks > 1 else "1f1b"
        self.schedule = build(name, p, plan.chunks, recipe.parallel_config.micro_batch_num)
        self.bounds = plan.bounds
        self.dump_chunks = None     # LayerOutputsChunks, built on the first dump step
        # what every step must show: this stage's actions in the schedule's order, no more activations held
        # than the validator allows
        self.expected = list(self.schedule.actions[plan.stage])
        self.allowed = validate(self.schedule).peak_in_flight[plan.stage]
        cfg = recipe.model
        self.tokens_per_rank = activation_positions(recipe)
        self.executor = PipelineExecutor(self.schedule, recipe.layout, rank, chunks,
                                         (1, self.tokens_per_rank, cfg.hidden_size), ms.float32, device,
                                         accumulator_of=lambda w: by_id[id(w)],
                                         loss_chunks=[k for k, rows in self.routers.items() if rows])
        # the embedding's copies on the first and the last stage (MTP) are summed over the pair
        stage_ranks = sorted(recipe.layout.group_of(Axis.PP, rank))
        first, tail = 0 in plan.mine(), last in plan.mine()
        # under DualPipeV's V the first and the last chunk share stage 0, and so the one embedding table
        has_copy = cfg.num_nextn_predict_layers > 0 and not (first and tail)
        pair = None
        if has_copy and (first or tail):
            peer = stage_ranks[-1] if first else stage_ranks[0]
            pair = transport_for(ProcessGroups(recipe.layout, rank).pair(peer), device)
        shared = tuple(bool(pair is not None and w.name.startswith("embed_tokens.")) for w in weights)
        self.sum_shared = SumShared([a for a, s in zip(self.accumulators, shared) if s], pair) if any(shared) \
            else None
        # the norm counts the shared embedding once: the first stage's
        counted = tuple(not (s and tail) for s in shared)
        pp = transport_for(ProcessGroups(recipe.layout, rank).axis(Axis.PP), device)
        self.update = PipelineUpdate(self.accumulators, make_prepare(counted, pp), optimizer)
        self.experts = cfg.n_routed_experts + ROUTING_STATS
        self.n_routers = len(router_index(model, 0, cfg.num_hidden_layers, True))

    def microbatches(self, tensors_of, local: int, micro: int) -> list[tuple]:
        mb = local // micro
        return [tensors_of(slice(i * mb, (i + 1) * mb)) for i in range(micro)]

    def _collect(self, stats: dict) -> tuple[np.ndarray, np.ndarray]:
        """(loss parts summed over this rank's chunks and micro-batches [5], routing statistics [routers, E+4])."""
        parts = np.zeros(LOSS_PARTS)
        loads = np.zeros((self.n_routers, self.experts), np.float32)
        for (_, k), st in stats.items():
            parts += st[:LOSS_PARTS]
            rows = self.routers[k]
            if rows:
                loads[rows] += st[LOSS_PARTS:].reshape(len(rows), self.experts)
        return parts, loads

    def run(self, microbatches: list, scale: float, grad_scale, lr, return_grads: bool = False
            ) -> PipelineStepResult:
        b = microbatches[0][0].shape[0]
        result = self.executor.run(microbatches, (b, self.tokens_per_rank, self.cfg.hidden_size), scale)
        if result.order != self.expected or result.peak_in_flight > self.allowed:
            raise RuntimeError(f"pipeline stage {self.plan.stage} ran {[str(a) for a in result.order]} holding up "
                               f"to {result.peak_in_flight} activations; the schedule says "
                               f"{[str(a) for a in self.expected]} and at most {self.allowed}")
        if self.sum_shared is not None:
            self.sum_shared().asnumpy()
        norm, finite, *grads = self.update(grad_scale, lr, return_grads)
        parts, loads = self._collect(result.stats)
        return PipelineStepResult(parts / len(microbatches), loads, norm, bool(finite.asnumpy()), result,
                                  grads[0] if return_grads else None)

    def layer_outputs(self, microbatches: list) -> dict[int, np.ndarray]:
        """Chunk k held here -> its `chunk_outputs` over the micro-batches [outputs, b, s', h] (a forward-only pass
        through the pipeline, every stage taking part)."""
        last = len(self.bounds) - 1
        if self.dump_chunks is None:
            self.dump_chunks = {k: LayerOutputsChunk(self.model, *self.bounds[k], k == 0, k == last)
                                for k in self.plan.mine()}
        b = microbatches[0][0].shape[0]
        stats = self.executor.forward_only(microbatches, (b, self.tokens_per_rank, self.cfg.hidden_size),
                                           chunks=self.dump_chunks)
        return {k: np.concatenate([stats[(mb, k)][:chunk_output_count(self.bounds, k)]
                                   for mb in range(len(microbatches))], axis=1) for k in self.plan.mine()}

    def evaluate(self, microbatch: tuple) -> np.ndarray:
        """This rank's loss parts [5] of one forward (the LM loss on the last stage, zeros elsewhere)."""
        b = microbatch[0].shape[0]
        stats = self.executor.forward_only([microbatch], (b, self.tokens_per_rank, self.cfg.hidden_size))
        return self._collect(stats)[0]
