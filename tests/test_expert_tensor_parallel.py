"""Expert tensor parallelism's slicing (parallel/tp/expert.py) and its checkpoint names
(telechat_moe/expert_tp_checkpoint.py), without processes: each rank's gate|up columns and down rows put together
give the one-process weights back, and the SwiGLU of a rank's columns is its columns of the SwiGLU. (The layer over
real ranks: tests/test_expert_parallel.py; training and a checkpoint resumed at another etp:
tests/test_tensor_parallel.py.)"""
import numpy as np
import pytest

from parallel.tp.expert import packed_columns, packed_whole
from telechat_moe.checkpoint import Shard
from telechat_moe.expert_tp_checkpoint import split_axis, split_marker


@pytest.mark.parametrize("etp", [1, 2, 4])
def test_each_ranks_columns_put_together_are_the_whole(etp):
    w1 = np.random.default_rng(0).normal(size=(3, 5, 2 * 8)).astype(np.float32)     # [E, h, gate|up of I=8]
    shards = [packed_columns(w1, etp, r) for r in range(etp)]
    assert all(s.shape == (3, 5, 2 * 8 // etp) for s in shards)
    assert np.array_equal(packed_whole(np.concatenate(shards, -1), etp), w1)
    x = np.random.default_rng(1).normal(size=(7, 5)).astype(np.float32)

    def swiglu(gate_up):
        gate, up = np.split(gate_up, 2, -1)
        return gate / (1 + np.exp(-gate)) * up
    whole = swiglu(x @ w1[0])
    parts = [swiglu(x @ s[0]) for s in shards]
    assert np.allclose(np.concatenate(parts, -1), whole, rtol=1e-6, atol=1e-7)


def test_checkpoint_entries_split_over_etp():
    assert split_axis("layers.1.mlp.experts.w1") == -1 and split_axis("adam_m.layers.1.mlp.experts.w2") == 1
    assert split_axis("master.mtp.0.block.mlp.experts.w1") == -1
    assert split_axis("layers.1.mlp.shared_experts.w1.weight") is None and split_axis("embed_tokens.weight") is None

    class Etp:
        etp, index = 2, 1
    assert split_marker("layers.1.mlp.experts.w1", (8, 256, 192), Etp()) == Shard(2, 192, 384)
    assert split_marker("adam_v.layers.1.mlp.experts.w2", (8, 96, 256), Etp()) == Shard(1, 96, 192)
    assert split_marker("layers.1.self_attn.o_proj.weight", (256, 128), Etp()) is None
