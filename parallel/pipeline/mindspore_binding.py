"""From a placement plan to MindSpore's pipeline configuration, in MindSpore's and MindFormers' own names.

Nothing here decides anything: the plan (placement + schedule) is made elsewhere. This module spells it as
- `mindspore.set_auto_parallel_context(pipeline_stages=p,
  pipeline_config={"pipeline_interleave": ..., "pipeline_scheduler": ...})`, or equally
  `AutoParallel(net, parallel_mode="semi_auto").pipeline(stages, interleave=, scheduler=)`;
- `mindspore.parallel.nn.Pipeline(network, micro_size, stage_config={cell name: stage})`, which sets each cell's
  `pipeline_stage`. With interleave on, MindSpore derives a cell's virtual chunk from the forward order (a stage
  seen again after a later stage is its next chunk), which is how MindFormers' `LayerSetting` assigns them;
  `pipeline_segment` is read only by the zero_bubble_v scheduler and is not set here;
- the overlapped schedule: 1F1B with `pp_1f1b_overlap` in the parallel speed-up JSON (MindSpore's switch that overlaps
  the named communication of one micro-batch's forward with another's backward in the 1F1B steady state);
- MindFormers' recipe keys (`parallel_config.pipeline_stage`, `micro_batch_num`, `model_config.offset` of shape
  [pp_interleave_num][pipeline_stage], `pp_interleave_num`, `parallel.pipeline_config`) where MindFormers can express
  the plan: it puts the embedding on stage 0 and the head and MTP on the last stage.
Because MindSpore reads chunks off the forward order, `bind` walks the network's forward order (`CellNames.order`)
and refuses a plan whose chunks that walk would not reproduce. An MTP kept apart from the head (on an earlier
stage) is such a plan for both networks named here: TeleChatMoE runs its head (norm, lm_head) before MTP, and
MindFormers' GPTModel its decoder.final_layernorm before mtp, so the MTP stage would be seen again after the
head's later stage and taken as one more chunk. MindFormers never does it (GPTModel pins `mtp` to the last stage,
beside `output_layer`); the placement's `mtp_apart_from_head` prices it for a network that runs MTP before its
whole head and gives it its own head copy.
It cannot run on CPU ("Invalid backend: CPU"); tests check the produced configuration and apply `stage_config`
through `Pipeline` to a network skeleton.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from oneline import InputError
from parallel.layout import MINDFORMERS_KEYS, LayoutError, ParallelLayout
from parallel.pipeline.placement import Placement

# our schedule -> (pipeline_interleave, pipeline_scheduler); MindSpore allows gpipe only with interleave on
SCHEDULERS = {"1f1b": (False, "1f1b"), "interleaved": (True, "1f1b"), "gpipe": (True, "gpipe"),
              "overlapped": (True, "1f1b")}
OVERLAPPED_COMM = "AlltoAll,AlltoAllV"  # the expert all-to-all is what the paired backward hides


class BindingError(InputError):
    """The plan and the layout or network disagree; the message names the field."""


LAYERS = "{layers}"  # stands for the decoder layers, in index order, in CellNames.order


@dataclass(frozen=True)
class CellNames:
    """Where each unit kind lives in the network, as `cells_and_names()` spells it, and the order in which the
    network's forward first runs those cells (LAYERS for the decoder layers); None: embedding, layers, head, MTP,
    the order of a network that computes its main loss before MTP (TeleChatMoE.head_losses)."""
    embedding: tuple[str, ...] = ("embedding",)
    layer: str = "decoder.layers.{i}"
    mtp: tuple[str, ...] = ("mtp",)
    head: tuple[str, ...] = ("decoder.final_layernorm", "output_layer")
    order: tuple[str, ...] | None = None

    def of(self, unit) -> tuple[str, ...]:
        if unit.kind in ("dense", "moe"):
            return (self.layer.format(i=unit.layer),)
        return {"embedding": self.embedding, "mtp": self.mtp, "head": self.head}[unit.kind]

    def forward_order(self, layers) -> list[str]:
        """Cell names in forward order, the decoder layers being `layers` (indices)."""
        order = self.order or (*self.embedding, LAYERS, *self.head, *self.mtp)
        out: list[str] = []
        for name in order:
            out += [self.layer.format(i=i) for i in sorted(layers)] if name == LAYERS else [name]
        return out


# MindFormers' GPTModel (TeleChat3, DeepSeek-V3): the decoder ends with its final norm, then MTP, then output_layer
MINDFORMERS_NAMES = CellNames(order=("embedding", LAYERS, "decoder.final_layernorm", "mtp", "output_layer"))


@dataclass(frozen=True)
class MindSporePipelineConfig:
    pipeline_stages: int
    pipeline_interleave: bool
    pipeline_scheduler: str
    micro_size: int
    stage_config: dict[str, int]  # cell name -> pipeline stage
    chunk_of: dict[str, int]  # cell name -> virtual chunk, as the forward order implies it
    parallel_speed_up: dict = field(default_factory=dict)  # content of parallel_speed_up_json_path
    mindformers: dict | None = None  # recipe keys, when MindFormers' offset can express the plan
    mindformers_gap: str = ""  # why not, otherwise

    def auto_parallel_context(self) -> dict:
        """Keyword arguments of mindspore.set_auto_parallel_context."""
        return {"pipeline_stages": self.pipeline_stages,
                "pipeline_config": {"pipeline_interleave": self.pipeline_interleave,
                                    "pipeline_scheduler": self.pipeline_scheduler}}

    def wrap(self, network):
        """network -> mindspore.parallel.nn.Pipeline(network, micro_size, stage_config): sets every planned cell's
        pipeline_stage (MindSpore raises KeyError for a name the network lacks)."""
        from mindspore.parallel.nn import Pipeline

        return Pipeline(network, self.micro_size, stage_config=dict(self.stage_config))

    def auto_parallel(self, cell):
        """The Ascend entry: AutoParallel(cell, "semi_auto") with this pipeline configured."""
        from mindspore.parallel.auto_parallel import AutoParallel

        net = AutoParallel(cell, parallel_mode="semi_auto")
        net.pipeline(stages=self.pipeline_stages, interleave=self.pipeline_interleave,
                     scheduler=self.pipeline_scheduler)
        return net


def _check_layout(placement: Placement, schedule: str, micro_size: int, layout: ParallelLayout | None) -> None:
    if schedule not in SCHEDULERS:
        raise BindingError(f"schedule: expected one of {sorted(SCHEDULERS)}, got {schedule!r}")
    if schedule == "1f1b" and placement.chunks > 1:
        raise BindingError(f"schedule: 1f1b runs one chunk per stage, the placement has {placement.chunks}")
    if micro_size < placement.stages:
        raise BindingError(f"parallel_config.micro_batch_num: {micro_size} micro-batches cannot fill "
                           f"{placement.stages} stages")
    if schedule in ("interleaved", "overlapped") and micro_size % placement.stages:
        raise BindingError(f"parallel_config.micro_batch_num: the {schedule} schedule needs a multiple of the "
                           f"{placement.stages} stages, got {micro_size}")
    if layout is None:
        return
    try:
        layout.validate()
    except LayoutError as e:
        key = MINDFORMERS_KEYS.get(e.field, e.field)
        raise BindingError(f"parallel_config.{key}: {e.reason(MINDFORMERS_KEYS)}") from None
    for key, plan_value, layout_value in (("pipeline_stage", placement.stages, layout.pp),
                                          ("pp_interleave_num", placement.chunks, layout.vpp),
                                          ("micro_batch_num", micro_size, layout.micro_batch_num)):
        if plan_value != layout_value:
            raise BindingError(f"parallel_config.{key}: the layout says {layout_value}, the pipeline plan "
                               f"{plan_value}")


def _mindformers_offset(placement: Placement) -> tuple[list[list[int]] | None, str]:
    """MindFormers' offset[chunk][stage] (layers above num_layers // (p*v)), or None and the reason."""
    p, v = placement.stages, placement.chunks
    segs = placement.segments
    last = len(segs) - 1
    for k, seg in enumerate(segs):
        for u in seg:
            if u.kind == "embedding" and k != 0:
                return None, f"the embedding is in segment {k}; MindFormers keeps it on stage 0, chunk 0"
            if u.kind in ("mtp", "head") and k != last:
                return None, (f"{u.name} is on stage {k % p}, chunk {k // p}; MindFormers puts the head and MTP on "
                              f"the last stage")
    counts = [sum(u.kind in ("dense", "moe") for u in seg) for seg in segs]
    base = sum(counts) // len(segs)
    if any(c == 0 for c in counts[1:-1]):
        return None, "a middle segment holds no decoder layer; MindFormers' LayerSetting needs at least one"
    return [[counts[c * p + s] - base for s in range(p)] for c in range(v)], ""


