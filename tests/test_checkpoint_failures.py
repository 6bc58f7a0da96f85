"""Checkpoints when something is wrong (issue #19): foreign folders in a rank's folder are skipped with a warning,
a `{}` or mistyped state.json is one line naming it, and a save that fails (read-only folder, full disk) keeps the
previous checkpoint, leaves nothing half-written and is one line; through the command line: exit 2. The preflight
before training refuses the same folders. Unit-level where no run is needed; one fresh run and one resumed run."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mindspore import Parameter, Tensor

from telechat_moe.checkpoint import (TRAINER_STATE, latest_checkpoint, list_checkpoints, load_checkpoint,
                                     preflight, save_checkpoint)
from telechat_moe.errors import CheckpointError
from tests.helpers import ROOT, assert_one_line_error, run_cli

SHORT = ["model.seq_length=64", "model.max_position_embeddings=64", "model.original_max_position_embeddings=64",
         "training.global_batch_size=4", "training.log_interval=1", "training.eval_interval=0",
         # smaller than tiny.yaml for speed: 2 layers, 4 experts, no held-out evaluation (weights + Adam: ~54 MB)
         "model.num_hidden_layers=2", "model.n_routed_experts=4", "model.num_experts_per_tok=2",
         "training.eval_batches=0"]
GOOD_STATE = {"step": 3, "data": {"epoch": 0, "index": 3, "seed": 1}, "loss_scale": 1.0, "loss_scale_good_steps": 3}


def sets(*assignments: str) -> list[str]:
    return [x for a in assignments for x in ("--set", a)]


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def params(value: float) -> list[Parameter]:
    return [Parameter(Tensor(np.full((64, 64), value, np.float32)), name="w"),
            Parameter(Tensor(np.arange(5, dtype=np.int32)), name="count")]


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


# ---- discovery --------------------------------------------------------------------------------------------------
def test_foreign_entries_are_ignored_with_one_warning_each(tmp_path, capsys):
    real = save_checkpoint(tmp_path, 0, 3, params(1.0), GOOD_STATE, keep=1)
    d = tmp_path / "rank_0"
    (d / "step_best").mkdir()
    (d / "step_best" / "state.json").write_text(json.dumps({**GOOD_STATE, "step": 99}))
    (d / "step_00000007").mkdir()                    # a step folder without its state.json
    (d / "step_").mkdir()
    (d / "notes.txt").write_text("mine")
    (d / ".tmp_step_00000009").mkdir()                # this module's own half-written folder: silent
    capsys.readouterr()
    assert list_checkpoints(tmp_path, 0) == [real]
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 4 and all(w.startswith("WARNING: ") and "ignored" in w for w in warnings), warnings
    assert {Path(w.split()[1].rstrip(":")).name for w in warnings} == {"step_best", "step_00000007", "step_",
                                                                         "notes.txt"}
    assert latest_checkpoint(tmp_path, 0) == real and capsys.readouterr().err == ""  # once per process
    # retention (keep=1) never deletes what is not its own
    save_checkpoint(tmp_path, 0, 4, params(2.0), {**GOOD_STATE, "step": 4}, keep=1)
    assert sorted(p.name for p in d.iterdir()) == [".tmp_step_00000009", "notes.txt", "step_", "step_00000004",
                                                   "step_00000007", "step_best"]


# ---- state.json -------------------------------------------------------------------------------------------------
BAD_STATES = {
    "empty object": ({}, "has no field 'step'"),
    "a list": ([], "expected a JSON object"),
    "step as text": ({**GOOD_STATE, "step": "3"}, "step is '3'"),
    "step a bool": ({**GOOD_STATE, "step": True}, "step is True"),
    "negative step": ({**GOOD_STATE, "step": -1}, "step is -1"),
    "no data position": ({**GOOD_STATE, "data": {"epoch": 0}}, "data.index"),
    "data not an object": ({**GOOD_STATE, "data": 3}, "data is int"),
    "loss scale NaN": ({**GOOD_STATE, "loss_scale": float("nan")}, "loss_scale is nan"),
    "no good steps": ({k: v for k, v in GOOD_STATE.items() if k != "loss_scale_good_steps"}, "loss_scale_good_steps"),
}


@pytest.mark.parametrize("case", list(BAD_STATES))
def test_malformed_state_is_refused_in_one_line_and_loads_nothing(tmp_path, case):
    state, needle = BAD_STATES[case]
    path = save_checkpoint(tmp_path, 0, 3, params(1.0), GOOD_STATE, keep=1)
    (path / "state.json").write_text(json.dumps(state))
    target = params(0.0)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, target, TRAINER_STATE)
    text = one_line(e)
    assert text.startswith(f"{path / 'state.json'}: not a trainer state") and needle in text, text
    assert not target[0].asnumpy().any()               # nothing loaded


def test_state_that_is_not_json_is_one_line(tmp_path):
    path = save_checkpoint(tmp_path, 0, 3, params(1.0), GOOD_STATE, keep=1)
    (path / "state.json").write_text("{\"step\": 3,")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, params(0.0), TRAINER_STATE)
    assert one_line(e).startswith(f"{path / 'state.json'}: unreadable trainer state")


def test_a_good_state_loads_exactly(tmp_path):
    path = save_checkpoint(tmp_path, 0, 3, params(1.5), GOOD_STATE, keep=1)
    target = params(0.0)
    assert load_checkpoint(path, target, TRAINER_STATE) == GOOD_STATE
    np.testing.assert_array_equal(target[0].asnumpy(), np.full((64, 64), 1.5, np.float32))


# ---- failing saves ----------------------------------------------------------------------------------------------
# Runs in a fresh process: one checkpoint, then the fault, then saves that must fail cleanly. Prints the errors.
FAILING_SAVES = """
import os, resource, signal, sys
import numpy as np
from telechat_moe.checkpoint import preflight, save_checkpoint
from telechat_moe.errors import CheckpointError

