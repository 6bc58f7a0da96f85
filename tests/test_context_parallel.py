"""Context parallelism (parallel/cp): the load-balanced split of the sequence, what check_trainable takes, and
training across processes equal to one process."""
from __future__ import annotations

import numpy as np
import pytest

from parallel.cp import gathered_order, shard_positions
from telechat_moe.errors import RecipeError
from telechat_moe.recipe import load_recipe
from telechat_moe.recipe_checks import check_trainable
from tests.conftest import PARALLEL_COMMON
from tests.helpers import assert_losses_match, assert_no_divergence, msrun
from tests.test_training import NO_EVAL, SHORT, sets


@pytest.mark.parametrize("seq,cp", [(64, 2), (512, 4), (48, 3)])
def test_the_split_covers_the_sequence_once_and_balances_causal_work(seq, cp):
    shards = [shard_positions(seq, cp, r) for r in range(cp)]
    assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(seq))
    block = seq // (2 * cp)
    for r, mine in enumerate(shards):
        # a front block and its mirror at the back
        assert np.array_equal(mine[:block], np.arange(r * block, (r + 1) * block))
        assert np.array_equal(mine[block:], np.arange(seq - (r + 1) * block, seq - r * block))
    # the causal keys each rank's queries see (position + 1 each): equal on every rank
    work = {int((mine + 1).sum()) for mine in shards}
    assert len(work) == 1, work
    order = gathered_order(seq, cp)
    assert np.array_equal(np.concatenate(shards)[order], np.arange(seq))
    with pytest.raises(ValueError, match="not divisible by 2\\*context_parallel"):
        shard_positions(seq + 1, cp, 0)


def test_context_parallel_layouts_are_trainable_and_refusals_are_one_line():
    for assignments, world in ((["parallel_config.context_parallel=2"], 2),
                               (["parallel_config.context_parallel=2", "parallel_config.data_parallel=2"], 4),
                               (["parallel_config.context_parallel=2", "parallel_config.model_parallel=2",
                                 "parallel_config.use_seq_parallel=true"], 4),
                               (["parallel_config.context_parallel=2", "parallel_config.pipeline_stage=2",
                                 "parallel_config.micro_batch_num=2"], 4)):
        check_trainable(load_recipe("tiny", assignments), processes=world)
    r = load_recipe("tiny", ["parallel_config.context_parallel=2", "parallel_config.model_parallel=2"])
    r.model.seq_length = 132        # divisible by cp x tp, not by 2 x cp x tp
    with pytest.raises(RecipeError) as e:
        check_trainable(r, processes=4)
    assert str(e.value).startswith("model.seq_length: 132") and "\n" not in str(e.value), str(e.value)


def test_a_pipeline_stage_passes_the_activation_of_its_context_shard():
    """Under pipeline parallelism the next stage's receive buffer holds the rank's positions: its cp shard, cut
    again over tp under sequence parallelism (a buffer of the whole sequence made a cp=2 x pp=2 run wait in its first
    step). pp=2 x cp=2 trains the one-process steps: bench.layout_agreement, docs/attention.md."""
    from telechat_moe.pipeline_step import activation_positions
    pipeline = ["parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=2"]
    for sets, positions in (([], 128), (["parallel_config.context_parallel=2"], 64),
                            (["parallel_config.context_parallel=2", "parallel_config.model_parallel=2",
                              "parallel_config.use_seq_parallel=true"], 32),
                            (["parallel_config.context_parallel=2", "parallel_config.model_parallel=2"], 64)):
        assert activation_positions(load_recipe("tiny", pipeline + sets)) == positions, sets


def test_context_parallel_training_matches_one_process(tmp_path, one_process_tiny):
    """Four processes at cp=2 x tp=2 with sequence parallelism x ep=2 (the load-balanced split, the gathered MLA
    latent, the router's statistics over tp x cp, the all-to-all exchange of each rank's positions, the gradients
    summed over the context group) train the one-process run's steps 1-2: the same losses and gradient norms, and
    precision.compare finds no divergence in their tensor dumps. (cp=2, cp=2 x dp=2 and cp=2 x tp=2 for 30 steps
    at sequence 512: `python -m bench.layout_agreement`, docs/attention.md.)"""
    one, out = one_process_tiny, tmp_path / "cp2"
    proc, logs = msrun(4, tmp_path / "logs", "run_train.py", "--recipe", "tiny", *sets(
        *SHORT, *PARALLEL_COMMON, f"data.tokenizer={one / 'tokenizer.model'}", NO_EVAL, "training.train_steps=2",
        "training.dump_steps=1-2", "parallel_config.context_parallel=2", "parallel_config.model_parallel=2",
        "parallel_config.use_seq_parallel=true", "parallel_config.expert_parallel=2",
        "model.moe_token_dispatcher_type=alltoall", f"output_dir={out}"), cluster_time_out=90)
    assert proc.returncode == 0, logs
    assert_losses_match(one, out, (1, 2), "cp=2 x tp=2 (sp) x ep=2")
    assert_no_divergence(one, out)


