"""The training loop: wires recipe -> data -> model -> optimizer -> checkpoints and logs. It implements none of them.

One optimizer step: the rank's share of the global batch is split into `micro_batch_num` micro-batches whose
gradients are summed (graph-mode forward+backward per micro-batch), then scaled, all-reduced (dense weights over
the data-parallel ranks, this rank's routed experts over the ranks holding the same experts), clipped and applied.
Under expert parallelism each rank builds only its share of the routed experts and the MoE layers exchange token
copies with the EP group (telechat_moe/moe/dispatch.py). Under tensor parallelism each rank builds its slices of
the split weights (parallel/tp); the replicated weights whose gradient is only the rank's share are summed over the
tensor-parallel group too (TeleChatMoE.partial_over_tp), and the ranks of a tensor-parallel group train on the same
rows of the batch. The router's expert bias is then moved by its own rule
from the expert load summed over every rank, identically on every rank, never by the gradient.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import mindspore as ms
import yaml
from mindspore import ParameterTuple, Tensor, nn, ops  # noqa: F401

from data_sched.attention_cost import CostModel
from data_sched.loader import BatchLoader
from data_sched.prepare import TOKENIZER_FILE, prepare_data, tokenizer_in_use
from dvm_fusion.grouped_matmul import KERNEL_CLOCK
from dvm_fusion.square_sums import square_sums_for
from parallel.comm import ProcessGroups, transport_for
from parallel.ep.traffic import STEP_MULTIPLIER, token_bytes
from parallel.layout import Axis
from parallel.tp.mappings import TensorParallel
from telechat_moe.checkpoint import Shard, load_checkpoint, preflight, resume_point, save_checkpoint
from telechat_moe.context import configure_mindspore  # noqa: F401  (the entry points' import)
from telechat_moe.dry_run import DTYPE_BYTES
from telechat_moe.expert_placement import ExpertMigrator
from telechat_moe.metrics import StepLogger, Timer, info, keep_records_until
from telechat_moe.model import AbsentLayer, TeleChatMoE
from telechat_moe.moe.dispatch import ExpertParallel
from telechat_moe.moe.replicas import SumReplicaGradients, outside_checkpoints
from telechat_moe.moe.router import expert_bias_delta
from telechat_moe.optim import build_adamw, lr_at
from telechat_moe.pipeline_step import PipelineTrainStep, stage_plan
from telechat_moe.profiling import StepProfiler
from telechat_moe.recipe import Recipe


# ---- graph-mode cells ---------------------------------------------------------------------------------
class ForwardBackward(nn.Cell):
    """Losses, expert load and the gradients of (total loss x loss scale) for one micro-batch."""

    def __init__(self, model: TeleChatMoE, weights: ParameterTuple):
        super().__init__(auto_prefix=False)
        self.model = model
        self.weights = weights
        self.grad_fn = ms.value_and_grad(self.scaled_loss, None, self.weights, has_aux=True)

    def scaled_loss(self, input_ids, labels, loss_mask, segment_ids, position_ids, scale):
        total, lm, mtp, aux, z, loads = self.model(input_ids, labels, loss_mask, segment_ids, position_ids)
        return total * scale, total, lm, mtp, aux, z, loads

    def construct(self, input_ids, labels, loss_mask, segment_ids, position_ids, scale):
        (_, total, lm, mtp, aux, z, loads), grads = self.grad_fn(input_ids, labels, loss_mask, segment_ids,
                                                                 position_ids, scale)
        return total, lm, mtp, aux, z, loads, grads


# How a weight's gradient is reduced (PrepareGradients)
REPLICATED, PARTIAL, TP_SHARD, EXPERT = 0, 1, 2, 3


def gradient_kind(name: str, model: TeleChatMoE, tp_axes: dict[str, int]) -> int:
    """`tp_axes`: the model's tp_split_axes(), walked once by the caller for all its weights."""
    if is_routed_expert(name):
        return EXPERT
    if name in tp_axes:
        return TP_SHARD
    return PARTIAL if model.partial_over_tp(name) else REPLICATED


