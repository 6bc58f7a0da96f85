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


@pytest.fixture(scope="session")
def one_process_tiny(tmp_path_factory):
    """tiny (tests.test_training.SHORT) for 4 steps in one process, a checkpoint and a tensor dump at every step: the
    run that the data-, tensor- and expert-parallel runs across processes are compared with (read it, never write it)."""
    from tests.helpers import run_cli
    from tests.test_training import SHORT, sets
    out = tmp_path_factory.mktemp("one_process") / "one"
    proc = run_cli("run_train.py", "--recipe", "tiny", *sets(*SHORT, *PARALLEL_COMMON, "training.dump_steps=1-4",
                                                              f"output_dir={out}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out

