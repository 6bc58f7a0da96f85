"""Dynamic expert placement in training (telechat_moe/expert_placement.py, parallel/ep/migrate.py) across real
processes: tiny on 4 processes at dp=4 x ep=4 re-places its experts after steps 2 and 4 (threshold 0: any
predicted gain), and still computes the one-process run's losses and gradient norms at every step; the step-2
checkpoint, taken after the move, holds every expert's weights and Adam moments at its new label, equal to the
one-process run's for that expert; resumed at ep=1 and at ep=2 it continues the one-process losses."""
from __future__ import annotations

import json
import shutil

import numpy as np
from safetensors.numpy import load_file

from parallel.ep.migrate import moved_rows, relabelling
from tests.conftest import PARALLEL_COMMON
from tests.helpers import assert_losses_match, msrun, run_cli
from tests.test_training import SHORT, metrics, sets


def _step(run, rank: int, step: int):
    folder = run / "checkpoints" / f"rank_{rank}" / f"step_{step:08d}"
    return load_file(str(folder / "weights.safetensors")), json.loads((folder / "state.json").read_text())


def test_experts_move_between_ranks_and_the_model_computes_the_same(tmp_path, one_process_tiny):
    one, out = one_process_tiny, tmp_path / "ep4"
    common = [*SHORT, *PARALLEL_COMMON, f"data.tokenizer={one / 'tokenizer.model'}"]
    proc, logs = msrun(4, tmp_path / "logs", "run_train.py", "--recipe", "tiny",
                       *sets(*common, "parallel_config.data_parallel=4", "parallel_config.expert_parallel=4",
                             "expert_placement.interval=2", "expert_placement.threshold=0",
                             "expert_placement.window=1", f"output_dir={out}"),
                       cluster_time_out=120)
    assert proc.returncode == 0, logs
    assert "[experts] step 2:" in logs and "[experts] step 4:" in logs, logs
    assert_losses_match(one, out, range(1, 5), "dp=4 x ep=4, experts moved after steps 2 and 4")
    logged = metrics(out)
    assert logged[4]["experts_moved"] > logged[2]["experts_moved"] > 0 and logged[4]["expert_bytes_moved"] > 0
    assert all(logged[s]["expert_max_mean_load"] >= 1 for s in range(1, 5))
    # every step's routed expert kernels timed on each EP rank; the forecast checked against each window from the
    # second on (window 1: every step)
    assert all(logged[s]["expert_kernel_max_s"] >= logged[s]["expert_kernel_mean_s"] > 0 for s in range(1, 5))
    assert all(0 <= logged[s]["expert_kernel_slowest_rank"] < 4 for s in range(1, 5))
    assert "expert_forecast_error" not in logged[1] and all(logged[s]["expert_forecast_error"] > 0 for s in (2, 4))
    assert (out / "logs" / "expert_load" / "router_0.png").stat().st_size > 5000
    events = b"".join(p.read_bytes() for p in (out / "logs" / "tensorboard").glob("events.*"))
    assert all(f"expert_load/router_{r}".encode() in events for r in range(4)), "heatmaps as TensorBoard images"

    # the step-2 checkpoint: every rank's expert rows put together, back in original order by the saved labels,
    # equal the one-process run's (rounding apart: AdamW moves an element by at most about lr per step); the
    # labels moved experts to other ranks, and the tensors read as if unmoved would not match
    whole = [_step(out, r, 2) for r in range(4)]
    labels = whole[0][1]["expert_labels"]
    assert all(state["expert_labels"] == labels for _, state in whole)
    single, _ = _step(one, 0, 2)
    moved = 0
    for row, layer in enumerate((1, 2, 3)):         # tiny: layer 0 dense, 1-3 MoE; router 3 is MTP's
        order = np.asarray(labels[str(row)])
        moved += moved_rows(relabelling(np.arange(order.size), order.reshape(4, -1)), 4)
        for kind in ("", "adam_m.", "adam_v."):
            for tensor in (f"layers.{layer}.mlp.experts.w1", f"layers.{layer}.mlp.gate.weight"):
                name = kind + tensor
                held = np.concatenate([w[name] for w, _ in whole]) if "experts" in tensor else whole[0][0][name]
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

    for name, world, layout in (("ep1", 1, []),
                                ("ep2", 2, ["parallel_config.data_parallel=2", "parallel_config.expert_parallel=2",
                                            "expert_placement.interval=2", "expert_placement.threshold=0"])):
        resumed = tmp_path / name
        shutil.copytree(out, resumed)
        for rank in range(4):
            for step in (3, 4):
                shutil.rmtree(resumed / "checkpoints" / f"rank_{rank}" / f"step_{step:08d}")
        args = ["run_train.py", "--recipe", "tiny", "--resume",
                *sets(*common, "training.train_steps=3", *layout, f"output_dir={resumed}")]
        if world == 1:
            proc = run_cli(*args)
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:
            proc, logs = msrun(world, tmp_path / f"{name}_logs", *args, cluster_time_out=120)
            assert proc.returncode == 0, logs
        assert_losses_match(one, resumed, (3,), f"step 2's checkpoint (experts moved) resumed at {name}")
