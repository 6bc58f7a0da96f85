"""Pipeline parallelism in the trainer (telechat_moe/pipeline_step.py) across real processes: tiny on 4 processes as
pipeline_stage=2 x pp_interleave_num=3 (interleaved 1F1B, the placement MILP's chunks: 6 for 4 layers, so the first
holds the embedding alone and the last the head and MTP alone, as Llama 3 cut its pipeline) x data_parallel=2 with
expert_parallel=2 inside each stage, 2 micro-batches, against the one-process run: every logged loss and gradient
norm per step, the held-out loss (a forward-only pass through the pipeline), and precision.compare on the tensor
dumps of steps 1-2 (every stage's layer outputs, gradients and Adam moments put together); the timeline each rank
recorded draws as a measured step beside its simulation (scripts/pipeline_timeline); step 3's checkpoint resumes
in one process and continues the one-process losses."""
from __future__ import annotations

import json
import shutil

from tests.conftest import PARALLEL_COMMON
from tests.helpers import assert_losses_match, assert_no_divergence, msrun, run_cli
from tests.test_data_parallel import assert_memory_lines
from tests.test_training import NO_EVAL, SHORT, sets


def test_interleaved_pipeline_with_data_and_expert_parallelism_matches_one_process(tmp_path, one_process_tiny):
    one, out = one_process_tiny, tmp_path / "pp2_vpp3_dp2_ep2"
    proc, logs = msrun(4, tmp_path / "logs", "run_train.py", "--recipe", "tiny",
                       *sets(*SHORT, *PARALLEL_COMMON, "parallel_config.pipeline_stage=2",
                             "parallel_config.pp_interleave_num=3", "parallel_config.data_parallel=2",
                             "parallel_config.expert_parallel=2", "parallel_config.micro_batch_num=2",
                             "training.dump_steps=1-2", f"data.tokenizer={one / 'tokenizer.model'}",
                             f"output_dir={out}"), cluster_time_out=120)
    assert proc.returncode == 0, logs
    assert "[pipeline] layers per chunk [0, 1, 1, 1, 1, 0]" in logs
    assert_memory_lines(logs, 4)      # each stage's layers as the placement puts them, the embedding's copy
    assert_losses_match(one, out, range(1, 5), "pp=2 x vpp=3 x dp=2 x ep=2")
    assert_no_divergence(one, out)
    drawn = run_cli("-m", "scripts.pipeline_timeline", str(out), "--pipeline", "1", "--png-dir", str(tmp_path))
    assert drawn.returncode == 0, drawn.stderr
    assert "idle share: measured" in drawn.stdout and (tmp_path / "measured.png").stat().st_size > 10_000
    print(drawn.stdout)
    held = [json.loads((run / "logs" / "summary.json").read_text())["eval_lm_loss"] for run in (one, out)]
    print(f"held-out lm_loss: one process {held[0]:.7f}, pipeline {held[1]:.7f}")
    assert abs(held[1] - held[0]) <= 1e-5 * abs(held[0])
    # every rank saved its stage's parameters under their names in the whole model: stage 0 (ranks 0, 1) the
    # embedding, stage 1 (ranks 2, 3) the head and the embedding's copy that MTP reads
    from telechat_moe.safetensors_io import read_safetensors
    names = [set(read_safetensors(out / "checkpoints" / f"rank_{r}" / "step_00000004" / "weights.safetensors")[0])
             for r in range(4)]
    whole = set(read_safetensors(one / "checkpoints" / "rank_0" / "step_00000004" / "weights.safetensors")[0])
    # (the two data-parallel ranks of a stage hold the same weights and each its slice of their optimizer state)
    weights = [{n for n in held if not n.startswith("adam_")} for held in names]
    assert weights[0] == weights[1] and weights[2] == weights[3] and set().union(*names) == whole
    assert "embed_tokens.weight" in names[0] & names[2] and "lm_head.weight" in names[2] - names[0]
    # step 3's checkpoint resumes in one process (each stage's tensors from its ranks' folders, the experts put
    # together from their EP slices) and continues the one-process run at step 4
    resumed = tmp_path / "resumed_pp1"
    shutil.copytree(out, resumed)
    for rank in range(4):
        shutil.rmtree(resumed / "checkpoints" / f"rank_{rank}" / "step_00000004")
    proc = run_cli("run_train.py", "--recipe", "tiny", "--resume",
                   *sets(*SHORT, *PARALLEL_COMMON, f"data.tokenizer={one / 'tokenizer.model'}", NO_EVAL,
                         f"output_dir={resumed}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step_00000003" in proc.stdout
    assert_losses_match(one, resumed, (4,), "pp=2 x vpp=3 x dp=2 x ep=2 resumed at pp=1")


def test_dualpipev_is_a_trainable_schedule_with_its_sizes():
    """parallel_config.pipeline_scheduler: dualpipev trains (the executor runs its V, tests/test_pipeline_executor.py)
    where its schedule exists: two chunks per stage and at least 2p micro-batches, each refusal naming its key."""
    import pytest

    from telechat_moe.recipe import RecipeError, load_recipe
    v = ["parallel_config.pipeline_stage=2", "parallel_config.pipeline_scheduler=dualpipev"]
    assert load_recipe("tiny", v + ["parallel_config.pp_interleave_num=2", "parallel_config.micro_batch_num=4"]
                       ).parallel_config.pipeline_scheduler == "dualpipev"
    for extra, key in ((["parallel_config.micro_batch_num=4"], "pp_interleave_num"),
                       (["parallel_config.pp_interleave_num=2", "parallel_config.micro_batch_num=2"],
                        "micro_batch_num")):
        with pytest.raises(RecipeError, match=f"parallel_config.{key}: dualpipev"):
            load_recipe("tiny", v + extra)
