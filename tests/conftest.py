"""Keep MindFormers' and MindSpore's side files (logs, IR dumps) out of the working tree during tests."""
import os
import tempfile

os.environ.setdefault("LOG_MF_PATH", os.path.join(tempfile.gettempdir(), "telechat_tests_mindformers_log"))
os.environ.setdefault("GLOG_v", "3")

import mindspore  # noqa: E402
import pytest  # noqa: E402

# Fix the device before any kernel runs, so tests that set it again (to the same CPU) are accepted in any order.
mindspore.set_device("CPU")



# what one_process_tiny sets on top of tests.test_training.SHORT (z-loss on, so that every logged loss is compared);
# a run compared with it sets the same
PARALLEL_COMMON = ["training.train_steps=4", "training.save_interval=1", "training.keep_checkpoints=4",
                   "model.moe_z_loss_coeff=1e-3"]


# The README's test command runs two pytest-xdist workers, each given whole modules (--dist loadfile: a module's
# fixtures are computed once), in this order. Most tests use about one core (compiling a graph is serial), so two
# workers fill the machine; the modules that take minutes go first, then those near a minute, so that the run does
# not end on one of them alone. By their durations in the last whole run (ff63c20: 25 min 46 s, the last minute of
# it test_training_dumps alone), longest first; the rest keep their order after them.
SLOW_MODULES = ("test_expert_migration", "test_tensor_parallel", "test_training", "test_pipeline_training",
                "test_data_parallel", "test_expert_parallel", "test_train_step", "test_failures", "test_pipeline_replay",
                "test_fusion_report", "test_training_dumps", "test_planner_published", "test_planner_cli",
                "test_checkpoint_failures", "test_precision_faults", "test_profile", "test_hf_equivalence",
                "test_pipeline_executor", "test_show_parallel")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))


@pytest.fixture(scope="session")
def one_process_tiny(tmp_path_factory):
    """tiny (tests.test_training.SHORT) for 4 steps in one process, a checkpoint and a tensor dump at every step: the
    run that the data-, tensor-, expert- and pipeline-parallel runs across processes are compared with (read it,
    never write it). Made once per test session: xdist workers share it through a lock in their common temporary
    folder (the first to arrive trains it, the others wait and read)."""
    from filelock import FileLock
    from tests.helpers import run_cli
    from tests.test_training import SHORT, sets
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out, done = shared / "one_process" / "one", shared / "one_process.done"
    with FileLock(str(shared / "one_process.lock")):
        if not done.exists():
            proc = run_cli("run_train.py", "--recipe", "tiny",
                           *sets(*SHORT, *PARALLEL_COMMON, "training.dump_steps=1-4", "data.log_samples=true",
                                 f"output_dir={out}"))
            assert proc.returncode == 0, proc.stderr[-3000:]
            done.touch()
    return out

