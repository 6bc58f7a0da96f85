"""Expert parallelism across real processes (msrun, CPU transport): one MoE layer split over EP ranks equals the
one-process layer, output and every gradient, for the flat and the hierarchical all-to-all, top-2 and top-4, on
skewed routing (an expert every token picks, a whole rank's experts that get no token), sliced or not."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from tests.helpers import ROOT, run_cli
from tests.test_training import free_port


def run_workers(tmp_path, world: int) -> list[list[dict]]:
    msrun = shutil.which("msrun", path=os.path.dirname(sys.executable))
    env = {"PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    out = tmp_path / "results"
    proc = run_cli(msrun, f"--worker_num={world}", f"--local_worker_num={world}", f"--master_port={free_port()}",
                   "--join=True", f"--log_dir={tmp_path / 'logs'}", "--cluster_time_out=60",
                   str(ROOT / "tests" / "workers" / "ep_layer.py"), str(out), env=env)
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in (tmp_path / "logs").glob("worker_*.log"))
    assert proc.returncode == 0, logs
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_over_expert_parallel_ranks_equals_one_process(tmp_path, world):
    ranks = run_workers(tmp_path, world)
    cases = {c["case"] for c in ranks[0]}
    assert any("hierarchical" in c for c in cases) and any("chunks=2" in c for c in cases)
    if world == 4:      # 2 nodes x 2 devices; and two EP groups of 2 inside a DP of 4
        assert {"hierarchical top-4 chunks=1 skewed ep=4", "alltoall top-4 chunks=1 skewed ep=2"} <= cases
    for rank, results in enumerate(ranks):
        for case in results:
            loads = case["tokens_per_expert"]
            if "skewed" in case["case"]:    # the routing the case claims: one expert in every token's top-k,
                assert loads[0] == max(loads) and loads[-4:] == [0, 0, 0, 0]   # a rank's experts without tokens
            assert case["same_init"], (rank, case["case"])
            for name, err in case["errors"].items():
                print(f"world {world} rank {rank} {case['case']}: {name} {err:.2e} (tolerance {case['tolerance']:.1e})")
                assert err <= case["tolerance"], (rank, case["case"], name, err)
