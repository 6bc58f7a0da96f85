"""Replicas of hot experts while training (expert_placement.spare_slots; telechat_moe/moe/replicas.py), across real
processes. The one-process run's step-1 checkpoint gets a skewed router (experts 0 and 1 in every token's top-4,
bias updates off); from it one process trains steps 2-4, and 4 processes at dp=4 x ep=4 with one spare slot per
rank re-place after steps 2 and 4, replicating the hot experts: the losses and gradient norms equal the one-process
run's (the dispatchers split a replicated expert's tokens between its copies, the copies' gradients summed), and
the step-3 checkpoint, which holds no replica, resumes at the same layout with its replicas rebuilt and the same
step-4 loss. The pieces: `homes` and the slot tables on placements made here."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from bench.expert_migration_time import skew_checkpoint
from parallel.ep.migrate import homes
from telechat_moe.moe.replicas import outside_checkpoints, slot_tables
from tests.conftest import PARALLEL_COMMON
from tests.helpers import assert_losses_match, msrun, run_cli
from tests.test_training import SHORT, metrics, sets


def test_homes_give_every_rank_its_share_and_the_rest_spare():
    rng = np.random.default_rng(0)
    for _ in range(50):
        ranks, per, spare = 4, 4, 1
        # every expert once, then replicas of random experts in free slots of ranks not holding them
        slots = np.full((ranks, per + spare), -1)
        slots[:, :per] = rng.permutation(ranks * per).reshape(ranks, per)
        for r in range(ranks):
            e = rng.integers(ranks * per)
            if e not in slots[r]:
                slots[r, per] = e
        rng.shuffle(slots, axis=1)
        home, extra = homes(slots, per)
        assert sorted(home.reshape(-1)) == list(range(ranks * per))
        for r in range(ranks):
            assert sorted(np.concatenate((home[r], extra[r][extra[r] >= 0]))) == sorted(slots[r][slots[r] >= 0])
    # a rank holding fewer experts than its home share: no home for every expert
    assert homes(np.array([[0, -1, -1], [1, 2, 0], [3, 4, 5]]), 2) is None


def test_slot_tables_send_each_copy_to_its_slot():
    copies, targets, slot_label = slot_tables(8, 2, np.array([[5, -1], [0, 1]]))   # 4 homes + 2 spare per rank
    assert copies.tolist() == [2, 2, 1, 1, 1, 2, 1, 1]
    assert targets[0, :2].tolist() == [0, 6 + 4] and targets[5, :2].tolist() == [6 + 1, 4]
    assert slot_label.tolist() == [0, 1, 2, 3, 5, 8, 4, 5, 6, 7, 0, 1]
    assert outside_checkpoints("layers.1.mlp.experts.w1_spare") and outside_checkpoints("layers.1.mlp.slots.copies")
    assert not outside_checkpoints("layers.1.mlp.experts.w1")


def test_replicated_experts_train_as_one_process(tmp_path, one_process_tiny):
    base = tmp_path / "base"
    shutil.copytree(one_process_tiny, base, ignore=shutil.ignore_patterns("dump"))
    for step in (2, 3, 4):
        shutil.rmtree(base / "checkpoints" / "rank_0" / f"step_{step:08d}")
    assert skew_checkpoint(base, 1, 1, hot=2, skew=1.0)
    common = [*SHORT, *PARALLEL_COMMON, f"data.tokenizer={one_process_tiny / 'tokenizer.model'}",
              "model.moe_router_bias_update_rate=0"]
    one = tmp_path / "one"
    shutil.copytree(base, one)
    proc = run_cli("run_train.py", "--recipe", "tiny", "--resume", *sets(*common, f"output_dir={one}"))
    assert proc.returncode == 0, proc.stderr[-3000:]

    layout = ["parallel_config.data_parallel=4", "parallel_config.expert_parallel=4", "expert_placement.interval=2",
              "expert_placement.threshold=0", "expert_placement.spare_slots=1"]
    out = tmp_path / "ep4"
    shutil.copytree(base, out)
    proc, logs = msrun(4, tmp_path / "logs", "run_train.py", "--recipe", "tiny", "--resume",
                       *sets(*common, *layout, f"output_dir={out}"), cluster_time_out=120)
    assert proc.returncode == 0, logs
    logged = metrics(out)
    # at ep=4 a hot expert holds as many copies as a rank's mean share: two copies halve it
    assert logged[2]["expert_replicas_made"] > 0 and logged[2]["expert_max_mean_load"] > 1.5, logged
    assert logged[3]["expert_max_mean_load"] < logged[2]["expert_max_mean_load"] - 0.5, logged
    per_router = {step: [logged[step][f"expert_max_mean_load_router_{r}"] for r in range(4)] for step in (2, 3)}
    assert np.mean(per_router[3]) == pytest.approx(logged[3]["expert_max_mean_load"])   # 3 MoE layers and MTP's
    assert all(after < before - 0.5 for before, after in zip(per_router[2], per_router[3])), per_router
    assert_losses_match(one, out, (2, 3, 4), "dp=4 x ep=4 with replicas of the hot experts")

    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    for rank in range(4):
        shutil.rmtree(resumed / "checkpoints" / f"rank_{rank}" / "step_00000004")
    proc, logs = msrun(4, tmp_path / "resumed_logs", "run_train.py", "--recipe", "tiny", "--resume",
                       *sets(*common, *layout, f"output_dir={resumed}"), cluster_time_out=120)
    assert proc.returncode == 0, logs
    assert_losses_match(one, resumed, (4,), "step 3's checkpoint resumed with its replicas rebuilt")
