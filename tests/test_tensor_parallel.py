"""Tensor parallelism across real processes (msrun, CPU transport, graph mode): each layer of parallel/tp over tp=2
and tp=4 ranks equals the plain one-process layer built from the same full weights, output and every gradient
(input, and each weight shard against its slice of the plain gradient): column- and row-parallel linear with and
without sequence parallelism (and the column layer's gathered output), the column->row SwiGLU MLP, the
vocab-parallel embedding, the vocab-parallel cross-entropy, and embedding->MLP->head->cross-entropy; and the seeded
initialisation keeps each rank's slice of the one full matrix. And the model trains over them: tiny at tp=2 x dp=2
with expert parallelism folded over the tensor ranks, then its checkpoint resumed at tp=1 x ep=1 and at tp=4 with
sequence parallelism, ep=2 and expert tensor parallelism etp=2, each equal to the one-process run."""
from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from parallel.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shard_range
from tests.conftest import PARALLEL_COMMON
from tests.helpers import assert_losses_match, assert_no_divergence, msrun, run_cli, run_workers
from tests.test_data_parallel import assert_memory_lines
from telechat_moe.recipe import load_recipe
from tests.test_training import NO_EVAL, SHORT, metrics, sets

CASES = {"seeded init", "column", "column gather_output", "column sequence_parallel", "row", "row sequence_parallel",
         "mlp column->row", "mlp column->row sequence_parallel", "embedding", "embedding sequence_parallel",
         "vocab-parallel cross-entropy", "embedding->mlp->head->cross-entropy",
         "embedding->mlp->head->cross-entropy sequence_parallel"}


@pytest.mark.parametrize("world", [4])   # (tp=2 trains in the training test below)
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


