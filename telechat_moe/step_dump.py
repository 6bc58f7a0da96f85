"""Tensor dumps of training steps (`training.dump_steps`; precision/dump.py), for `python -m precision.compare`.

A dump holds the whole model's tensors whatever the layout: the forward stream of the global batch per layer, the
losses, and every weight's gradient and Adam moments, the slices of the tensor-parallel, expert-parallel and
pipeline groups put together and the experts back in their original order, so that any layout aligns with any.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from mindspore import Tensor, nn, ops

from parallel.comm import ProcessGroups, transport_for
from parallel.layout import Axis
from parallel.tp.expert import packed_whole
from telechat_moe.batches import batch_tensors
from telechat_moe.gradients import is_routed_expert
from telechat_moe.model import TeleChatMoE
from telechat_moe.moe.replicas import outside_checkpoints
from telechat_moe.recipe_schema import Recipe


class LayerOutputs(nn.Cell):
    def __init__(self, model: TeleChatMoE):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, segment_ids, position_ids):
        return self.model.layer_outputs(input_ids, segment_ids, position_ids)


def gather_along(transport, x: np.ndarray, axis: int) -> np.ndarray:
    """Every group member's `x` put together along `axis`, in group order (the transports gather along axis 0)."""
    moved = np.ascontiguousarray(np.moveaxis(x, axis, 0))
    return np.moveaxis(transport.all_gather(Tensor(moved)).asnumpy(), 0, axis)


