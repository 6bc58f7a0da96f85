"""Tensor parallelism across real processes (msrun, CPU transport, graph mode): each layer of parallel/tp over tp=2
and tp=4 ranks equals the plain one-process layer built from the same full weights, output and every gradient
(input, and each weight shard against its slice of the plain gradient): column- and row-parallel linear with and
without sequence parallelism (and the column layer's gathered output), the column->row SwiGLU MLP, the
vocab-parallel embedding, the vocab-parallel cross-entropy, and embedding->MLP->head->cross-entropy; and the seeded
initialisation keeps each rank's slice of the one full matrix."""
from __future__ import annotations


import numpy as np
import pytest

from parallel.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shard_range
from tests.helpers import run_workers

CASES = {"seeded init", "column", "column gather_output", "column sequence_parallel", "row", "row sequence_parallel",
         "mlp column->row", "mlp column->row sequence_parallel", "embedding", "embedding sequence_parallel",
         "vocab-parallel cross-entropy", "embedding->mlp->head->cross-entropy",
         "embedding->mlp->head->cross-entropy sequence_parallel"}


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_layers_equal_one_process(tmp_path, world):
    ranks = run_workers(tmp_path, "tp_layers.py", world)
    for rank, results in enumerate(ranks):
        assert {c["case"] for c in results} == CASES, rank
        for case in results:
            assert case["errors"], (rank, case["case"])
            for name, err in case["errors"].items():
                print(f"tp {world} rank {rank} {case['case']}: {name} {err:.2e} (tolerance {case['tolerance']:.1e})")
                assert err <= case["tolerance"], (rank, case["case"], name, err)
        chain = next(c for c in results if c["case"] == "embedding->mlp->head->cross-entropy sequence_parallel")
        assert {"output", "grad embedding.weight", "grad mlp.gate.weight", "grad mlp.up.weight",
                "grad mlp.down.weight", "grad head.weight"} == set(chain["errors"]), chain["errors"]


def test_shards_of_a_full_weight():
    """The slicing helpers (no process group needed): rows for the column layer and the embedding, columns for the
    row layer; dimensions not divisible by tp are refused with the dimension named."""
    full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)       # [out, in]
    assert np.array_equal(ColumnParallelLinear.shard_of(full, 2, 1), full[4:])
    assert np.array_equal(RowParallelLinear.shard_of(full, 3, 2), full[:, 4:])
    assert np.array_equal(VocabParallelEmbedding.shard_of(full, 4, 1), full[2:4])
    assert np.array_equal(np.concatenate([RowParallelLinear.shard_of(full, 2, r) for r in range(2)], 1), full)
    assert shard_range(64, 4, 3) == (48, 64)
    with pytest.raises(ValueError, match="in_features 6 is not divisible by tensor_parallel 4"):
        RowParallelLinear.shard_of(full, 4, 0)
    with pytest.raises(ValueError, match="vocab_size 8 is not divisible by tensor_parallel 3"):
        VocabParallelEmbedding.shard_of(full, 3, 0)
