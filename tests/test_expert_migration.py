"""Dynamic expert placement in training (telechat_moe/expert_placement.py, parallel/ep/migrate.py,
telechat_moe/moe/replicas.py) across real processes. The one-process run's step-1 checkpoint gets a skewed router
(experts 0 and 1 in every token's top-4, bias updates off); from it one process trains steps 2-4, and 4 processes at
dp=4 x ep=4 with one spare slot per rank re-place after steps 2 and 4 (threshold 0: any predicted gain), moving
experts between ranks and replicating the hot ones (the dispatchers split a replicated expert's tokens between its
copies, the copies' gradients summed): the losses and gradient norms equal the one-process run's. The step-2
checkpoint, taken after the move, holds every expert's weights and Adam moments at its new label, equal to the
one-process run's for that expert; resumed at ep=1 (where the replicas are not rebuilt) and at ep=4 (where they
are) it continues the one-process losses (resuming at another EP size above 1 is the tensor-parallel training
test's). The pieces: `homes` and the slot tables."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from bench.expert_migration_time import skew_checkpoint
from parallel.ep.migrate import homes, moved_rows, relabelling
from telechat_moe.moe.replicas import outside_checkpoints, slot_tables
from tests.conftest import PARALLEL_COMMON
from tests.test_data_parallel import assert_memory_lines, whole_state
from tests.helpers import assert_losses_match, msrun, run_cli
from tests.test_training import NO_EVAL, SHORT, metrics, sets


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


def _step(run, rank: int, step: int):
    folder = run / "checkpoints" / f"rank_{rank}" / f"step_{step:08d}"
    return load_file(str(folder / "weights.safetensors")), json.loads((folder / "state.json").read_text())


def _from_step(run, dest, step: int, ranks: int):
    """A copy of `run` whose latest checkpoint is `step`'s."""
    shutil.copytree(run, dest)
    for rank in range(ranks):
        for later in (dest / "checkpoints" / f"rank_{rank}").glob("step_*"):
            if int(later.name.split("_")[1]) > step:
                shutil.rmtree(later)


