"""A pipeline plan (placement + schedule + micro-batch count) as MindFormers' recipe keys, for running the same plan
under MindFormers 1.9 on Ascend. This project trains with its own engine (`executor.py`); nothing here runs anything.

The keys, with the names and shapes MindFormers reads:
- `parallel_config.pipeline_stage` and `parallel_config.micro_batch_num`;
- `model.model_config.pp_interleave_num` and `model.model_config.offset`: the decoder layers of each (chunk, stage)
  above num_layers // (pipeline_stage * pp_interleave_num), of shape [pp_interleave_num][pipeline_stage], flat
  [pipeline_stage] with one chunk (as MindFormers' own recipes write it). Its `LayerSetting` turns it back into each
  layer's stage and chunk, numbering chunk c of stage s as our segment c * p + s;
- `parallel.pipeline_config` (`pipeline_interleave`, `pipeline_scheduler`): MindFormers hands the `parallel`
  section to `mindspore.set_auto_parallel_context`, which allows a scheduler other than 1f1b only with interleave on,
  and LayerSetting reads `pp_interleave_num` only when `pipeline_interleave` is on.

MindFormers cannot express every placement: GPTModel pins the embedding to stage 0 and the output layer and MTP to
the last stage; every segment but the first needs a decoder layer (LayerSetting refuses an empty middle one, and
lets the last one be empty, but then the final norm, which TransformerBlock puts on the last layer's stage, and the
MTP layers, which MultiTokenPrediction gives the last layer's stage, leave the head); with one stage MindFormers
resets micro_batch_num to 1. The overlapped schedule is MindSpore's `pp_1f1b_overlap`, set in the
parallel_speed_up JSON file rather than in the recipe. Such plans are refused with one line naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass

from oneline import InputError
from parallel.layout import MINDFORMERS_KEYS, LayoutError, ParallelLayout
from parallel.pipeline.placement import Placement

# our schedule -> (pipeline_interleave, pipeline_scheduler)
SCHEDULERS = {"1f1b": (False, "1f1b"), "interleaved": (True, "1f1b"), "gpipe": (True, "gpipe")}


class ExportError(InputError):
    """A plan MindFormers' recipe keys cannot express, or a layout that contradicts it; the message names the key."""


@dataclass(frozen=True)
class MindFormersPipeline:
    pipeline_stage: int
    micro_batch_num: int
    pp_interleave_num: int
    offset: tuple[tuple[int, ...], ...]  # [chunk][stage]
    pipeline_interleave: bool
    pipeline_scheduler: str

    def recipe_keys(self) -> dict:
        """The keys nested as a MindFormers recipe holds them."""
        offset = [list(row) for row in self.offset]
        return {
            "parallel_config": {"pipeline_stage": self.pipeline_stage, "micro_batch_num": self.micro_batch_num},
            "parallel": {"pipeline_config": {"pipeline_interleave": self.pipeline_interleave,
                                             "pipeline_scheduler": self.pipeline_scheduler}},
            "model": {"model_config": {"offset": offset if self.pp_interleave_num > 1 else offset[0],
                                       "pp_interleave_num": self.pp_interleave_num}},
        }


def _check_plan(placement: Placement, schedule: str, micro_batch_num: int, layout: ParallelLayout | None) -> None:
    if schedule == "overlapped":
        raise ExportError("schedule: MindFormers' recipe keys cannot express 'overlapped' (MindSpore's "
                          "pp_1f1b_overlap lives in the parallel_speed_up JSON file); export 'interleaved'")
    if schedule not in SCHEDULERS:
        raise ExportError(f"schedule: expected one of {sorted(SCHEDULERS)}, got {schedule!r}")
    if placement.stages == 1:
        raise ExportError("parallel_config.pipeline_stage: the plan has 1 stage; MindFormers' pipeline keys need 2 "
                          "or more (with one stage it resets micro_batch_num to 1)")
    if schedule == "1f1b" and placement.chunks > 1:
        raise ExportError(f"schedule: 1f1b runs one chunk per stage, the placement has {placement.chunks}")
    if micro_batch_num < placement.stages:
        raise ExportError(f"parallel_config.micro_batch_num: {micro_batch_num} micro-batches cannot fill "
                          f"{placement.stages} stages")
    if schedule == "interleaved" and micro_batch_num % placement.stages:
        raise ExportError(f"parallel_config.micro_batch_num: the interleaved schedule needs a multiple of the "
                          f"{placement.stages} stages, got {micro_batch_num}")
    if layout is None:
        return
    try:
        layout.validate()
    except LayoutError as e:
        key = MINDFORMERS_KEYS.get(e.field, e.field)
        raise ExportError(f"parallel_config.{key}: {e.reason(MINDFORMERS_KEYS)}") from None
    for key, plan_value, layout_value in (("pipeline_stage", placement.stages, layout.pp),
                                          ("pp_interleave_num", placement.chunks, layout.vpp),
                                          ("micro_batch_num", micro_batch_num, layout.micro_batch_num)):
        if plan_value != layout_value:
            raise ExportError(f"parallel_config.{key}: the layout says {layout_value}, the pipeline plan "
                              f"{plan_value}")


def _offset(placement: Placement) -> tuple[tuple[int, ...], ...]:
    """offset[chunk][stage], after checking that MindFormers' fixed places for the other units match the plan."""
    p, v = placement.stages, placement.chunks
    segs = placement.segments
    last = len(segs) - 1
    for k, seg in enumerate(segs):
        for u in seg:
            if u.kind == "embedding" and k != 0:
                raise ExportError(f"model_config.offset: the embedding is on stage {k % p}, chunk {k // p}; "
                                  f"MindFormers keeps it on stage 0, chunk 0")
            if u.kind in ("mtp", "head") and k != last:
                raise ExportError(f"model_config.offset: {u.name} is on stage {k % p}, chunk {k // p}; MindFormers "
                                  f"puts the head and MTP on the last stage's last chunk (mtp_apart_from_head off)")
    counts = [sum(u.kind in ("dense", "moe") for u in seg) for seg in segs]
    empty = [k for k in range(1, last + 1) if counts[k] == 0]
    if empty:
        k = empty[0]
        raise ExportError(f"model_config.offset: stage {k % p}, chunk {k // p} holds no decoder layer; MindFormers "
                          f"needs one in every segment but the first (the last one's keeps the final norm and MTP "
                          f"with the head)")
    base = sum(counts) // len(segs)
    return tuple(tuple(counts[c * p + s] - base for s in range(p)) for c in range(v))


def export(placement: Placement, schedule: str, micro_batch_num: int,
           layout: ParallelLayout | None = None) -> MindFormersPipeline:
    """MindFormers' keys for `placement` run with `schedule` (a parallel.pipeline.schedules name) over
    `micro_batch_num` micro-batches, checked against the parallel layout when one is given."""
    _check_plan(placement, schedule, micro_batch_num, layout)
    interleave, scheduler = SCHEDULERS[schedule]
    return MindFormersPipeline(placement.stages, micro_batch_num, placement.chunks, _offset(placement), interleave,
                               scheduler)