def test_the_long_context_recipe_is_the_planners_pick_with_cp_and_fits():
    """recipes/105b-32k.yaml (105B, 16 sequences of 32K on 256 devices): the planner's top ten (ILP-balanced and
    simulated, as `python -m telechat_moe.plan` lists them) split the sequence (cp > 1), the recipe holds the best one,
    its dry run fits the device, and one process stops only at the process count (the layout trains)."""
    from parallel.planner.refine import refine
    from parallel.planner.search import search
    from telechat_moe.dry_run import fit_problem
    from telechat_moe.workload import recipe_workload
    recipe = load_recipe("105b-32k")
    lay = recipe.layout
    w = recipe_workload(recipe, "ascend910b", lay.world_size)
    top = refine(w, search(w), 10)
    assert top and all(c.layout.cp > 1 for c in top), [c.layout.cp for c in top]
    best = top[0]
    assert (best.layout.dp, best.layout.tp, best.layout.cp, best.layout.pp, best.layout.ep) == (
        lay.dp, lay.tp, lay.cp, lay.pp, lay.ep)
    assert best.scores["memory"] <= w.cluster.usable_memory
    assert fit_problem(recipe, 0.0, has_ascend=True) is None
    with pytest.raises(RecipeError, match="but 1 process was launched"):
        check_trainable(recipe, processes=1)


def test_each_ranks_causal_work_is_the_sum_over_its_positions():
    from data_sched.context_split import context_parallel_sq, rank_work
    from data_sched.doc_lengths import DocLengths
    rng = np.random.default_rng(0)
    samples = [np.diff(np.concatenate([[0], np.sort(rng.choice(np.arange(1, 64), rng.integers(0, 6), replace=False)),
                                       [64]])) for _ in range(20)]
    batch = DocLengths.of(samples)
    for cp in (1, 2, 4):
        work = rank_work(batch, 64, cp)
        for j, lengths in enumerate(samples):
            keys = np.arange(64) - np.repeat(np.cumsum(lengths) - lengths, lengths) + 1
            assert [keys[shard_positions(64, cp, r)].sum() for r in range(cp)] == list(work[j]), (cp, j)
    # one document over the whole sequence: the split balances it (sum(l^2 + l) = 2 x its causal work)
    assert context_parallel_sq(DocLengths.of([np.array([64])]), 64, 2)[0] == 64 * 64 + 64


def test_balancing_sees_the_context_parallel_split():
    """reorder with cp=4 prices a sample by its slowest cp rank: over ten batches of 16 samples (1-5 documents of
    256 tokens each, dp=4 x 2 micro-batches), the slowest rank's slot spread (max/mean of the cp-priced slots) is
    never worse than reorder blind to cp and better on average (measured: 1.08 against 1.14)."""
    from data_sched.attention_balance import balance_global_batch
    from data_sched.attention_cost import CostModel
    from data_sched.context_split import context_parallel_sq
    from data_sched.doc_lengths import DocLengths
    rng = np.random.default_rng(1)
    seq, cp, spreads = 256, 4, {1: [], 4: []}
    for _ in range(10):
        batch = [np.diff(np.concatenate([[0], np.sort(rng.choice(np.arange(1, seq), rng.integers(1, 5),
                                                                 replace=False)), [seq]])) for _ in range(16)]
        priced = context_parallel_sq(DocLengths.of(batch), seq, cp)
        for c in spreads:
            plan = balance_global_batch(batch, "reorder", 4, 2, CostModel(1.0, 0.0), seed=0, cp=c)
            slots = priced[plan.rows].reshape(8, 2).sum(axis=1)
            assert np.allclose(plan.slot_costs_after, slots) or c == 1
            spreads[c].append(slots.max() / slots.mean())
    assert all(a <= b + 1e-12 for a, b in zip(spreads[4], spreads[1]))
    assert np.mean(spreads[4]) < np.mean(spreads[1]) - 0.03, (np.mean(spreads[4]), np.mean(spreads[1]))
