"""bench.layout_agreement's layout language: what a layout string sets and how many processes it needs."""
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
