"""The distributed optimizer (ZeRO-1, after Megatron-Core's DistributedOptimizer): gradients reduce-scattered per
bucket over each parameter's data-parallel group, float32 master weights and Adam moments held and updated as one
slice per rank, the working weights all-gathered back (`buckets.py` the plan, `distributed.py` the graph-mode
Cells, `state.py` the state by parameter for checkpoints, dumps and expert migration)."""
from parallel.optim.buckets import Bucket, BucketPlan, Piece, Route
from parallel.optim.distributed import ShardedAdamW, ShardedGradients

__all__ = ["Bucket", "BucketPlan", "Piece", "Route", "ShardedAdamW", "ShardedGradients"]