class StepDumps:
    """The dumps of one rank. `groups`: the trainer's GradientGroups; `tp_axes`: the model's tp_split_axes();
    `pipeline`, `plan`: the pipeline engine and its stage plan (None without pipeline parallelism); `migrator`: the
    dynamic expert placement (None without it)."""

    def __init__(self, recipe: Recipe, rank: int, out: Path, model: TeleChatMoE, optimizer, groups,
                 tp_axes: dict[str, int], sp: bool, ep: int, pipeline=None, plan=None, migrator=None):
        from precision.dump import DumpWriter, config_hash, layout_meta, parse_steps
        self.r, self.optimizer, self.groups, self.tp_axes, self.sp, self.ep = recipe, optimizer, groups, tp_axes, sp, ep
        self.pipeline, self.plan, self.migrator = pipeline, plan, migrator
        self.micro = recipe.parallel_config.micro_batch_num
        self.layer_outputs = LayerOutputs(model) if pipeline is None else None
        # a pipeline stage holds some layers: the dump puts every stage's tensors together over the pipeline group
        self.stage_group = transport_for(ProcessGroups(recipe.layout, rank).axis(Axis.PP),
                                         recipe.context.device_target) if pipeline is not None else None
        # the dense gradients' group is data x context: the batch's rows come from the data-parallel group alone,
        # the sequence's positions from the context-parallel group
        groups_here = ProcessGroups(recipe.layout, rank)
        self.rows_group = transport_for(groups_here.axis(Axis.DP), recipe.context.device_target)
        self.context_group = transport_for(groups_here.axis(Axis.CP), recipe.context.device_target) \
            if recipe.layout.cp > 1 else None
        t = recipe.training
        meta = {"model_config_hash": config_hash(recipe.model.function()), "layout": layout_meta(recipe.layout),
                "dtype": recipe.model.compute_dtype, "recipe": recipe.name}
        self.writer = DumpWriter(Path(t.dump_dir or out / "dump"), meta,
                                 steps=parse_steps(t.dump_steps, "training.dump_steps"), rank=rank)

    def wants(self, step: int) -> bool:
        return self.writer.wants(step)

    def _forward_places(self) -> list[tuple[str, int | None, str]]:
        """(name, layer, operator) of the dump's forward tensors (`TeleChatMoE.layer_outputs`), in forward order:
        the embedding, per layer the stream after attention and after the FFN (MoE or dense), the final norm."""
        cfg = self.r.model
        where = [("embed_tokens", None, "embed_tokens")]
        for i in range(cfg.num_hidden_layers):
            where += [(f"layers.{i}.self_attn", i, "self_attn"), (f"layers.{i}", i, "moe" if cfg.is_moe_layer(i)
                                                                                else "mlp")]
        return where + [("norm", None, "norm")]

    def forward_records(self, batch: dict) -> list:
        """The forward tensors of the global batch, micro-batch by micro-batch as the step computes (a capacity
        factor drops per micro-batch's tokens), so that a parallel run compares with any layout's."""
        from parallel.comm.named import all_gather_named
        from precision.dump import TensorRecord
        local = batch["input_ids"].shape[0]
        mb = local // self.micro
        places = self._forward_places()
        if self.pipeline is not None:
            micro = self.pipeline.microbatches(lambda rows: batch_tensors(batch, rows), local, self.micro)
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
                ids, _, _, segments, positions = batch_tensors(batch, slice(i * mb, (i + 1) * mb))
                parts.append(self.layer_outputs(ids, segments, positions))
            outs = [self._global_batch(ops.concat(pieces, 0).asnumpy()) for pieces in zip(*parts)]
        return [TensorRecord(name, "forward", out, layer=layer, operator=op, k=self.r.model.hidden_size, dims="bsh")
                for (name, layer, op), out in zip(places, outs)]

    def _global_batch(self, out: np.ndarray) -> np.ndarray:
        """This rank's [..., b, s', h] -> the global batch's [..., dp*b, s, h]: its sequence shards put together
        over the tensor-parallel group under sequence parallelism, then over the context-parallel group (in
        sequence order), then the data-parallel ranks' rows in order."""
        if self.sp:
            out = gather_along(self.groups.tp, out, -2)
        if self.context_group is not None:
            from parallel.cp import gathered_order
            out = gather_along(self.context_group, out, -2)
            out = np.take(out, gathered_order(out.shape[-2], self.r.layout.cp), axis=-2)
        return gather_along(self.rows_group, out, -3)

    def write(self, step: int, forward: list, values: dict, grads) -> None:
        """The step's dump: `forward` from forward_records, the logged losses in `values`, the reduced `grads`."""
        from precision.capture import grad_records, optimizer_records
        from precision.dump import TensorRecord
        opt = self.optimizer
        weights = opt.parameters
        # the one-process model's tensors: the replicas in spare slots are copies of their home experts
        kept = [i for i, p in enumerate(weights) if not outside_checkpoints(p.name)]
        names = [weights[i].name for i in kept]
        records = forward + [TensorRecord(k, "loss", np.float32(v)) for k, v in values.items() if k.endswith("loss")]
        # the whole model's tensors: a routed expert's gathered from the EP group, a tensor-parallel slice from the
        # tp group, a pipeline stage's from the pipeline group, so any layout aligns with any
        moments = (opt.exp_avg, opt.exp_avg_sq)
        if hasattr(opt, "plan"):    # the distributed optimizer: every weight's gradient and moments, whole over dp
            from parallel.optim import state
            grads, whole = state.whole_gradients(opt, grads), state.whole_states(opt)
            moments = (whole["adam_m"], whole["adam_v"])
        states = {kind: [self._whole(names[j], values[i]) for j, i in enumerate(kept)]
                  for kind, values in (("grad", grads), ("adam_m", moments[0]), ("adam_v", moments[1]))}
        if self.migrator is not None:    # experts and router rows in the experts' original order
            from precision.dump import to_numpy
            states = {kind: [self.migrator.original_order(n, to_numpy(v)[0]) for n, v in zip(names, values)]
                      for kind, values in states.items()}
        if self.pipeline is not None:
            names, states = self._whole_pipeline(names, states)
        records += grad_records(names, states["grad"])
        records += optimizer_records({"adam_m": states["adam_m"], "adam_v": states["adam_v"]}, names)
        self.writer.write(step, records)

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
        axis = self.tp_axes.get(name)
        value = tensor.asnumpy() if isinstance(tensor, Tensor) else tensor
        if axis is not None:
            return gather_along(self.groups.tp, value, axis)
        etp = self.r.layout.etp
        if not is_routed_expert(name) or self.ep == etp == 1:
            return tensor
        if etp > 1:     # each expert's columns of gate and up (w1, packed) or rows of down (w2) over the etp group
            value = packed_whole(gather_along(self.groups.etp, value, -1), etp) if name.endswith("w1") \
                else gather_along(self.groups.etp, value, 1)
        return value if self.ep == 1 else gather_along(self.groups.ep, value, 0)
