"""Which optimizer a run steps with and what it holds between micro-batches: the facts the trainer and the memory
formula (parallel/planner/model_shape.py: rank_static_bytes) must agree on, kept free of MindSpore so the dry run
and the planner read them without it."""
from __future__ import annotations

import numpy as np


def uses_distributed(optimizer_shard: bool, dp: int, edp: int, params_dtype: str) -> bool:
    """Whether the distributed optimizer steps the run: sharding asked for over a data-parallel (dp x cp) or
    expert-data-parallel group of more than one rank, or working weights below float32 (it holds their float32
    master). Otherwise the replicated optimizer, which holds what sharding over one rank would. Degrees may be
    NumPy arrays (the planner's layouts): then an array of answers."""
    answer = (np.asarray(optimizer_shard) & (np.maximum(dp, edp) > 1)) | (params_dtype != "float32")
    return bool(answer) if answer.ndim == 0 else answer


def accumulate_bytes(distributed: bool, micro_batches: int, pipeline: bool, param_bytes: float) -> float:
    """Bytes per parameter of the gradients held between micro-batches: none with one; the distributed optimizer's
    float32 bucket buffers; the replicated optimizer's (and the pipeline engine's) accumulators in the weights'
    dtype. Arguments may be NumPy arrays (the planner's layouts): then an array of bytes."""
    answer = np.where(np.asarray(micro_batches) == 1, 0.0,
                      np.where(np.asarray(distributed) & ~np.asarray(pipeline), 4.0, param_bytes))
    return float(answer) if answer.ndim == 0 else answer
