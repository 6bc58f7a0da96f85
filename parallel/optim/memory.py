"""Which optimizer a run steps with and what it holds between micro-batches: the facts the trainer and the memory
formula (parallel/planner/model_shape.py: rank_static_bytes) must agree on, kept free of MindSpore so the dry run
and the planner read them without it."""
from __future__ import annotations


def uses_distributed(optimizer_shard: bool, dp: int, edp: int, params_dtype: str) -> bool:
    """Whether the distributed optimizer steps the run: sharding asked for over a data-parallel (dp x cp) or
    expert-data-parallel group of more than one rank, or working weights below float32 (it holds their float32
    master). Otherwise the replicated optimizer, which holds what sharding over one rank would."""
    return (optimizer_shard and max(dp, edp) > 1) or params_dtype != "float32"


def accumulate_bytes(distributed: bool, micro_batches: int, pipeline: bool, param_bytes: float) -> float:
    """Bytes per parameter of the gradients held between micro-batches: none with one; the distributed optimizer's
    float32 bucket buffers; the replicated optimizer's (and the pipeline engine's) accumulators in the weights'
    dtype."""
    if micro_batches == 1:
        return 0.0
    return 4.0 if distributed and not pipeline else param_bytes