class PrepareGradients(nn.Cell):
    """Unscale, average over the global batch, measure the global norm and clip. A dense gradient is summed over
    the data-parallel group (a replicated weight's, also over the tensor-parallel group where each rank holds only
    its share: `PARTIAL`); a routed expert's already holds its EP group's tokens (the all-to-all's backward brought
    them) and is summed over the expert-data-parallel group, the ranks holding the same experts. All are divided
    by dp, as the loss is each data-parallel rank's mean. The norm adds the squares of the tensor-parallel slices
    over the tp group and of the expert shards over the EP group, so it is the norm of the whole model's
    gradient."""

    def __init__(self, weights: ParameterTuple, kinds: tuple, dp: int, clip: float, comm: "GradientGroups",
                 counted: tuple | None = None, pp=None, device_target: str = "CPU"):
        """Under pipeline parallelism `pp` is the pipeline group's transport, whose stages' squares the norm adds,
        and `counted[i]` says whether weight i counts in the norm (a copy of a weight another stage also holds
        counts once)."""
        super().__init__(auto_prefix=False)
        self.map = ops.HyperMap()
        self.kinds = kinds
        counted = counted or (True,) * len(kinds)
        # which gradients' squares each partial sum adds: those summed over ranks later (the tp slices' over tp,
        # the expert shards' over EP) apart from the dense ones
        self.dense_mask, self.tp_mask, self.expert_mask = (
            Tensor(np.array([float(c and k in of) for k, c in zip(kinds, counted)], np.float32))
            for of in ((REPLICATED, PARTIAL), (TP_SHARD,), (EXPERT,)))
        self.square_sums = square_sums_for(device_target)
        # Sums over ranks call the transports, not the collectives' Cells: nothing here is differentiated, and each
        # Cell call is a graph of its own to compile per gradient shape (with the loop below, 4 s of small's first
        # step). Groups of one rank are left out when the graph is traced.
        self.dense, self.tp, self.edp, self.ep = comm.dp, comm.tp, comm.edp, comm.ep
        self.summed = any(t.group.size > 1 for t in (comm.dp, comm.tp, comm.edp))
        self.stages = pp
        self.dp = dp
        self.clip = clip

    def construct(self, grads, grad_scale):
        """-> (the summed gradients, the factor to multiply them by, the global norm, whether it is finite).
        Sums over ranks are linear, so the unscaling, the division by dp and the clipping are one factor applied
        to the raw sums, and the norm is the raw sums' norm times the unscaling: three elementwise passes over
        every gradient fewer than scaling first (on tiny, 90 of 1400 ms a step). The optimizer applies the factor
        inside its update (on CPU in the same pass)."""
        reduced = grads
        if self.summed:
            reduced = ()
            for i in range(len(grads)):
                if self.kinds[i] == EXPERT:
                    g = self.edp.all_reduce(grads[i])
                elif self.kinds[i] == PARTIAL:
                    g = self.tp.all_reduce(self.dense.all_reduce(grads[i]))
                else:
                    g = self.dense.all_reduce(grads[i])
                reduced = reduced + (g,)
        each = self.square_sums(reduced)          # one kernel on CPU instead of about five per gradient
        squares = ((each * self.dense_mask).sum() + self.tp.all_reduce((each * self.tp_mask).sum())
                   + self.ep.all_reduce((each * self.expert_mask).sum()))
        if self.stages is not None:
            squares = self.stages.all_reduce(squares)
        unscale = grad_scale / self.dp
        norm = ops.sqrt(squares) * unscale
        finite = ops.isfinite(norm)
        factor = self.clip / ops.maximum(norm, self.clip) * unscale if self.clip > 0 else unscale
        return reduced, factor, norm, finite


@dataclass
class GradientGroups:
    """The transports gradients are reduced on: data-parallel, expert-data-parallel, expert-parallel and
    tensor-parallel groups."""
    dp: object
    edp: object
    ep: object
    tp: object

    @classmethod
    def of(cls, layout, rank: int, device_target: str) -> "GradientGroups":
        groups = ProcessGroups(layout, rank)
        return cls(*(transport_for(groups.axis(a), device_target) for a in (Axis.DP, Axis.EDP, Axis.EP, Axis.TP)))


def is_routed_expert(name: str) -> bool:
    """A routed expert's weight, or one of its optimizer moments: sharded over the EP group along dim 0."""
    return ".experts." in f".{name}"


def zero_out(p):
    return ops.assign(p, ops.zeros_like(p))


class TrainStep(nn.Cell):
    """One micro-batch of a step, in ONE graph: forward, backward, and on the last micro-batch the gradient
    average over micro-batches and ranks, clipping and the optimizer update (skipped on overflow). Earlier
    micro-batches add their gradients into accumulation buffers. Gradients never leave the graph (handing a
    graph's output tensors to another graph kept each step's gradients alive in MindSpore 2.9 on CPU: +54 MB per
    step on tiny), except on dump steps, where they are returned for the tensor dump.

    The learning rate comes in as an input and is assigned inside the graph: `Parameter.set_data` between calls
    of a graph that updates parameters in place is not seen by that graph (measured: the rate stayed at its
    first value, and training crawled)."""

    def __init__(self, forward_backward: ForwardBackward, prepare: PrepareGradients, optimizer: nn.Optimizer,
                 micro_batches: int, replica_sum: SumReplicaGradients | None = None):
        super().__init__(auto_prefix=False)
        self.forward_backward = forward_backward
        self.prepare = prepare
        self.replica_sum = replica_sum
        self.optimizer = optimizer
        self.map = ops.HyperMap()
        self.accum = optimizer.parameters.clone(prefix="grad_accum", init="zeros") if micro_batches > 1 else None

    def construct(self, input_ids, labels, loss_mask, segment_ids, position_ids, scale, grad_scale, lr,
                  last: bool, return_grads: bool):
        total, lm, mtp, aux, z, loads, grads = self.forward_backward(input_ids, labels, loss_mask, segment_ids,
                                                                     position_ids, scale)
        if self.accum is not None:
            if not last:
                self.map(ops.assign_add, self.accum, grads)
                return total, lm, mtp, aux, z, loads, ops.zeros((), ms.float32), True
            grads = self.map(ops.add, grads, self.accum)
            self.map(zero_out, self.accum)
        if self.replica_sum is not None:
            grads = self.replica_sum(grads)
        grads, factor, norm, finite = self.prepare(grads, grad_scale)
        ops.assign(self.optimizer.learning_rate, lr)
        # the norm returned after the update: on CPU the kernels' statuses are all the graph would keep them by
        norm = ops.depend(norm, self.optimizer(grads, factor, finite))
        if return_grads:
            return total, lm, mtp, aux, z, loads, norm, finite, self.map(ops.partial(ops.mul, factor), grads)
        return total, lm, mtp, aux, z, loads, norm, finite