def _check_forward_order(placement: Placement, names: CellNames, stage_config: dict[str, int],
                         chunk_of: dict[str, int]) -> None:
    """MindSpore numbers chunks along the forward order (a stage below the previous cell's starts the next chunk);
    the plan's chunks must be what that walk finds."""
    layers = [u.layer for u in placement.units if u.kind in ("dense", "moe")]
    mtp_cells = {name for u in placement.units if u.kind == "mtp" for name in names.of(u)}
    head_stages = {stage_config[name] for u in placement.units if u.kind == "head" for name in names.of(u)}
    chunk, previous = 0, None
    for name in names.forward_order(layers):
        if name not in stage_config:
            continue
        stage = stage_config[name]
        if previous is not None and stage < stage_config[previous]:
            chunk += 1
        if chunk != chunk_of[name]:
            where = (f"{name} is on stage {stage} but runs after {previous} (stage {stage_config[previous]}) in the "
                     f"network's forward order, so MindSpore would take it as chunk {chunk}, the plan says chunk "
                     f"{chunk_of[name]}")
            if name in mtp_cells and stage not in head_stages:
                raise BindingError(f"mtp_apart_from_head: {where}; place MTP with the head (MindFormers pins mtp "
                                   f"to the last stage)")
            raise BindingError(f"stage_config: {where}")
        previous = name


