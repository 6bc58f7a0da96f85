"""Tensor parallelism: Megatron-Core-style column/row-parallel linear layers, vocab-parallel embedding and
cross-entropy over `parallel.comm` (`layers.py`, whose docstring says which collective runs where)."""
from parallel.tp.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelCrossEntropy,
                                VocabParallelEmbedding, full_normal, shard_range, vocab_parallel_cross_entropy)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelCrossEntropy", "VocabParallelEmbedding",
           "full_normal", "shard_range", "vocab_parallel_cross_entropy"]
