"""A run's start and its files when something is wrong (issue #19), through the real command line: one line, exit 2,
no traceback, and an existing output folder unchanged. Cases that end before MindSpore starts run in this process
(helpers.run_main); the others run `python run_train.py` or msrun: a second run into a running folder, metrics.jsonl
after a resume, a worker killed under msrun."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import (CORPUS, ROOT, assert_one_line_error, free_port, msrun_environment, one_msrun_at_a_time,
                           run_cli, run_main)
from tests.test_training import NO_EVAL, SHORT, _digest, sets

# SHORT with a smaller model (2 layers, 4 experts): these runs test files and messages, not learning.
SMALL = SHORT + ["model.num_hidden_layers=2", "model.n_routed_experts=4", "model.num_experts_per_tok=2", NO_EVAL]
TOKENIZER_PIECES = 600


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """The files an earlier run left in its output folder: a tokenizer of TOKENIZER_PIECES pieces, its logs, a
    TensorBoard events file (the checkpoints are added by the cases that need them)."""
    from data_sched.tokenizer import train_tokenizer
    folder = tmp_path_factory.mktemp("earlier_run")
    lines = (CORPUS / "tiny_shakespeare.txt").read_text(encoding="utf-8").splitlines()[:4000]
    train_tokenizer(["\n".join(lines)], TOKENIZER_PIECES, str(folder / "tokenizer"))
    logs = folder / "logs"
    (logs / "tensorboard").mkdir(parents=True)
    (logs / "recipe.yaml").write_text("name: tiny\n")
    (logs / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0 - s}) + "\n" for s in (1, 2)))
    (logs / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"earlier events")
    return folder


def run_folder(earlier_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(earlier_run, out)
    return out


def recipe_file(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_bytes(content)
    return str(path)


# ---- refused before MindSpore starts: (argv from tmp_path, words of the line) -----------------------------------
BEFORE_MINDSPORE = {
    "seed_negative": (lambda tmp: ["--recipe", "tiny", "--set", "seed=-1"], ["seed", "[0, 4294967295]", "-1"]),
    "seed_too_big": (lambda tmp: ["--recipe", "tiny", "--set", "seed=99999999999"], ["seed", "99999999999"]),
    "learning_rate_inf": (lambda tmp: ["--recipe", "tiny", "--set", "optimizer.learning_rate=.inf"],
                          ["optimizer.learning_rate", "finite", "inf"]),
    "learning_rate_nan": (lambda tmp: ["--recipe", "tiny", "--set", "optimizer.learning_rate=.nan"],
                          ["optimizer.learning_rate", "nan"]),
    "eps_inf": (lambda tmp: ["--recipe", "tiny", "--set", "optimizer.eps=.inf"], ["optimizer.eps", "finite"]),
    "recipe_of_binary_bytes": (lambda tmp: ["--recipe", recipe_file(tmp, bytes(range(256)) * 8)],
                               ["recipe.yaml", "not a text file"]),
    "recipe_nested_5000_deep": (lambda tmp: ["--recipe", recipe_file(tmp, b"model: " + b"[" * 5000 + b"]" * 5000)],
                                ["recipe.yaml", "nested too deeply"]),
    "recipe_nested_100_deep": (lambda tmp: ["--recipe", recipe_file(tmp, b"model: " + b"{a: " * 100 + b"1"
                                                                    + b"}" * 100)],
                               ["recipe.yaml", "nested too deeply"]),
    "recipe_empty": (lambda tmp: ["--recipe", recipe_file(tmp, b"")], ["recipe.yaml", "is empty"]),
    "recipe_of_comments_only": (lambda tmp: ["--recipe", recipe_file(tmp, b"# nothing yet\n")],
                                ["recipe.yaml", "is empty"]),
    # the earlier run's tokenizer.model (600 pieces) meets a smaller embedding
    "tokenizer_of_the_folder_too_big": (lambda tmp: ["--recipe", "tiny", "--set", "model.vocab_size=512"],
                                        ["out/tokenizer.model", "600 pieces", "model.vocab_size=512"]),
    "tokenizer_named_too_big": (lambda tmp: ["--recipe", "tiny", "--set", "model.vocab_size=512", "--set",
                                             f"data.tokenizer={tmp / 'out' / 'tokenizer.model'}"],
                                ["tokenizer.model", "600 pieces", "model.vocab_size=512"]),
}


# PyYAML recurses 8x slower once MindSpore is imported (as in this process): 0.6 s for the whole fresh process.
FRESH_PROCESS = {"recipe_nested_5000_deep"}


@pytest.mark.parametrize("case", sorted(BEFORE_MINDSPORE))
def test_refused_before_mindspore(case, earlier_run, tmp_path, capfd):
    out = run_folder(earlier_run, tmp_path)
    before = _digest(out)
    argv, needles = BEFORE_MINDSPORE[case]
    args = [*argv(tmp_path), "--set", f"output_dir={out}"]
    proc = run_cli("run_train.py", *args) if case in FRESH_PROCESS else run_main(capfd, *args)
    assert_one_line_error(proc, *needles)
    assert _digest(out) == before


# ---- refused once the trainer is built, before its first step ------------------------------------------------
def _foreign_checkpoint(out: Path) -> None:
    from mindspore import Parameter, Tensor
    from telechat_moe.checkpoint import save_checkpoint
    foreign = [Parameter(Tensor(np.zeros((10, 12), np.float32)), name="embed_tokens.weight")]
    save_checkpoint(out / "checkpoints", 0, 5, foreign, {"step": 5}, keep=3)


def _checkpoints_a_file(out: Path) -> None:
    (out / "checkpoints").write_text("not a folder")


IN_THE_TRAINER = {
    "checkpoint_of_another_model_shape": (_foreign_checkpoint, ["--resume"],
                                          ["weights.safetensors", "embed_tokens", "another shape"]),
    "checkpoint_folder_not_writable": (_checkpoints_a_file, [], ["checkpoints/rank_0", "not writable"]),
}


@pytest.mark.parametrize("case", sorted(IN_THE_TRAINER))
def test_refused_before_the_first_step_keeps_the_folder(case, earlier_run, tmp_path):
    """The logs, TensorBoard files and tokenizer of the earlier run are untouched: the trainer writes them only
    once resume() and the checkpoint preflight have passed."""
    out = run_folder(earlier_run, tmp_path)
    make, flags, needles = IN_THE_TRAINER[case]
    make(out)
    before = _digest(out)
    proc = run_cli("run_train.py", "--recipe", "tiny", *flags, *sets(*SMALL, f"output_dir={out}"))
    assert_one_line_error(proc, *needles)
    assert _digest(out) == before


# ---- two runs into one folder; a resumed run's metrics -------------------------------------------------------------
def _locked_by_another(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_second_run_is_refused_and_a_resume_rewrites_metrics(earlier_run, tmp_path, capfd):
    """A run holds its output folder: a second one into it stops with one line. That run evaluates nothing
    (eval_batches=0) and still saves its last checkpoint. Its step-4 checkpoint then goes (as if killed before that
    save): the resumed run replays steps 3 and 4, and metrics.jsonl holds every step once, with the same values."""
    out = tmp_path / "out"
    tokenizer = f"data.tokenizer={earlier_run / 'tokenizer.model'}"
    common = SMALL + ["training.train_steps=4", "training.save_interval=2", tokenizer,
                      f"output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3"}
    first = subprocess.Popen([sys.executable, "run_train.py", "--recipe", "tiny", *sets(*common)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not _locked_by_another(out / ".lock.rank0") and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before it was seen holding its folder"
        second = run_main(capfd, "--recipe", "tiny", *sets(*common))
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert_one_line_error(second, f"output_dir: {out} is in use by another training run (process {first.pid})")
    assert first.returncode == 0, stderr[-3000:]
    assert "held-out lm_loss" not in stdout
    assert json.loads((out / "logs" / "summary.json").read_text())["eval_lm_loss"] is None
    rank0 = out / "checkpoints" / "rank_0"
    assert sorted(p.name for p in rank0.iterdir()) == ["step_00000002", "step_00000004"]
    assert not list(out.glob(".lock*")) and not list(out.glob(".tokenizer*"))
    straight = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in straight] == [1, 2, 3, 4]

    shutil.rmtree(rank0 / "step_00000004")
    proc = run_cli("run_train.py", "--recipe", "tiny", "--resume", *sets(*common))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 2" in proc.stdout
    resumed = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)


# ---- a worker killed under msrun -----------------------------------------------------------------------------------
def _job_processes(out: Path) -> dict[str, int]:
    """The msrun job's processes writing into `out`, by role: "rank_<r>" for workers, "scheduler"."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = dict(e.split(b"=", 1) for e in (entry / "environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if b"run_train.py" not in cmdline or str(out).encode() not in cmdline or b"msrun" in cmdline:
            continue
        if environ.get(b"MS_ROLE") == b"MS_SCHED":
            found["scheduler"] = int(entry.name)
        elif environ.get(b"MS_ROLE") == b"MS_WORKER":
            found[f"rank_{environ.get(b'RANK_ID', b'?').decode()}"] = int(entry.name)
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