def bind(placement: Placement, schedule: str, micro_size: int, layout: ParallelLayout | None = None,
         names: CellNames = MINDFORMERS_NAMES) -> MindSporePipelineConfig:
    """MindSpore's pipeline configuration for `placement` run with `schedule` over `micro_size` micro-batches,
    checked against the parallel layout when one is given."""
    _check_layout(placement, schedule, micro_size, layout)
    interleave, scheduler = SCHEDULERS[schedule]
    stage_config: dict[str, int] = {}
    chunk_of: dict[str, int] = {}
    for k, seg in enumerate(placement.segments):
        for unit in seg:
            for name in names.of(unit):
                if name in stage_config:
                    raise BindingError(f"cell {name!r} is named by two units; check the CellNames")
                stage_config[name] = k % placement.stages
                chunk_of[name] = k // placement.stages
    _check_forward_order(placement, names, stage_config, chunk_of)
    speed_up = {"pp_1f1b_overlap": OVERLAPPED_COMM} if schedule == "overlapped" else {}
    offset, gap = _mindformers_offset(placement)
    mindformers = None
    if offset is not None:
        mindformers = {
            "parallel_config": {"pipeline_stage": placement.stages, "micro_batch_num": micro_size},
            "model": {"model_config": {"offset": offset if placement.chunks > 1 else offset[0],
                                       "pp_interleave_num": placement.chunks}},
            "parallel": {"pipeline_config": {"pipeline_interleave": interleave, "pipeline_scheduler": scheduler}},
        }
    return MindSporePipelineConfig(placement.stages, interleave, scheduler, micro_size, stage_config, chunk_of,
                                   speed_up, mindformers, gap)