class MoveExpertBiases(nn.Cell):
    """Adds each router's bias step in a graph, for the reason TrainStep takes its learning rate as an input. The
    steps come as one [routers, E] tensor: a tuple of new tensors each step is taken for constants, and the graph
    was recompiled every step (once failing to compile at step 6 of a 4-process run)."""

    def __init__(self, biases: list):
        super().__init__(auto_prefix=False)
        self.biases = ParameterTuple(biases)

    def construct(self, deltas):
        for i in range(len(self.biases)):
            ops.assign_add(self.biases[i], deltas[i])
        return deltas


class OverRanks(nn.Cell):
    """One collective over every rank (the world group), such as ops.AllReduce(), which sums a tensor."""

    def __init__(self, collective):
        super().__init__()
        self.collective = collective

    def construct(self, x):
        return self.collective(x)


class LayerOutputs(nn.Cell):
    def __init__(self, model: TeleChatMoE):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, segment_ids, position_ids):
        return self.model.layer_outputs(input_ids, segment_ids, position_ids)


class Evaluate(nn.Cell):
    def __init__(self, model: TeleChatMoE):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, labels, loss_mask, segment_ids, position_ids):
        return self.model(input_ids, labels, loss_mask, segment_ids, position_ids)[1]


# ---- loss scaling ---------------------------------------------------------------------------------------
@dataclass
class LossScaler:
    """Static or dynamic loss scale for float16; `scale == 1, dynamic == False` is no scaling."""
    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    good_steps: int = 0

    @classmethod
    def from_recipe(cls, r: Recipe) -> "LossScaler":
        setting = r.training.loss_scale
        if setting == "auto":
            setting = "dynamic" if r.model.compute_dtype == "float16" else "none"
        if setting == "none":
            return cls()
        if setting == "dynamic":
            return cls(scale=2.0 ** 16, dynamic=True, window=r.training.loss_scale_window)
        return cls(scale=float(setting))

    def update(self, finite: bool) -> None:
        if not self.dynamic:
            return
        if not finite:
            self.scale, self.good_steps = max(1.0, self.scale / 2), 0
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale, self.good_steps = self.scale * 2, 0


# ---- the trainer ----------------------------------------------------------------------------------------
def routed_layers(model: TeleChatMoE) -> tuple[list[int], list]:
    """(the routers' indices in the order of the model's expert-load output: MoE layers, then MTP; their MoE cells)
    of the routers this rank builds (a pipeline stage builds some)."""
    moe = [layer for layer in model.layers if layer.is_moe]
    built = [(i, layer) for i, layer in enumerate(moe) if not isinstance(layer, AbsentLayer)]
    built += [(len(moe) + d, block.block) for d, block in enumerate(model.mtp)]
    return [i for i, _ in built], [layer.mlp for _, layer in built]


def gather_along(transport, x: np.ndarray, axis: int) -> np.ndarray:
    """Every group member's `x` put together along `axis`, in group order (the transports gather along axis 0)."""
    moved = np.ascontiguousarray(np.moveaxis(x, axis, 0))
    return np.moveaxis(transport.all_gather(Tensor(moved)).asnumpy(), 0, axis)