class P:  # what save_checkpoint reads of a Parameter
    def __init__(self, name, value): self.name, self.value = name, value
    def asnumpy(self): return self.value

root, fault = sys.argv[1], sys.argv[2]
params = [P("w", np.full((64, 64), 1.0, np.float32)), P("count", np.arange(5, dtype=np.int32))]
save_checkpoint(root, 0, 1, params, {"step": 1}, keep=3)
if fault == "read-only":
    os.chmod(os.path.join(root, "rank_0"), 0o555)
    os.makedirs(os.path.join(root, "other"), mode=0o555)   # checkpoints/ itself read-only: rank_1 cannot be made
else:                                                       # a file-size limit: writes past it fail with EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
params[0].value = np.full((64, 64), 2.0, np.float32)
attempts = [lambda: save_checkpoint(root, 0, 2, params, {"step": 2}, keep=1),
            lambda: save_checkpoint(root, 0, 1, params, {"step": 1}, keep=1)]  # over the same step
if fault == "read-only":
    attempts += [lambda: save_checkpoint(os.path.join(root, "other"), 1, 1, params, {"step": 1}, keep=1),
                 lambda: preflight(root, 0, 1), lambda: preflight(os.path.join(root, "other"), 1, 1)]
for attempt in attempts:
    try:
        attempt()
        print("saved")
    except CheckpointError as e:
        print(e)
"""


def setpriv_prefix() -> list[str]:
    """As root, permission bits bind only without CAP_DAC_OVERRIDE (and CAP_FOWNER): drop them for the child."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a read-only folder cannot be made")
    caps = "-dac_override,-dac_read_search,-fowner"
    return [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}", "--"]


