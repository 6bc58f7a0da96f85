"""Expert parallelism across real processes (msrun, CPU transport): one MoE layer split over EP ranks (and each
expert's FFN over expert-tensor-parallel ranks inside an EP group) equals the one-process layer,
output and every gradient, for the flat and the hierarchical all-to-all, top-2 and top-4, on
skewed routing (an expert every token picks, a whole rank's experts that get no token), sliced or not; and with a
capacity factor (probs and position drop policies) against the one-process layer dropping each rank's tokens alike."""
from __future__ import annotations

import pytest

from tests.helpers import run_workers


@pytest.mark.parametrize("world", [4])   # (2 processes as EP groups of 2 inside dp=4)
def test_moe_layer_over_expert_parallel_ranks_equals_one_process(tmp_path, world):
    ranks = run_workers(tmp_path, "ep_layer.py", world)
    cases = {c["case"] for c in ranks[0]}
    assert any("hierarchical" in c for c in cases) and any("chunks=2" in c for c in cases)
    if world == 4:      # 2 nodes x 2 devices; two EP groups of 2 inside a DP of 4; every collective Cell
        assert {"hierarchical top-2 chunks=1 skewed ep=4", "alltoall top-4 chunks=1 skewed ep=2",
                "alltoall top-4 chunks=1 skewed ep=4 capacity=1.0 probs",
                "hierarchical top-4 chunks=2 skewed ep=4 capacity=1.0 position", "collectives",
                "alltoall top-4 chunks=1 skewed ep=2 etp=2"} <= cases
        collectives = [next(c for c in results if c["case"] == "collectives") for results in ranks]
        assert all(len(c["errors"]) == 48 + (rank in (1, 2)) for rank, c in enumerate(collectives))
    for rank, results in enumerate(ranks):
        for case in results:
            loads = case["tokens_per_expert"]
            if "skewed" in case["case"]:    # the routing the case claims: one expert in every token's top-k,
                assert loads[0] == max(loads) and loads[-4:] == [0, 0, 0, 0]   # a rank's experts without tokens
            if "capacity" in case["case"]:  # every token of every rank picks expert 0: 16 a rank, capacity 4
                assert loads[0] == world * 16
            assert case["same_init"], (rank, case["case"])
            for name, err in case["errors"].items():
                print(f"world {world} rank {rank} {case['case']}: {name} {err:.2e} (tolerance {case['tolerance']:.1e})")
                assert err <= case["tolerance"], (rank, case["case"], name, err)

# Training under expert parallelism (ep=4 hierarchical over 2 nodes x 2 devices, with tensor parallelism, resumed at
# other expert_parallel sizes) is tests/test_tensor_parallel.py's training test.
