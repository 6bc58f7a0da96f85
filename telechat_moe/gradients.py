"""How a step's gradients are reduced, measured and clipped, and the loss scale they are unscaled by.

A dense gradient is summed over the data-parallel group (a replicated weight whose gradient is only the rank's share
under tensor parallelism, also over the tensor-parallel group); a routed expert's over the ranks holding the same
experts. `PrepareGradients` runs inside the step's graph (telechat_moe/train_step.py, the pipeline engine's
telechat_moe/pipeline_step.py) and hands the optimizer the summed gradients with one factor that unscales, averages
and clips them. Under the distributed optimizer (parallel/optim; `Update.of` chooses) the same reductions are
made per bucket, as reduce-scatters whose routes `gradient_route` gives, and each rank keeps its slice.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mindspore import ParameterTuple, Tensor, nn, ops

from dvm_fusion.square_sums import square_sums_for
from parallel.comm import ProcessGroups, transport_for
from parallel.layout import Axis
from parallel.optim import Route
from parallel.optim.distributed import clip_factor
from parallel.optim.memory import uses_distributed
from telechat_moe.model import TeleChatMoE
from telechat_moe.optim import (build_adamw, build_distributed, cast_weights, ordered_like_adamw, sharded_gradients,
                                weight_decay_of)
from telechat_moe.recipe_schema import Recipe


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
    over the tp group and of the expert shards over the expert group (ep x etp), so it is the norm of the whole
    model's gradient."""

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
        self.dense, self.tp, self.edp, self.expert = comm.dp, comm.tp, comm.edp, comm.expert
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
                   + self.expert.all_reduce((each * self.expert_mask).sum()))
        if self.stages is not None:
            squares = self.stages.all_reduce(squares)
        factor, norm, finite = clip_factor(squares, grad_scale, self.dp, self.clip)
        return reduced, factor, norm, finite


@dataclass
class GradientGroups:
    """The transports gradients are reduced on: data-parallel (data x context: a context-parallel rank's gradient is
    that of its part of the sequence, parallel/cp), expert-data-parallel, expert-parallel and tensor-parallel
    groups; the expert group (ep x etp ranks: every expert shard once, the norm's sum; the EP group's transport
    where etp = 1) and the expert-tensor-parallel group (tensor dumps put its shards together)."""
    dp: object
    edp: object
    ep: object
    tp: object
    expert: object
    etp: object

    def transports(self) -> dict:
        """By the names the distributed optimizer's routes use (telechat_moe/gradients.py: gradient_route)."""
        return {"dp": self.dp, "edp": self.edp, "ep": self.ep, "tp": self.tp, "expert": self.expert}

    @classmethod
    def of(cls, layout, rank: int, device_target: str) -> "GradientGroups":
        groups = ProcessGroups(layout, rank)
        dp, edp, ep, tp, etp = (transport_for(groups.axis(*a), device_target)
                                for a in ((Axis.DP, Axis.CP), (Axis.EDP,), (Axis.EP,), (Axis.TP,), (Axis.ETP,)))
        return cls(dp, edp, ep, tp, ep if layout.etp == 1 else transport_for(groups.expert(), device_target), etp)


def gradient_route(kind: int, weight_decay: float) -> Route:
    """The distributed optimizer's route of a gradient of `kind`: PrepareGradients' reductions, per bucket."""
    if kind == EXPERT:
        return Route("edp", norm_sum="expert", weight_decay=weight_decay)
    if kind == PARTIAL:
        return Route("dp", pre_sum="tp", weight_decay=weight_decay)
    return Route("dp", norm_sum="tp" if kind == TP_SHARD else None, weight_decay=weight_decay)


@dataclass
class Update:
    """The trainer's optimizer and how its gradients are prepared: `weights` in the order both take gradients,
    `prepare(counted, pp)` the Cell that reduces them (PrepareGradients, or the distributed optimizer's
    ShardedGradients), `distributed` which of the two (telechat_moe/optim.py)."""
    weights: ParameterTuple
    optimizer: nn.Cell
    prepare: object
    distributed: bool

    @classmethod
    def of(cls, recipe: Recipe, model: TeleChatMoE, groups: "GradientGroups", tp_axes: dict, device: str):
        o, p, lay = recipe.optimizer, recipe.parallel_config, recipe.layout
        distributed = uses_distributed(p.optimizer_shard, lay.dp * lay.cp, lay.edp, recipe.model.params_dtype)
        if distributed:
            cast_weights(model.trainable_params(), recipe.model.params_dtype)
            weights = ParameterTuple(ordered_like_adamw(model.trainable_params()))
            kinds = [gradient_kind(w.name, model, tp_axes) for w in weights]
            optimizer = build_distributed(list(weights), [gradient_route(k, weight_decay_of(w, o.weight_decay))
                                                          for k, w in zip(kinds, weights)],
                                          groups.transports(), o, p.ddp_bucket_size, device)

            def prepare(counted=None, pp=None):
                # the pipeline engine sums its micro-batches itself, in its own accumulators
                return sharded_gradients(optimizer, groups.transports(), p.data_parallel, o.grad_clip, counted, pp,
                                         accumulate=p.micro_batch_num > 1 and pp is None)
            return cls(weights, optimizer, prepare, True)
        optimizer = build_adamw(model.trainable_params(), o.learning_rate, o.betas, o.eps, o.weight_decay, device)
        # Gradients must come in the optimizer's order, which groups decayed parameters first.
        kinds = tuple(gradient_kind(w.name, model, tp_axes) for w in optimizer.parameters)

        def prepare(counted=None, pp=None):
            return PrepareGradients(optimizer.parameters, kinds, p.data_parallel, o.grad_clip, groups, counted, pp,
                                    device)
        return cls(optimizer.parameters, optimizer, prepare, False)


def is_routed_expert(name: str) -> bool:
    """A routed expert's weight, or one of its optimizer moments: sharded over the EP group along dim 0."""
    return ".experts." in f".{name}"


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