# under expert parallelism (data parallel too: ep=2 of dp=2), whose all-to-alls are what a dead peer blocks
@pytest.mark.parametrize("layout", [["parallel_config.expert_parallel=2"]], ids=["ep"])
def test_a_killed_worker_leaves_one_line_in_every_other_log(earlier_run, tmp_path, layout):
    """msrun without --join (with --join=True msrun itself SIGKILLs the job's other local workers at once, as it
    does on a node where a worker died; on the other nodes, and here, they live on): rank 1 is killed once training
    has started; rank 0 and the scheduler each end with one application line, no traceback. MS_NODE_TIMEOUT (the
    heartbeat timeout) makes MindSpore notice in seconds instead of half a minute. Under expert parallelism rank 0
    is then waiting in the experts' all-to-all for a peer that is gone."""
    out, logs = tmp_path / "out", tmp_path / "msrun_logs"
    msrun = shutil.which("msrun", path=os.path.dirname(sys.executable))
    env = {**msrun_environment(), "MS_NODE_TIMEOUT": "10"}
    with one_msrun_at_a_time():          # the job runs until it is killed: alone, as every msrun job here
        proc = run_cli(msrun, "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}", "--join=False",
                       f"--log_dir={logs}", "--cluster_time_out=60", "run_train.py", "--recipe", "tiny",
                       *sets(*SMALL, *layout, "training.train_steps=1000", "parallel_config.data_parallel=2",
                             f"data.tokenizer={earlier_run / 'tokenizer.model'}", f"output_dir={out}"), env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        job = {}
        try:
            deadline = time.time() + 240
            while time.time() < deadline and "step      1/" not in _read(logs / "worker_0.log"):
                time.sleep(0.2)
            job = _job_processes(out)
            assert {"scheduler", "rank_0", "rank_1"} <= set(job), (job, _read(logs / "worker_0.log")[-3000:])
            os.kill(job["rank_1"], signal.SIGKILL)
            deadline = time.time() + 120
            while time.time() < deadline and (_running(job["rank_0"]) or _running(job["scheduler"])):
                time.sleep(0.2)
            assert not _running(job["rank_0"]) and not _running(job["scheduler"]), "the job did not end"
        finally:
            for pid in {**_job_processes(out), **job}.values():
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)
    for log, needles in (("worker_0.log", ["error: rank 0:", "a process of this msrun job"]),
                         ("scheduler.log", ["error: msrun scheduler: the job failed:", "worker 1"])):
        text = _read(logs / log)
        lines = [line for line in text.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in text, f"{log}:\n{text[-3000:]}"
        for needle in needles:
            assert needle in lines[0], (needle, lines[0])


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""
