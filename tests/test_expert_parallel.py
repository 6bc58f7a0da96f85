"""Expert parallelism across real processes (msrun, CPU transport): one MoE layer split over EP ranks equals the
one-process layer, output and every gradient, for the flat and the hierarchical all-to-all, top-2 and top-4, on
skewed routing (an expert every token picks, a whole rank's experts that get no token), sliced or not."""
from __future__ import annotations

import re
import shutil

import pytest
from safetensors.numpy import load_file

from tests.conftest import PARALLEL_COMMON
from tests.helpers import assert_losses_match, assert_no_divergence, msrun, run_cli, run_workers
from tests.test_training import SHORT, metrics, sets


@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_over_expert_parallel_ranks_equals_one_process(tmp_path, world):
    ranks = run_workers(tmp_path, "ep_layer.py", world)
    cases = {c["case"] for c in ranks[0]}
    assert any("hierarchical" in c for c in cases) and any("chunks=2" in c for c in cases)
    if world == 4:      # 2 nodes x 2 devices; two EP groups of 2 inside a DP of 4; every collective Cell
        assert {"hierarchical top-4 chunks=1 skewed ep=4", "alltoall top-4 chunks=1 skewed ep=2",
                "collectives"} <= cases
        collectives = [next(c for c in results if c["case"] == "collectives") for results in ranks]
        assert all(len(c["errors"]) == 42 + (rank in (1, 2)) for rank, c in enumerate(collectives))
    for rank, results in enumerate(ranks):
        for case in results:
            loads = case["tokens_per_expert"]
            if "skewed" in case["case"]:    # the routing the case claims: one expert in every token's top-k,
                assert loads[0] == max(loads) and loads[-4:] == [0, 0, 0, 0]   # a rank's experts without tokens
            assert case["same_init"], (rank, case["case"])
            for name, err in case["errors"].items():
                print(f"world {world} rank {rank} {case['case']}: {name} {err:.2e} (tolerance {case['tolerance']:.1e})")
                assert err <= case["tolerance"], (rank, case["case"], name, err)


# ---- training ----------------------------------------------------------------------------------------------------
def msrun_train(tmp_path, name: str, world: int, *assignments: str, resume: bool = False):
    proc, logs = msrun(world, tmp_path / f"{name}_logs", "run_train.py", "--recipe", "tiny",
                       *(["--resume"] if resume else []),
                       *sets(*assignments, f"parallel_config.data_parallel={world}"), cluster_time_out=90)
    assert proc.returncode == 0, logs


def test_expert_parallel_training_matches_one_process_and_reshards(tmp_path, one_process_tiny):
    """tiny at ep=4 over 4 processes (hierarchical, 2 nodes x 2 devices) against one process: the same losses and
    gradient norms, tensor dumps that precision.compare aligns, 1/4 of the routed experts on each rank (as --dry-run
    states), inter-node traffic logged lower for the hierarchical scheme; then its checkpoint resumes at ep=1 (one
    process), continuing the one-process run's losses. (Resuming at a larger expert_parallel, and with tensor
    parallelism, is tests/test_tensor_parallel.py's training test.)"""
    one, ep4, ep1 = one_process_tiny, tmp_path / "ep4", tmp_path / "ep1"
    common = SHORT + PARALLEL_COMMON
    tokenizer = f"data.tokenizer={one / 'tokenizer.model'}"
    msrun_train(tmp_path, "ep4", 4, *common, "training.train_steps=2", "parallel_config.expert_parallel=4",
                "parallel_config.devices_per_node=2", "model.moe_token_dispatcher_type=hierarchical", tokenizer,
                "training.dump_steps=1", f"output_dir={ep4}")
    shutil.copytree(ep4, ep1)
    proc = run_cli("run_train.py", "--recipe", "tiny", "--resume", *sets(*common, "training.train_steps=3",
                                                                          tokenizer, f"output_dir={ep1}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_losses_match(one, ep4, (1, 2), "ep=4 hierarchical")
    assert_losses_match(one, ep1, (3,), "resumed at ep=1")
    assert_no_divergence(one, ep4)

    dry = run_cli("run_train.py", "--recipe", "tiny", "--dry-run",
                  *sets(*common, "parallel_config.data_parallel=4", "parallel_config.expert_parallel=4"))
    stated = re.search(r"parameters per device \(stage 0\): ([\d,]+), of them ([\d,]+) in routed experts", dry.stdout)
    total, experts = (int(x.replace(",", "")) for x in stated.groups())
    for rank in range(4):
        held = load_file(str(ep4 / "checkpoints" / f"rank_{rank}" / "step_00000002" / "weights.safetensors"))
        mine = {n: v.size for n, v in held.items() if not n.startswith(("adam_", "global_step", "learning_rate"))
                and not n.endswith("expert_bias")}
        assert sum(v for n, v in mine.items() if ".experts." in n) == experts, rank
        assert sum(mine.values()) == total, rank

    traffic = metrics(ep4)[2]
    assert traffic["ep_inter_node_bytes_hierarchical"] < traffic["ep_inter_node_bytes_flat"], traffic
    assert traffic["ep_intra_node_bytes_flat"] > 0