def test_tensor_and_expert_parallel_training_matches_one_process_and_reshards(tmp_path, one_process_tiny):
    """Four processes at tp=2 x dp=2 x ep=4, the EP group all four ranks as 2 nodes x 2 devices with the
    hierarchical dispatcher, train the one-process run's steps 1-2: the same losses and gradient norms, and
    precision.compare finds no divergence in their tensor dumps (activations of the global batch, every weight's
    gradient and Adam moments put back together); each rank's checkpoint holds its slices at their offsets and as
    many parameters as --dry-run states; the hierarchical scheme's logged inter-node traffic is below the flat one's.
    The checkpoint then resumes at tp=1 x ep=1 (one process) and at tp=4 with sequence parallelism x ep=2 x etp=2
    (4 processes, each expert's FFN split over 2 ranks), both continuing the one-process losses at step 3. (The 30-step runs in the README add tp=2 x ep=2
    resumed at tp=1 and tp=4.)"""
    one, tp2, tp1, tp4 = one_process_tiny, tmp_path / "tp2", tmp_path / "tp1", tmp_path / "tp4"
    common = [*SHORT, *PARALLEL_COMMON, f"data.tokenizer={one / 'tokenizer.model'}", NO_EVAL]

    def msrun_train(name, *assignments, resume=False):
        proc, logs = msrun(4, tmp_path / f"{name}_logs", "run_train.py", "--recipe", "tiny",
                           *(["--resume"] if resume else []), *sets(*common, *assignments), cluster_time_out=90)
        assert proc.returncode == 0, logs
        return logs

    layout = ["parallel_config.model_parallel=2", "parallel_config.data_parallel=2", "parallel_config.expert_parallel=4",
              "parallel_config.devices_per_node=2", "model.moe_token_dispatcher_type=hierarchical"]
    assert_memory_lines(msrun_train("tp2", "training.train_steps=2", "training.dump_steps=1-2", *layout,
                                    f"output_dir={tp2}"), 4)
    assert_losses_match(one, tp2, (1, 2), "tp=2 x dp=2 x ep=4 hierarchical")
    assert_no_divergence(one, tp2)
    dry = run_cli("run_train.py", "--recipe", "tiny", "--dry-run", *sets(*common, *layout))
    stated = re.search(r"parameters per device \(stage 0\): ([\d,]+), of them ([\d,]+) in routed experts", dry.stdout)
    total, experts = (int(x.replace(",", "")) for x in stated.groups())
    full = load_file(str(one / "checkpoints" / "rank_0" / "step_00000002" / "weights.safetensors"))
    for rank in range(4):
        held = load_file(str(tp2 / "checkpoints" / f"rank_{rank}" / "step_00000002" / "weights.safetensors"))
        assert {n for n in held if not n.startswith("adam_")} == {n for n in full if not n.startswith("adam_")}
        trained = {n: v.size for n, v in held.items() if not n.startswith(("adam_", "global_step", "learning_rate"))
                   and not n.endswith("expert_bias")}
        assert sum(v for n, v in trained.items() if ".experts." in n) == experts, rank
        assert sum(trained.values()) == total, rank
        # the distributed optimizer: the rank's Adam state is its data-parallel half of its slices' (the experts'
        # edp is 1: whole; the weights tp splits along another dim than 0 are saved gathered over dp)
        adam = sum(v.size for n, v in held.items() if n.startswith("adam_"))
        print(f"rank {rank}: {adam:,} Adam elements for {total:,} weights ({adam / (2 * total):.2f} of a replica's)")
        assert adam < 2 * (total - experts) * 0.75 + 2 * experts, rank
        # its slices, at its offsets: tp index rank % 2; the EP group folds over the tp x dp ranks, EP index = rank
        # (two Adam steps apart from the one-process run's by rounding only)
        for name, axis, parts, part in (("layers.1.self_attn.q_b_proj.weight", 0, 2, rank % 2),
                                        ("layers.1.self_attn.o_proj.weight", 1, 2, rank % 2),
                                        ("embed_tokens.weight", 0, 2, rank % 2),
                                        ("layers.1.mlp.experts.w1", 0, 4, rank)):
            n = held[name].shape[axis]
            assert n * parts == full[name].shape[axis], name
            mine = np.take(full[name], np.arange(part * n, (part + 1) * n), axis=axis)
            # AdamW moves a weight by at most about lr per step (both steps: 2e-4 in all), so a rounding-level
            # gradient difference can move an element by twice that; a slice at a wrong offset differs by the
            # weights' own size (std 0.02) nearly everywhere
            diff = np.abs(held[name] - mine)
            assert diff.max() < 4e-4 and np.mean(diff < 1e-6) > 0.999, (rank, name, diff.max())
    traffic = metrics(tp2)[2]
    assert traffic["ep_inter_node_bytes_hierarchical"] < traffic["ep_inter_node_bytes_flat"], traffic
    assert traffic["ep_intra_node_bytes_flat"] > 0

    shutil.copytree(tp2, tp1)
    proc = run_cli("run_train.py", "--recipe", "tiny", "--resume", *sets(*common, "training.train_steps=3",
                                                                          f"output_dir={tp1}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_losses_match(one, tp1, (3,), "resumed at tp=1 x ep=1")

    shutil.copytree(tp2, tp4)
    tp4_layout = ["parallel_config.model_parallel=4", "parallel_config.use_seq_parallel=true",
                  "parallel_config.expert_parallel=2", "parallel_config.expert_model_parallel=2"]
    msrun_train("tp4", "training.train_steps=3", *tp4_layout, "profile.collectives=true", f"output_dir={tp4}",
                resume=True)
    assert_losses_match(one, tp4, (3,), "resumed at tp=4 with sequence parallelism x ep=2 x etp=2")
    plan_against_run(load_recipe("tiny", [*common, *tp4_layout]), tp4, tmp_path / "tp4_logs", step=3)


def plan_against_run(recipe, out, log_dir, step: int) -> None:
    """bench/plan_vs_run.py's rows of a run: each rank's parameters and held bytes are the planner's (plus what the
    planner leaves out: the routers' expert_bias, E float32 per MoE layer, and the optimizer's learning rate and
    step), and its collective bytes of `step` by kind, counted as the comm layer issued them, are the planner's
    (the mean over the ranks: a rank's exchanges receive what routing sends it), plus the gradient norm's 4-byte
    sums, which the planner leaves out."""
    from bench.plan_vs_run import KINDS, SCALARS, measured_figures, planner_figures
    logs = "".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("worker_*.log")))
    world = recipe.layout.world_size
    measured, planned = measured_figures(out, logs, world, step), planner_figures(recipe, 0)
    m = recipe.model
    biases = 4 * m.n_routed_experts * (m.num_hidden_layers - m.first_k_dense_replace + m.num_nextn_predict_layers)
    for rank, row in enumerate(measured):
        print(f"rank {rank}: measured {row}")
        assert row["params"] == planned["params"], (rank, row["params"], planned["params"])
        assert row["held"] == planned["held"] + biases + 8, (rank, row["held"], planned["held"])
    print(f"planned {planned}")
    for kind in KINDS:
        mean = sum(row[kind] for row in measured) / world
        norm_sums = SCALARS if kind == "all_reduce" else 0
        assert planned[kind] <= mean <= planned[kind] + norm_sums, (kind, mean, planned[kind])