def release_freed_heap() -> None:
    """Hand the heap pages freed so far back to the OS (glibc's malloc_trim; nothing where there is none). A graph's
    compile frees most of what it allocates, but glibc keeps the pages, and the first step's buffers then come on
    top: trimmed in between, tiny's peak resident set is 1.10 GiB instead of 1.20."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def position_ids(batch: int, seq: int) -> np.ndarray:
    return np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()


class Trainer:
    def __init__(self, recipe: Recipe, rank: int = 0, world: int = 1, *, peak_flops: float):
        """`peak_flops`: one device's peak FLOP/s, the denominator of the logged MFU (the caller measures it or
        takes the recipe's context.peak_tflops)."""
        self.r, self.rank, self.world = recipe, rank, world
        # which share of each global batch this rank holds (its data-parallel coordinate; the rank itself on CPU,
        # where only data parallelism trains)
        self.dp_rank = recipe.layout.coords(rank)[Axis.DP]
        self.out = Path(recipe.output_dir)
        self.main = rank == 0
        cfg, t, p = recipe.model, recipe.training, recipe.parallel_config
        ms.set_seed(recipe.seed)
        np.random.seed(recipe.seed)

        info(f"[data] preparing corpus and tokenizer (seq_length {cfg.seq_length})", self.main)
        self.new_tokenizer = None           # a tokenizer trained by this run, not yet in output_dir
        with Timer() as tm:
            self.data = self._prepare_data()
        info(f"[data] {len(self.data.train)} training samples, "
             f"{len(self.data.held_out) if self.data.held_out else 0} held-out, vocab "
             f"{self.data.tokenizer.vocab_size} ({tm.seconds:.1f}s)", self.main)

        device = recipe.context.device_target
        self.ep = ExpertParallel.of(recipe.layout, rank, cfg.moe_token_dispatcher_type, device,
                                    recipe.expert_placement.spare_slots)
        self.tp = TensorParallel.of(recipe.layout, rank, device)
        self.stages = p.pipeline_stage
        self.plan = stage_plan(recipe, rank) if self.stages > 1 else None
        parts = self.plan.parts(cfg.num_nextn_predict_layers > 0) if self.plan else None
        if self.plan:
            info(f"[pipeline] layers per chunk {[e - b for b, e in self.plan.bounds]} (chunk k on stage k % "
                 f"{self.stages}); placement:\n{self.plan.description}", self.main)
        self.model = TeleChatMoE(cfg, device, self.ep, self.tp, parts, recipe.context.lazy_inline)
        self.model.set_recompute(recipe.recompute_config.mode)
        o = recipe.optimizer
        self.optimizer = build_adamw(self.model.trainable_params(), o.learning_rate, o.betas, o.eps, o.weight_decay,
                                     device)
        # Gradients must come in the optimizer's order, which groups decayed parameters first.
        self.weights = self.optimizer.parameters
        self.groups = GradientGroups.of(recipe.layout, rank, device)
        self._tp_axes = self.model.tp_split_axes()
        kinds = tuple(gradient_kind(w.name, self.model, self._tp_axes) for w in self.weights)

        def prepare(counted=None, pp=None):
            return PrepareGradients(self.weights, kinds, p.data_parallel, o.grad_clip, self.groups, counted, pp,
                                    device)

        self.router_rows, mlps = routed_layers(self.model)
        if self.plan:
            self.pipeline = PipelineTrainStep(recipe, rank, self.model, self.plan, self.weights, prepare,
                                              self.optimizer, device)
        else:
            self.pipeline = None
            self.forward_backward = ForwardBackward(self.model, self.weights)
            replica_sum, counted = None, None
            if self.ep.spare_slots:     # a replica's gradient is its home copy's: counted once in the norm
                replica_sum = SumReplicaGradients(
                    self.weights, [(((m.experts.w1, m.experts.w1_spare), (m.experts.w2, m.experts.w2_spare)),
                                    m.slots) for m in mlps], cfg.n_routed_experts, self.groups.ep, self.ep.index)
                counted = tuple(not outside_checkpoints(w.name) for w in self.weights)
            self.step_graph = TrainStep(self.forward_backward, prepare(counted), self.optimizer, p.micro_batch_num,
                                        replica_sum)
            self.evaluate = Evaluate(self.model)
        self._compiled = set()      # the graphs _run_graph has compiled
        self.sum_over_ranks = OverRanks(ops.AllReduce()) if world > 1 else None
        self.biases = [mlp.gate.expert_bias for mlp in mlps]
        self.move_biases = (MoveExpertBiases(self.biases)
                            if self.biases and recipe.model.moe_router_enable_expert_bias else None)
        self.migrator = ExpertMigrator(recipe, self.router_rows, mlps, self.optimizer, self.groups.ep, self.ep.index,
                                       self.ep.ranks_per_node, peak_flops) \
            if recipe.expert_placement.interval and mlps else None
        self.load_imbalance = None      # this step's max/mean EP-rank load per router (dynamic placement)
        self.expert_seconds = None      # this step's expert kernel seconds per EP rank (dynamic placement)
        self.scaler = LossScaler.from_recipe(recipe)
        self.micro = p.micro_batch_num
        d = recipe.data
        cost = CostModel.load(d.attention_cost) if d.attention_cost else None
        self.loader = BatchLoader(self.data.train, t.global_batch_size, recipe.seed, self.dp_rank, p.data_parallel,
                                  micro_batch_num=p.micro_batch_num, attention_balance=d.attention_balance,
                                  cost_model=cost, max_context_loss=d.max_context_loss)
        self.step = 0
        self.dumper = self._dump_writer()
        self.profiler = StepProfiler.of(recipe, rank)     # MindSpore's profiler around profile.steps
        self.timeline = None        # the pipeline's per-step timeline file, opened by _begin

        shape = cfg.to_model_shape()
        from parallel.planner.model_shape import flops_per_token
        self.peak_flops = peak_flops
        # Opened by fit(), once resume() has passed: a run refused before its first step touches no earlier log.
        self.logger = StepLogger(self.out / "logs", self.main, t.train_steps, t.global_batch_size * cfg.seq_length,
                                 flops_per_token(shape)["training"], peak_flops, world)
        n_params = sum(w.size for w in self.weights)
        n_experts = sum(w.size for w in self.weights if is_routed_expert(w.name))
        info(f"[model] {n_params:,} trainable parameters on this rank ({n_experts:,} in its routed experts "
             f"{self.ep.experts(cfg.n_routed_experts)}); layout {recipe.layout.describe()}; "
             f"peak {peak_flops / 1e9:.1f} GFLOP/s per device for MFU", self.main)

    # -- tensor dumps (precision/) --
    def _dump_writer(self):
        t = self.r.training
        if not t.dump_steps:
            return None
        from precision.dump import DumpWriter, config_hash, layout_meta, parse_steps
        self.layer_outputs = LayerOutputs(self.model) if self.pipeline is None else None
        # a pipeline stage holds some layers: the dump puts every stage's tensors together over the pipeline group
        self.stage_group = transport_for(ProcessGroups(self.r.layout, self.rank).axis(Axis.PP),
                                         self.r.context.device_target) if self.pipeline is not None else None
        meta = {"model_config_hash": config_hash(self.r.model.function()), "layout": layout_meta(self.r.layout),
                "dtype": self.r.model.compute_dtype, "recipe": self.r.name}
        return DumpWriter(Path(t.dump_dir or self.out / "dump"), meta,
                          steps=parse_steps(t.dump_steps, "training.dump_steps"), rank=self.rank)

    def _forward_places(self) -> list[tuple[str, int | None, str]]:
        """(name, layer, operator) of the dump's forward tensors (`TeleChatMoE.layer_outputs`), in forward order:
        the embedding, per layer the stream after attention and after the FFN (MoE or dense), the final norm."""
        cfg = self.r.model
        where = [("embed_tokens", None, "embed_tokens")]
        for i in range(cfg.num_hidden_layers):
            where += [(f"layers.{i}.self_attn", i, "self_attn"), (f"layers.{i}", i, "moe" if cfg.is_moe_layer(i)
                                                                                else "mlp")]
        return where + [("norm", None, "norm")]

    def _forward_records(self, batch: dict) -> list:
        """The forward tensors of the global batch, micro-batch by micro-batch as the step computes (a capacity
        factor drops per micro-batch's tokens), so that a parallel run compares with any layout's."""
        from parallel.comm.named import all_gather_named
        from precision.dump import TensorRecord
        local = batch["input_ids"].shape[0]
        mb = local // self.micro
        places = self._forward_places()
        if self.pipeline is not None:
            micro = self.pipeline.microbatches(lambda rows: self._tensors(batch, rows), local, self.micro)
            mine = {}
            for k, stacked in self.pipeline.layer_outputs(micro).items():
                first = 0 if k == 0 else 1 + 2 * self.plan.bounds[k][0]     # chunk k's outputs: a run of places
                mine.update((places[first + j][0], out) for j, out in enumerate(self._global_batch(stacked)))
            whole = {}
            for stage in all_gather_named(self.stage_group, mine):
                whole.update(stage)
            outs = [whole[name] for name, _, _ in places]
        else:
            parts = []
            for i in range(self.micro):
                ids, _, _, segments, positions = self._tensors(batch, slice(i * mb, (i + 1) * mb))
                parts.append(self.layer_outputs(ids, segments, positions))
            outs = [self._global_batch(ops.concat(pieces, 0).asnumpy()) for pieces in zip(*parts)]
        return [TensorRecord(name, "forward", out, layer=layer, operator=op, k=self.r.model.hidden_size, dims="bsh")
                for (name, layer, op), out in zip(places, outs)]

    def _global_batch(self, out: np.ndarray) -> np.ndarray:
        """This rank's [..., b, s', h] -> the global batch's [..., dp*b, s, h]: its sequence shards put together
        over the tensor-parallel group under sequence parallelism, then the data-parallel ranks' rows in order."""
        if self.tp.sp:
            out = gather_along(self.groups.tp, out, -2)
        return gather_along(self.groups.dp, out, -3)

    def _dump(self, step: int, forward: list, values: dict, grads) -> None:
        from precision.capture import grad_records, optimizer_records
        from precision.dump import TensorRecord
        opt = self.optimizer
        # the one-process model's tensors: the replicas in spare slots are copies of their home experts
        kept = [i for i, p in enumerate(self.weights) if not outside_checkpoints(p.name)]
        names = [self.weights[i].name for i in kept]
        records = forward + [TensorRecord(k, "loss", np.float32(v)) for k, v in values.items() if k.endswith("loss")]
        # the whole model's tensors: a routed expert's gathered from the EP group, a tensor-parallel slice from the
        # tp group, a pipeline stage's from the pipeline group, so any layout aligns with any
        states = {kind: [self._whole(names[j], values[i]) for j, i in enumerate(kept)]
                  for kind, values in (("grad", grads), ("adam_m", opt.exp_avg), ("adam_v", opt.exp_avg_sq))}
        if self.migrator is not None:    # experts and router rows in the experts' original order
            from precision.dump import to_numpy
            states = {kind: [self.migrator.original_order(n, to_numpy(v)[0]) for n, v in zip(names, values)]
                      for kind, values in states.items()}
        if self.pipeline is not None:
            names, states = self._whole_pipeline(names, states)
        records += grad_records(names, states["grad"])
        records += optimizer_records({"adam_m": states["adam_m"], "adam_v": states["adam_v"]}, names)
        self.dumper.write(step, records)

    def _whole_pipeline(self, names: list[str], states: dict) -> tuple[list[str], dict]:
        """Every stage's weights and their states on every rank, in the one-process model's order (weights that
        decay first, each group in forward order: the embedding, the layers, the head and MTP); the embedding's
        copy on the last stage (MTP's) equals the first stage's and is taken once."""
        from parallel.comm.named import all_gather_named
        from precision.capture import layer_of
        from precision.dump import to_numpy
        mine = {f"{kind}/{n}": to_numpy(v)[0] for kind, values in states.items() for n, v in zip(names, values)}
        stages = all_gather_named(self.stage_group, mine)
        layers, keyed, seen = self.r.model.num_hidden_layers, [], set()
        for stage, held in enumerate(stages):
            for i, n in enumerate(key.split("/", 1)[1] for key in held if key.startswith("grad/")):
                if n not in seen:
                    seen.add(n)
                    layer = layer_of(n)
                    part = layer if layer is not None else -1 if stage == 0 else layers
                    keyed.append(((held[f"grad/{n}"].ndim < 2, part, i), n, stage))
        keyed.sort()
        return [n for _, n, _ in keyed], {kind: [stages[s][f"{kind}/{n}"] for _, n, s in keyed] for kind in states}

    def _whole(self, name: str, tensor):
        axis = self._tp_axes.get(name)
        if axis is not None:
            return gather_along(self.groups.tp, tensor.asnumpy(), axis)
        if self.ep.ep == 1 or not is_routed_expert(name):
            return tensor
        return gather_along(self.groups.ep, tensor.asnumpy(), 0)

    def _shards(self) -> dict:
        """The slices this rank checkpoints: routed experts along dim 0 over the EP group, tensor-parallel weights
        along their split axis over the tp group (with their Adam moments); the rest is replicated."""
        out = {}
        for p in self._all_params():
            axis = self._tp_axes.get(p.name.split(".", 1)[1] if p.name.startswith("adam_") else p.name)
            if axis is not None:
                out[p.name] = Shard(axis, self.tp.index * p.shape[axis], self.tp.tp * p.shape[axis])
            elif self.ep.ep > 1 and is_routed_expert(p.name):
                e = self.r.model.n_routed_experts
                out[p.name] = Shard(0, self.ep.experts(e)[0], e)
        return out

    # -- data --
    def _prepare_data(self):
        cfg, d = self.r.model, self.r.data
        existing = tokenizer_in_use(d.tokenizer, self.out)
        if existing:
            return prepare_data(d.paths, cfg.seq_length, self.r.seed, d.eval_fraction, tokenizer_path=existing,
                                vocab_size=cfg.vocab_size)
        # Every rank trains the same deterministic tokenizer in a temporary folder of its own run; _begin() publishes
        # it into output_dir once the run is known to start.
        self.new_tokenizer = tempfile.TemporaryDirectory(prefix=f"telechat_tokenizer_rank{self.rank}_")
        return prepare_data(d.paths, cfg.seq_length, self.r.seed, d.eval_fraction, vocab_size=cfg.vocab_size,
                            tokenizer_out=str(Path(self.new_tokenizer.name) / "spm"))

    def _publish_tokenizer(self) -> None:
        """The tokenizer this run trained, into output_dir atomically (every rank publishes the same file)."""
        if self.new_tokenizer is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        staged = self.out / f".{TOKENIZER_FILE}.rank{self.rank}.{os.getpid()}"
        shutil.copyfile(Path(self.new_tokenizer.name) / "spm.model", staged)
        os.replace(staged, self.out / TOKENIZER_FILE)
        self.new_tokenizer.cleanup()
        self.new_tokenizer = None

    def _tensors(self, batch: dict, rows: slice) -> tuple:
        ids = batch["input_ids"][rows]
        b, s = ids.shape
        return (Tensor(ids), Tensor(batch["labels"][rows]), Tensor(np.ones((b, s), np.float32)),
                Tensor(batch["segment_ids"][rows]), Tensor(position_ids(b, s)))

    # -- checkpoints --
    def _all_params(self) -> list:
        """What a checkpoint holds: every parameter and optimizer state but the replicas' (rebuilt on resume)."""
        seen, out = set(), []
        for p in list(self.model.get_parameters()) + list(self.optimizer.get_parameters()):
            if p.name not in seen and not outside_checkpoints(p.name):
                seen.add(p.name)
                out.append(p)
        return out

    def save(self) -> None:
        # No random draw happens after initialisation (no dropout; the data order is a function of seed and
        # epoch), so the seed and the data position are the whole random state.
        state = {"step": self.step, "data": self.loader.state_dict(), "loss_scale": self.scaler.scale,
                 "loss_scale_good_steps": self.scaler.good_steps, "seed": self.r.seed, "recipe": self.r.name}
        if self.migrator is not None:
            state.update(self.migrator.state_dict())
        path = save_checkpoint(self.out / "checkpoints", self.rank, self.step, self._all_params(), state,
                               self.r.training.keep_checkpoints, shards=self._shards(), world=self.world)
        info(f"[ckpt] saved {path}", self.main)

    def resume(self) -> bool:
        path = resume_point(self.out / "checkpoints", self.rank)
        if path is None:
            info("[ckpt] --resume: no checkpoint found, starting from step 0", self.main)
            return False
        from telechat_moe.checkpoint import TRAINER_STATE
        # a {} or mistyped state is one line; expert shards saved at another expert_parallel are resharded
        state = load_checkpoint(path, self._all_params(), TRAINER_STATE, shards=self._shards())
        self.step = int(state["step"])
        self.loader.load_state_dict(state["data"])
        self.scaler.scale = float(state["loss_scale"])
        self.scaler.good_steps = int(state["loss_scale_good_steps"])
        if self.migrator is not None:
            self.migrator.load_state_dict(state)
        info(f"[ckpt] resumed from {path} at step {self.step}", self.main)
        return True

    # -- steps --
    def train_step(self, batch: dict) -> tuple[dict, np.ndarray]:
        dumping = self.dumper is not None and self.dumper.wants(self.step + 1)
        forward = self._forward_records(batch) if dumping else []
        local = batch["input_ids"].shape[0]
        mb = local // self.micro
        scale = Tensor(self.scaler.scale, ms.float32)
        grad_scale = Tensor(1.0 / (self.scaler.scale * self.micro), ms.float32)
        lr = self.learning_rate(self.step)
        sums, loads, grads = np.zeros(5), None, None
        KERNEL_CLOCK.take()     # from here the step's own expert kernels (not the dumps' forward, not evaluation)
        if self.pipeline is not None:
            micro = self.pipeline.microbatches(lambda rows: self._tensors(batch, rows), local, self.micro)
            result = self.pipeline.run(micro, self.scaler.scale, grad_scale, Tensor(lr, ms.float32), dumping)
            sums, loads, norm, finite, grads = (result.loss_parts * self.micro, result.loads, result.norm,
                                                result.finite, result.grads)
            self._write_timeline(result.record)
        else:
            for i in range(self.micro):
                last = i == self.micro - 1
                out = self._run_graph(self.step_graph, *self._tensors(batch, slice(i * mb, (i + 1) * mb)), scale,
                                      grad_scale, Tensor(lr, ms.float32), last, dumping and last)
                sums += [float(x.asnumpy()) for x in out[:5]]
                loads = out[5].asnumpy() if loads is None else loads + out[5].asnumpy()
            norm, finite = out[6], bool(out[7].asnumpy())
            if dumping:
                grads = out[8]
        self.scaler.update(finite)
        if self.sum_over_ranks is not None:    # every rank's routing: the global expert load and traffic
            loads = self.sum_over_ranks(Tensor(loads)).asnumpy()
        e = self.r.model.n_routed_experts
        loads, self.traffic = loads[:, :e], loads[:, e:].sum(0)
        if self.move_biases is not None:     # every router's step from the global load; this rank's applied
            delta = expert_bias_delta(loads, self.r.model.moe_router_bias_update_rate)[self.router_rows]
            self.move_biases(Tensor(delta.astype(np.float32)))
        if self.migrator is not None:
            self.migrator.observe(loads, self.step + 1)
            self.load_imbalance = self.migrator.imbalance(loads)
            self.expert_seconds = self.migrator.over_ranks(KERNEL_CLOCK.take())
        total, lm, mtp, aux, z = self._mean_over_ranks(sums / self.micro)
        values = {"loss": total, "lm_loss": lm, "mtp_loss": mtp, "aux_loss": aux, "grad_norm": float(norm.asnumpy()),
                  "lr": lr}
        if self.r.model.moe_z_loss_coeff:
            values["z_loss"] = z
        if self.scaler.dynamic:
            values["loss_scale"] = self.scaler.scale
        if dumping:
            self._dump(self.step + 1, forward, values, grads)
        if self.loader.attention_balance == "repack":   # share of this batch's tokens repack cut from their context
            values["context_loss"] = self.loader.context_loss
        return values, loads

    def _mean_over_ranks(self, local: np.ndarray) -> np.ndarray:
        """The global batch's value of per-rank means: every data-parallel rank holds as many rows and loss tokens,
        so the batch's mean is the mean of the ranks' (ranks that replicate a data-parallel rank's value count it
        as often as the others, so the world group serves). One collective per call."""
        if self.sum_over_ranks is None:
            return local
        # the stages of a pipeline hold parts of one value (the loss on the last, auxiliary terms on each): their
        # sum is the value
        total = self.sum_over_ranks(Tensor(np.asarray(local, np.float32))).asnumpy().astype(np.float64)
        return total * self.stages / self.world

    def _migrate(self) -> None:
        """The experts re-placed after this step's update, before its checkpoint (telechat_moe/expert_placement.py)."""
        d = self.migrator.decide()
        self._heatmaps()
        info(f"[experts] step {self.step}: {d.layers_moved} of {len(self.router_rows)} layers re-placed, "
             f"{d.experts_moved} experts moved, {d.replicas_made} replicas made ({d.bytes / 2 ** 20:.2f} MiB of "
             f"weights and Adam moments), forecast "
             f"max/mean EP-rank load {d.imbalance_before:.3f} -> {d.imbalance_after:.3f}, {d.seconds * 1e3:.0f} ms"
             + "".join(f"; kept {why}" for why in d.kept), self.main)

    def _placement_scalars(self) -> dict:
        if self.migrator is None:
            return {}
        total, seconds, error = self.migrator.total, self.expert_seconds, self.migrator.predictor.error()
        out = {"expert_max_mean_load": float(self.load_imbalance.mean()),
               **{f"expert_max_mean_load_router_{row}": float(x) for row, x in zip(self.router_rows,
                                                                                    self.load_imbalance)},
               "experts_moved": float(total.experts_moved),
               "expert_replicas_made": float(total.replicas_made),
               "expert_bytes_moved": total.bytes, "expert_migration_s": total.seconds,
               # the routed experts' kernel time of the slowest EP rank and the mean (every rank waits for the
               # slowest in the combine); which rank that was
               "expert_kernel_max_s": float(seconds.max()), "expert_kernel_mean_s": float(seconds.mean()),
               "expert_kernel_slowest_rank": float(np.argmax(seconds))}
        if error is not None:       # the last window's forecast against the load that came (relative L1)
            out["expert_forecast_error"] = error
        return out

    def _heatmaps(self) -> None:
        """Each of this rank's routers' expert x step load over the kept window: a PNG (the latest) and a
        TensorBoard image at this step."""
        if not self.main:
            return
        folder = self.out / "logs" / "expert_load"
        folder.mkdir(parents=True, exist_ok=True)
        for r, row in enumerate(self.router_rows):
            path = self.migrator.window.heatmap_png(folder / f"router_{row}.png", r)
            self.logger.image(f"expert_load/router_{row}", path, self.step)

    def _traffic_bytes(self) -> dict:
        """Bytes the step's expert all-to-alls moved across and inside nodes, for the flat and the hierarchical
        scheme, from every rank's routing (dispatch and combine, forward and backward)."""
        if self.ep.ep == 1:
            return {}
        cfg = self.r.model
        per_copy = token_bytes(cfg.hidden_size, DTYPE_BYTES[cfg.compute_dtype]) * STEP_MULTIPLIER
        names = ("ep_inter_node_bytes_flat", "ep_intra_node_bytes_flat", "ep_inter_node_bytes_hierarchical",
                 "ep_intra_node_bytes_hierarchical")
        return {name: float(copies) * per_copy for name, copies in zip(names, self.traffic)}

    def learning_rate(self, step: int) -> float:
        o, sched = self.r.optimizer, self.r.lr_schedule
        decay = sched.decay_steps or self.r.training.train_steps
        return lr_at(step, o.learning_rate, o.min_lr, sched.warmup_steps, decay, sched.type)

    def held_out_loss(self) -> float | None:
        held = self.data.held_out
        if held is None or len(held) == 0 or self.r.training.eval_batches == 0:
            return None
        # The held-out batches of a one-process run; data-parallel rank r evaluates rows [r*B/dp, (r+1)*B/dp) of
        # each, weighted by its share of the rows (every row holds as many loss tokens), so the ranks' shares add
        # up to the one-process loss whether or not dp divides B.
        rows = min(len(held), self.r.training.global_batch_size)
        dp = self.r.parallel_config.data_parallel
        if self.ep.ep > 1:      # the expert exchanges are collectives of equal shapes: as many rows on every rank
            rows -= rows % dp
        lo, hi = self.dp_rank * rows // dp, (self.dp_rank + 1) * rows // dp
        loader = BatchLoader(held, rows, self.r.seed)
        n = min(self.r.training.eval_batches, loader.batches_per_epoch)
        share = 0.0
        for i in range(n):
            if hi > lo and self.pipeline is not None:      # the LM loss on the last stage, 0 elsewhere
                loss = self.pipeline.evaluate(self._tensors(loader.batch_at(0, i), slice(lo, hi)))[1]
                share += (hi - lo) / rows * float(loss)
            elif hi > lo:
                loss = self._run_graph(self.evaluate, *self._tensors(loader.batch_at(0, i), slice(lo, hi)))
                share += (hi - lo) / rows * float(loss.asnumpy())
        return float(self._mean_over_ranks(np.array([share * dp / n]))[0])

    def _run_graph(self, graph: nn.Cell, *args):
        """graph(*args), compiled first on its first call with these constants (the bools select a graph), and the
        compiler's freed heap released before the graph allocates its buffers (release_freed_heap)."""
        key = (id(graph),) + tuple(a for a in args if isinstance(a, bool))
        if key not in self._compiled:
            graph.compile(*args)
            release_freed_heap()
            self._compiled.add(key)
        return graph(*args)

    def _begin(self) -> None:
        """What a run writes before its first step, once every check (resume() included) has passed: room for a
        checkpoint checked, the tokenizer it trained, the resolved recipe, the logs from this step on."""
        preflight(self.out / "checkpoints", self.rank, sum(p.nbytes for p in self._all_params()))
        self._publish_tokenizer()
        if self.main:
            (self.out / "logs").mkdir(parents=True, exist_ok=True)
            (self.out / "logs" / "recipe.yaml").write_text(yaml.safe_dump(self.r.to_dict(), sort_keys=False))
        self.logger.open(self.step)
        if self.pipeline is not None:
            path = self.out / "logs" / "pipeline_timeline" / f"rank_{self.rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            keep_records_until(path, self.step)
            self.timeline = open(path, "a", encoding="utf-8")

    def _write_timeline(self, record) -> None:
        """This stage's step as the executor ran it, one JSON line per step (parallel/pipeline/timeline.py;
        `python -m scripts.pipeline_timeline` draws a step beside its simulation). With the process's peak resident
        set so far, beside the activations the schedule held."""
        from parallel.pipeline.timeline import StageTimeline
        line = {"step": self.step + 1, "rank": self.rank, "pipeline": min(self.r.layout.group_of(Axis.PP, self.rank)),
                **StageTimeline.of(self.pipeline.schedule, record).to_json(),
                "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        self.timeline.write(json.dumps(line) + "\n")
        self.timeline.flush()

    def fit(self) -> dict:
        t = self.r.training
        remaining = t.train_steps - self.step
        info(f"[train] steps {self.step}..{t.train_steps}, global batch {t.global_batch_size} x "
             f"{self.r.model.seq_length} tokens, {self.micro} micro-batch(es) per step", self.main)
        last, eval_loss = {}, None
        if remaining <= 0:
            return {"step": self.step}
        self._begin()
        batches = self.loader.as_mindspore_dataset(remaining).create_dict_iterator(output_numpy=True, num_epochs=1)
        try:
            for batch in batches:
                self.profiler.before(self.step + 1)
                start = time.perf_counter()
                values, loads = self.train_step(batch)
                self.logger.step_time(time.perf_counter() - start)
                self.profiler.after(self.step + 1, self.logger.step_times[-1])
                self.loader.advance(1)
                self.step += 1
                done = self.step == t.train_steps
                if self.migrator is not None and self.migrator.due(self.step):
                    self._migrate()
                if t.log_interval and (self.step % t.log_interval == 0 or self.step == 1) or done:
                    last = self.logger.log(self.step, values, loads,
                                           scalars={**self._traffic_bytes(), **self._placement_scalars()})
                if (t.eval_interval and self.step % t.eval_interval == 0) or done:
                    eval_loss = self.held_out_loss()
                    if eval_loss is not None:
                        self.logger.log_eval(self.step, eval_loss)
                if (t.save_interval and self.step % t.save_interval == 0) or done:
                    self.save()
        finally:
            self.logger.close()     # also when a step fails: what was logged is on disk
            self.profiler.close()
            if self.timeline is not None:
                self.timeline.close()
        summary = {**last, "eval_lm_loss": eval_loss}
        if self.main:
            (self.out / "logs" / "summary.json").write_text(json.dumps(summary, indent=1))
            if self.migrator is not None and not self.migrator.due(self.step):   # the last window's load
                self._heatmaps()
        return summary
