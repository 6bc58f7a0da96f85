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

import json
import time
from pathlib import Path

import numpy as np
import mindspore as ms
import yaml
from mindspore import Tensor, nn, ops

from dvm_fusion.grouped_matmul import KERNEL_CLOCK
from parallel.comm.counters import counting
from parallel.cp import ContextParallel
from parallel.layout import Axis
from parallel.pipeline.schedules import ChunkLayout
from parallel.tp.mappings import TensorParallel
from telechat_moe.batches import (SampleLog, batch_tensors, prepare_run_data, publish_tokenizer, source_shares,
                                  train_loader)
from telechat_moe.collectives_log import CollectiveLog
from telechat_moe.checkpoint import Shard, load_checkpoint, preflight, resume_point, save_checkpoint
from telechat_moe.context import configure_mindspore  # noqa: F401  (the entry points' import)
from telechat_moe.evaluation import Evaluate, held_out_share
from telechat_moe.expert_monitor import PlacementMonitor, traffic_scalars
from telechat_moe.expert_placement import ExpertMigrator
from telechat_moe.expert_tp_checkpoint import split_marker, whole_over_etp, whole_placeholders
from telechat_moe.dry_run import static_memory
from telechat_moe.gradients import GradientGroups, LossScaler, Update, is_routed_expert
from telechat_moe.metrics import StepLogger, Timer, info
from telechat_moe.model import TeleChatMoE
from telechat_moe.moe.dispatch import ExpertParallel
from telechat_moe.moe.replicas import SumReplicaGradients, outside_checkpoints
from telechat_moe.moe.router import expert_bias_delta
from telechat_moe.optim import lr_at
from telechat_moe.optimizer_state import OptimizerCheckpoint, held_bytes
from telechat_moe.pipeline_log import TimelineLog
from telechat_moe.pipeline_step import PipelineTrainStep, reuse_layers, stage_plan
from telechat_moe.profiling import StepProfiler
from telechat_moe.recipe_schema import Recipe
from telechat_moe.step_dump import StepDumps
from telechat_moe.train_step import (ForwardBackward, MoveExpertBiases, OverRanks, TrainStep, release_freed_heap,
                                     routed_layers)


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
             f"{self.data.tokenizer.vocab_size} ({tm.seconds:.2f}s)", self.main)

        device = recipe.context.device_target
        counting(recipe.profile.collectives)    # before any transport is built (parallel/comm/counters.py)
        self.ep = ExpertParallel.of(recipe.layout, rank, cfg.moe_token_dispatcher_type, device,
                                    recipe.expert_placement.spare_slots)
        self.tp = TensorParallel.of(recipe.layout, rank, device)
        self.cp = ContextParallel.of(recipe.layout, rank, device, cfg.seq_length)
        self.stages = p.pipeline_stage
        self.plan = stage_plan(recipe, rank) if self.stages > 1 else None
        parts = self.plan.parts(cfg.num_nextn_predict_layers > 0) if self.plan else None
        if self.plan:
            where = ("chunks k and 2p-1-k on stage k" if self.plan.chunk_layout is ChunkLayout.V
                     else f"chunk k on stage k % {self.stages}")
            info(f"[pipeline] layers per chunk {[e - b for b, e in self.plan.bounds]} ({where}); placement:\n"
                 f"{self.plan.description}", self.main)
        self.model = TeleChatMoE(cfg, device, self.ep, self.tp, parts, reuse_layers(recipe, self.plan), self.cp)
        self.model.set_recompute(recipe.recompute_config.mode)
        self.groups = GradientGroups.of(recipe.layout, rank, device)
        self._tp_axes = self.model.tp_split_axes()
        # replicated or distributed optimizer (telechat_moe/gradients.py: Update); gradients come in its order
        update = Update.of(recipe, self.model, self.groups, self._tp_axes, device)
        self.weights, self.optimizer, prepare = update.weights, update.optimizer, update.prepare
        # the distributed optimizer's state by weight name, for checkpoints (telechat_moe/optimizer_state.py)
        self.sliced_state = OptimizerCheckpoint(self.optimizer, [None if outside_checkpoints(w.name) else w.name
                                                                 for w in self.weights],
                                                self._shards(self.weights)) if update.distributed else None

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
        self.scaler = LossScaler.from_recipe(recipe)
        self.micro = p.micro_batch_num
        self.loader = train_loader(recipe, self.data.train, self.dp_rank)
        self.step = 0
        self.dumper = StepDumps(recipe, rank, self.out, self.model, self.optimizer, self.groups, self._tp_axes,
                                self.tp.sp, self.ep.ep, self.pipeline, self.plan, self.migrator) \
            if t.dump_steps else None
        self.profiler = StepProfiler.of(recipe, rank)     # MindSpore's profiler around profile.steps
        self.timeline = None        # the pipeline's per-step timeline file (TimelineLog), opened by _begin
        self.collectives = None     # each step's counted collectives (CollectiveLog), opened by _begin

        shape = cfg.to_model_shape()
        from parallel.planner.model_shape import flops_per_token
        self.peak_flops = peak_flops
        # Opened by fit(), once resume() has passed: a run refused before its first step touches no earlier log.
        self.logger = StepLogger(self.out / "logs", self.main, t.train_steps, t.global_batch_size * cfg.seq_length,
                                 flops_per_token(shape)["training"], peak_flops, world)
        self.placement = PlacementMonitor(self.migrator, self.router_rows, self.logger, self.out, self.main) \
            if self.migrator is not None else None
        self._memory_line()
        n_params = sum(w.size for w in self.weights)
        n_experts = sum(w.size for w in self.weights if is_routed_expert(w.name))
        info(f"[model] {n_params:,} trainable parameters on this rank ({n_experts:,} in its routed experts "
             f"{self.ep.experts(cfg.n_routed_experts)}); layout {recipe.layout.describe()}; "
             f"peak {peak_flops / 1e9:.1f} GFLOP/s per device for MFU", self.main)

    def _memory_line(self) -> None:
        """What this rank holds between steps, measured (the bytes of its weights, optimizer state and gradient
        buffers as allocated), beside the dry run's figure for its stage."""
        held = list(self.model.get_parameters()) + list(self.optimizer.get_parameters())
        held += list(self.pipeline.accumulators) if self.pipeline is not None else list(
            self.step_graph.get_parameters())
        self.held_bytes = held_bytes(held)
        planned = static_memory(self.r)["per_stage"][self.r.layout.coords(self.rank)[Axis.PP]]["held"]
        info(f"[memory] rank {self.rank} holds {self.held_bytes:,} bytes of weights, optimizer state and gradient "
             f"buffers; the dry run says {planned:,.0f} for its stage ({self.held_bytes / planned - 1:+.2%}); "
             f"optimizer {'distributed' if self.sliced_state else 'replicated'}; "
             f"{sum(w.size for w in self.weights):,} trainable parameters", True)

    # -- data --
    def _prepare_data(self):
        data, self.new_tokenizer = prepare_run_data(self.r, self.rank, self.out)
        return data

    def _publish_tokenizer(self) -> None:
        if self.new_tokenizer is not None:
            publish_tokenizer(self.new_tokenizer, self.out, self.rank)
            self.new_tokenizer = None

    def _tensors(self, batch: dict, rows: slice) -> tuple:
        return batch_tensors(batch, rows)

    # -- checkpoints --
    def _all_params(self) -> list:
        """What a checkpoint holds: every parameter and optimizer state but the replicas' (rebuilt on resume)."""
        seen, out = set(), []
        # the distributed optimizer's slices are saved by weight name (_sliced_entries)
        held = [self.optimizer.global_step, self.optimizer.learning_rate] if self.sliced_state \
            else list(self.optimizer.get_parameters())
        for p in list(self.model.get_parameters()) + held:
            if p.name not in seen and not outside_checkpoints(p.name):
                seen.add(p.name)
                out.append(p)
        return out

    def _shards(self, params=None) -> dict:
        """The slices this rank checkpoints (of `params`, default all it saves): routed experts along dim 0 over the
        EP group, tensor-parallel weights along their split axis over the tp group (with the replicated optimizer's
        Adam moments); the rest is replicated."""
        out = {}
        for p in self._all_params() if params is None else params:
            axis = self._tp_axes.get(p.name.split(".", 1)[1] if p.name.startswith("adam_") else p.name)
            if axis is not None:
                out[p.name] = Shard(axis, self.tp.index * p.shape[axis], self.tp.tp * p.shape[axis])
            elif self.ep.tensor.etp > 1 and is_routed_expert(p.name):   # saved whole over etp (_etp_whole)
                out[p.name] = split_marker(p.name, p.shape, self.ep.tensor)
            elif self.ep.ep > 1 and is_routed_expert(p.name):
                e = self.r.model.n_routed_experts
                out[p.name] = Shard(0, self.ep.experts(e)[0], e)
        return out

    def _expert_shard(self, name: str) -> Shard | None:
        """A routed expert's whole-FFN entry: its experts along dim 0 over the EP group (None: all of them here)."""
        e = self.r.model.n_routed_experts
        return Shard(0, self.ep.experts(e)[0], e) if self.ep.ep > 1 else None

    @staticmethod
    def _with(params: list, shards: dict, more: tuple) -> tuple[list, dict]:
        return params + more[0], {**shards, **more[1]}

    def save(self) -> None:
        # No random draw happens after initialisation (no dropout; the data order is a function of seed and
        # epoch), so the seed and the data position are the whole random state.
        state = {"step": self.step, "data": self.loader.state_dict(), "loss_scale": self.scaler.scale,
                 "loss_scale_good_steps": self.scaler.good_steps, "seed": self.r.seed, "recipe": self.r.name}
        if self.migrator is not None:
            state.update(self.migrator.state_dict())
        params, shards = self._all_params(), self._shards()
        if self.sliced_state is not None:       # this rank's slices of the optimizer state
            params, shards = self._with(params, shards, self.sliced_state.tensors())
        if self.ep.tensor.etp > 1:              # routed experts whole over etp (telechat_moe/expert_tp_checkpoint.py)
            params, shards = whole_over_etp(params, shards, self.ep.tensor, self._expert_shard)
        path = save_checkpoint(self.out / "checkpoints", self.rank, self.step, params, state,
                               self.r.training.keep_checkpoints, shards=shards, world=self.world)
        info(f"[ckpt] saved {path}", self.main)

    def resume(self) -> bool:
        path = resume_point(self.out / "checkpoints", self.rank)
        if path is None:
            info("[ckpt] --resume: no checkpoint found, starting from step 0", self.main)
            return False
        from telechat_moe.checkpoint import TRAINER_STATE
        # a {} or mistyped state is one line; expert shards saved at another expert_parallel are resharded
        params, shards = self._all_params(), self._shards()
        if self.sliced_state is not None:       # this rank's slices, cut from whatever layout saved them
            params, shards = self._with(params, shards, self.sliced_state.placeholders())
        if self.ep.tensor.etp > 1:
            params, shards, restore = whole_placeholders(params, shards, self.ep.tensor, self._expert_shard)
        state = load_checkpoint(path, params, TRAINER_STATE, shards=shards)
        if self.ep.tensor.etp > 1:
            restore()
        if self.sliced_state is not None:
            self.sliced_state.apply()
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
        forward = self.dumper.forward_records(batch) if dumping else []
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
            self.timeline.write(self.step + 1, result.record)
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
        if self.placement is not None:
            self.placement.observe(loads, self.step + 1, KERNEL_CLOCK.take())
        total, lm, mtp, aux, z = self._mean_over_ranks(sums / self.micro)
        values = {"loss": total, "lm_loss": lm, "mtp_loss": mtp, "aux_loss": aux, "grad_norm": float(norm.asnumpy()),
                  "lr": lr}
        if self.r.model.moe_z_loss_coeff:
            values["z_loss"] = z
        if self.scaler.dynamic:
            values["loss_scale"] = self.scaler.scale
        if dumping:
            self.dumper.write(self.step + 1, forward, values, grads)
        if self.loader.attention_balance == "repack":   # share of this batch's tokens repack cut from their context
            values["context_loss"] = self.loader.context_loss
        values.update(source_shares(self.loader))
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

    def learning_rate(self, step: int) -> float:
        o, sched = self.r.optimizer, self.r.lr_schedule
        decay = sched.decay_steps or self.r.training.train_steps
        return lr_at(step, o.learning_rate, o.min_lr, sched.warmup_steps, decay, sched.type)

    def held_out_loss(self) -> float | None:
        held = self.data.held_out
        if held is None or len(held) == 0 or self.r.training.eval_batches == 0:
            return None
        share = held_out_share(self.r, held, self.dp_rank, self.ep.ep, self._lm_loss)
        return float(self._mean_over_ranks(np.array([share]))[0])

    def _lm_loss(self, batch: dict, rows: slice) -> float:
        if self.pipeline is not None:      # the LM loss on the last stage, 0 elsewhere
            return float(self.pipeline.evaluate(self._tensors(batch, rows))[1])
        return float(self._run_graph(self.evaluate, *self._tensors(batch, rows)).asnumpy())

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
            self.timeline = TimelineLog(self.out, self.rank, self.r.layout, self.pipeline.schedule, self.step)
        if self.r.profile.collectives:
            self.collectives = CollectiveLog(self.out, self.rank, self.step)

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
        samples = SampleLog(self.out, self.rank) if self.r.data.log_samples else None
        try:
            for batch in batches:
                self.profiler.before(self.step + 1)
                start = time.perf_counter()
                values, loads = self.train_step(batch)
                self.logger.step_time(time.perf_counter() - start)
                if self.collectives is not None:
                    self.collectives.write(self.step + 1, self.weights)
                if samples is not None:
                    samples.write(self.step + 1, self.loader)
                self.profiler.after(self.step + 1, self.logger.step_times[-1])
                self.loader.advance(1)
                self.step += 1
                done = self.step == t.train_steps
                if self.placement is not None and self.migrator.due(self.step):
                    self.placement.migrate(self.step)
                if t.log_interval and (self.step % t.log_interval == 0 or self.step == 1) or done:
                    last = self.logger.log(self.step, values, loads,
                                           scalars={**traffic_scalars(self.r.model, self.ep.ep, self.traffic,
                                                                      loads.sum()),
                                                    **(self.placement.scalars() if self.placement else {})})
                if (t.eval_interval and self.step % t.eval_interval == 0) or done:
                    eval_loss = self.held_out_loss()
                    if eval_loss is not None:
                        self.logger.log_eval(self.step, eval_loss)
                if (t.save_interval and self.step % t.save_interval == 0) or done:
                    self.save()
        finally:
            self.logger.close()     # also when a step fails: what was logged is on disk
            if samples is not None:
                samples.close()
            self.profiler.close()
            if self.timeline is not None:
                self.timeline.close()
            if self.collectives is not None:
                self.collectives.close()
        summary = {**last, "eval_lm_loss": eval_loss}
        if self.main:
            (self.out / "logs" / "summary.json").write_text(json.dumps(summary, indent=1))
            if self.migrator is not None and not self.migrator.due(self.step):   # the last window's load
                self.placement.heatmaps(self.step)
        return summary
