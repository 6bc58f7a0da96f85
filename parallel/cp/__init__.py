"""Context parallelism: the sequence split over ranks, load-balanced for causal attention, with attention over the
whole sequence through gathered keys and values (`context.py`, whose docstring says what moves where)."""
from parallel.cp.context import (ContextParallel, GatherContext, ShardSequence, SumOverContext, gathered_order,
                                 shard_positions)

__all__ = ["ContextParallel", "GatherContext", "ShardSequence", "SumOverContext", "gathered_order",
           "shard_positions"]