def test_experts_move_and_replicate_and_the_model_computes_the_same(tmp_path, one_process_tiny):
    base = tmp_path / "base"
    _from_step(one_process_tiny, base, 1, 1)
    shutil.rmtree(base / "dump")
    assert skew_checkpoint(base, 1, 1, hot=2, skew=1.0)
    common = [*SHORT, *PARALLEL_COMMON, f"data.tokenizer={one_process_tiny / 'tokenizer.model'}",
              "model.moe_router_bias_update_rate=0", NO_EVAL]
    one = tmp_path / "one"
    shutil.copytree(base, one)
    proc = run_cli("run_train.py", "--recipe", "tiny", "--resume", *sets(*common, f"output_dir={one}"))
    assert proc.returncode == 0, proc.stderr[-3000:]

    placement = ["expert_placement.interval=2", "expert_placement.threshold=0", "expert_placement.spare_slots=1"]
    ep4 = ["parallel_config.data_parallel=4", "parallel_config.expert_parallel=4", *placement]
    out = tmp_path / "ep4"
    shutil.copytree(base, out)
    proc, logs = msrun(4, tmp_path / "logs", "run_train.py", "--recipe", "tiny", "--resume",
                       *sets(*common, *ep4, "expert_placement.window=1", f"output_dir={out}"), cluster_time_out=120)
    assert proc.returncode == 0, logs
    assert_memory_lines(logs, 4)      # the spare slots' weights and optimizer state counted
    assert "[experts] step 2:" in logs and "[experts] step 4:" in logs, logs
    assert_losses_match(one, out, (2, 3, 4), "dp=4 x ep=4, experts moved and replicated after steps 2 and 4")
    logged = metrics(out)
    assert logged[4]["experts_moved"] > logged[2]["experts_moved"] > 0 and logged[2]["expert_bytes_moved"] > 0
    # at ep=4 a hot expert holds as many copies as a rank's mean share: replicas halve it
    assert logged[2]["expert_replicas_made"] > 0 and logged[2]["expert_max_mean_load"] > 1.5, logged
    per_router = {s: [logged[s][f"expert_max_mean_load_router_{r}"] for r in range(4)] for s in (2, 3)}
    assert np.mean(per_router[3]) == pytest.approx(logged[3]["expert_max_mean_load"])   # 3 MoE layers and MTP's
    assert all(after < before - 0.5 for before, after in zip(per_router[2], per_router[3])), per_router
    # every step's routed expert kernels timed on each EP rank; the forecast checked against each window from the
    # second on (window 1: every step)
    assert all(logged[s]["expert_kernel_max_s"] >= logged[s]["expert_kernel_mean_s"] > 0 for s in (2, 3, 4))
    assert all(0 <= logged[s]["expert_kernel_slowest_rank"] < 4 for s in (2, 3, 4))
    assert "expert_forecast_error" not in logged[2] and all(logged[s]["expert_forecast_error"] > 0 for s in (3, 4))
    assert (out / "logs" / "expert_load" / "router_0.png").stat().st_size > 5000
    events = b"".join(p.read_bytes() for p in (out / "logs" / "tensorboard").glob("events.*"))
    assert all(f"expert_load/router_{r}".encode() in events for r in range(4)), "heatmaps as TensorBoard images"

    # the step-2 checkpoint: every rank's expert rows put together, back in original order by the saved labels,
    # equal the one-process run's (rounding apart: AdamW moves an element by at most about lr per step); the
    # labels moved experts to other ranks, and the tensors read as if unmoved would not match; the replicas are
    # not in it
    whole = [_step(out, r, 2) for r in range(4)]
    labels = whole[0][1]["expert_labels"]
    assert all(state["expert_labels"] == labels for _, state in whole)
    assert not any(outside_checkpoints(n) for w, _ in whole for n in w)
    single, _ = _step(one, 0, 2)
    # the ranks' slices (experts over EP, the distributed optimizer's state over dp) put together by the loader
    assembled = whole_state(out / "checkpoints" / "rank_0" / "step_00000002", single)
    moved = 0
    for row, layer in enumerate((1, 2, 3)):         # tiny: layer 0 dense, 1-3 MoE; router 3 is MTP's
        order = np.asarray(labels[str(row)])
        moved += moved_rows(relabelling(np.arange(order.size), order.reshape(4, -1)), 4)
        for kind in ("", "adam_m.", "adam_v."):
            for tensor in (f"layers.{layer}.mlp.experts.w1", f"layers.{layer}.mlp.gate.weight"):
                name = kind + tensor
                held = assembled[name]
                original = np.empty_like(held)
                original[order] = held
                scale = np.abs(single[name]).max()
                err = np.abs(original - single[name]).max() / scale
                unmoved = np.abs(held - single[name]).max() / scale
                print(f"{name}: relative error {err:.1e} in original order, {unmoved:.1e} as labelled")
                assert err < 1e-3, (name, err)
                if kind == "" and not np.array_equal(order, np.arange(order.size)):
                    assert unmoved > 1e-2, (name, unmoved)
    assert moved > 0

    for name, world, layout in (("ep1", 1, []), ("ep4", 4, ep4)):
        resumed = tmp_path / f"resumed_{name}"
        _from_step(out, resumed, 2, 4)
        args = ["run_train.py", "--recipe", "tiny", "--resume",
                *sets(*common, "training.train_steps=3", *layout, f"output_dir={resumed}")]
        if world == 1:
            proc = run_cli(*args)
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:
            proc, logs = msrun(world, tmp_path / f"{name}_logs", *args, cluster_time_out=120)
            assert proc.returncode == 0, logs
        where = "with its replicas rebuilt" if name == "ep4" else "without replicas"
        assert_losses_match(one, resumed, (3,), f"step 2's checkpoint (experts moved) resumed at {name}, {where}")
