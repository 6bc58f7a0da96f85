"""bench.layout_agreement's layout language (what a layout string sets, how many processes it needs), its --reuse,
and bench.pipeline_trees' reading of step times."""
import pytest

from bench.layout_agreement import main, parse_layout


def test_a_layout_names_its_assignments_and_process_count():
    layout = parse_layout("pp2 dp2 vpp2 ep2 m4 sp hier parallel_config.pipeline_scheduler=gpipe")
    assert layout.world == 4                  # pp x dp; ep splits the ranks dp already counts
    assert layout.assignments == [
        "parallel_config.pipeline_stage=2", "parallel_config.data_parallel=2", "parallel_config.pp_interleave_num=2",
        "parallel_config.expert_parallel=2", "parallel_config.micro_batch_num=4",
        "parallel_config.use_seq_parallel=true", "model.moe_token_dispatcher_type=hierarchical",
        "parallel_config.devices_per_node=2", "parallel_config.pipeline_scheduler=gpipe"]
    assert parse_layout("cp2 tp2").world == 4


@pytest.mark.parametrize("bad", ["dq2", "dp", "tp2 x"])
def test_an_unknown_token_is_one_line_and_exit_2(bad, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--layout", bad])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stop.value.code == 2 and len(err) == 1 and "--layout" in err[0], err


def test_reuse_keeps_only_a_folder_of_exactly_this_run(tmp_path):
    """--reuse: a kept folder is this run's only if its resolved recipe is the one these assignments resolve to; a
    folder of more settings (pp2 tp2 m4's) is not pp2 m4's though it holds every one of pp2 m4's assignments."""
    import yaml

    from bench.layout_agreement import trained_with
    from telechat_moe.recipe import load_recipe
    wider = [*parse_layout("pp2 tp2 m4").assignments, f"output_dir={tmp_path}"]
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "recipe.yaml").write_text(yaml.safe_dump(load_recipe("tiny", wider).to_dict(),
                                                                   sort_keys=False))
    assert trained_with(tmp_path, "tiny", wider)
    assert not trained_with(tmp_path, "tiny", [*parse_layout("pp2 m4").assignments, f"output_dir={tmp_path}"])
    assert not trained_with(tmp_path / "absent", "tiny", wider)


def test_pipeline_trees_reads_each_steps_own_time():
    """bench.pipeline_trees: metrics' step_time_s is the mean of the steps since the first; each step's own time
    is recovered from consecutive means (the bench had read step 3's mean as its own)."""
    from bench.pipeline_trees import own_step_times
    own = {2: 3.75, 3: 1.87, 4: 1.88, 5: 2.06}
    means, total = [], 0.0
    for n, t in own.items():
        total += t
        means.append({"step": n, "step_time_s": total / (n - 1)})
    got = own_step_times([{"step": 1, "step_time_s": 11.8}, *means, {"step": 5, "eval_lm_loss": 8.2}])
    assert got == pytest.approx(own)