@pytest.mark.parametrize("fault,cause", [("read-only", "Permission denied"), ("disk-full", "File too large")])
def test_failing_save_keeps_the_previous_checkpoint(tmp_path, fault, cause):
    root = tmp_path / "checkpoints"
    prefix = setpriv_prefix() if fault == "read-only" else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3"}
    proc = subprocess.run([*prefix, sys.executable, "-c", FAILING_SAVES, str(root), fault], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        rank0 = root / "rank_0"
        assert lines[:2] == [f"{rank0}: checkpoint of step {s} not saved ({cause}); the previous checkpoint "
                             f"step_00000001 is intact, nothing half-written is left" for s in (2, 1)], lines
        if fault == "read-only":
            assert lines[2] == (f"{root / 'other' / 'rank_1'}: checkpoint of step 1 not saved ({cause}); there is "
                                f"no earlier checkpoint, nothing half-written is left"), lines
            assert lines[3:] == [f"{rank0}: checkpoint folder is not writable ({cause})",
                                 f"{root / 'other' / 'rank_1'}: checkpoint folder is not writable ({cause})"], lines
        assert sorted(p.name for p in rank0.iterdir()) == ["step_00000001"]
        assert sorted(p.name for p in (rank0 / "step_00000001").iterdir()) == ["state.json", "weights.safetensors"]
        target = [Parameter(Tensor(np.zeros((64, 64), np.float32)), name="w"),
                  Parameter(Tensor(np.zeros(5, np.int32)), name="count")]
        assert load_checkpoint(latest_checkpoint(root, 0), target) == {"step": 1}
        np.testing.assert_array_equal(target[0].asnumpy(), np.ones((64, 64), np.float32))
        np.testing.assert_array_equal(target[1].asnumpy(), np.arange(5, dtype=np.int32))
    finally:
        for p in (root / "rank_0", root / "other"):
            if p.exists():
                p.chmod(0o755)


def test_preflight_refuses_no_room_and_a_file_in_the_way(tmp_path):
    preflight(tmp_path, 0, 1)
    assert list((tmp_path / "rank_0").iterdir()) == []             # the probe is gone
    with pytest.raises(CheckpointError) as e:
        preflight(tmp_path, 0, shutil.disk_usage(tmp_path).free * 4)
    assert one_line(e).startswith(f"{tmp_path / 'rank_0'}: ") and "free on its filesystem" in str(e.value)
    (tmp_path / "blocker").write_text("a file")
    with pytest.raises(CheckpointError) as e:
        preflight(tmp_path / "blocker", 0, 1)
    assert one_line(e) == f"{tmp_path / 'blocker' / 'rank_0'}: checkpoint folder is not writable (Not a directory)"


# ---- through the command line -----------------------------------------------------------------------------------
# run_train.py as the user runs it, under a file-size limit that the weights (~54 MB) exceed and the logs do not.
UNDER_SIZE_LIMIT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
import run_train
sys.exit(run_train.main(sys.argv[1:]))
"""


def test_through_the_command_line(tmp_path):
    """A fresh run; a resumed one that skips a foreign step_best/ and meets a full disk at its save; a resume from a
    `{}` state.json. Both failures: one line, exit 2, the checkpoints untouched."""
    out = tmp_path / "out"
    proc = run_cli("run_train.py", "--recipe", "tiny", *sets(*SHORT, "training.train_steps=1", f"output_dir={out}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0 = out / "checkpoints" / "rank_0"
    (rank0 / "step_best").mkdir()
    (rank0 / "step_best" / "state.json").write_text("{}")
    before = digest(out / "checkpoints")

    proc = run_cli("-c", UNDER_SIZE_LIMIT, "--recipe", "tiny", "--resume",
                   *sets(*SHORT, "training.train_steps=2", f"output_dir={out}"))
    assert f"resumed from {rank0 / 'step_00000001'} at step 1" in proc.stdout, proc.stdout[-2000:]
    assert f"WARNING: {rank0 / 'step_best'}: not a checkpoint" in proc.stderr
    assert_one_line_error(proc, f"{rank0}: checkpoint of step 2 not saved (File too large)",
                          "step_00000001 is intact")
    assert digest(out / "checkpoints") == before
    assert sorted(p.name for p in rank0.iterdir()) == ["step_00000001", "step_best"]

    (rank0 / "step_00000001" / "state.json").write_text("{}")
    before = digest(out / "checkpoints")
    proc = run_cli("run_train.py", "--recipe", "tiny", "--resume", *sets(*SHORT, f"output_dir={out}"))
    assert_one_line_error(proc, f"{rank0 / 'step_00000001' / 'state.json'}: not a trainer state (has no field 'step')")
    assert digest(out / "checkpoints") == before
