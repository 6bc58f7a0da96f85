"""Data parallelism across real processes: DP=2 under msrun equals one process (weights, Adam moments, logged losses,
held-out loss, tensor dumps through precision.compare, the samples each rank read). Its own module, so that the
suite's two workers can run it beside test_training's long one-process runs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from precision.tolerance import chain_tolerance, relative_error
from tests.conftest import PARALLEL_COMMON
from tests.helpers import msrun, run_cli
from tests.test_training import SHORT, metrics, sets


def indexed_copy_of_the_default_corpus(folder: Path, tokenizer: Path) -> str:
    """The embedded corpus that one_process_tiny trains on, as an indexed dataset: the same packed samples, served
    memory-mapped (tests/test_data_indexed.py checks the two paths give the same samples)."""
    from data_sched.default_corpus import default_corpus
    from data_sched.indexed_dataset import write_indexed_dataset
    from data_sched.tokenizer import Tokenizer
    tok = Tokenizer.load(str(tokenizer))
    write_indexed_dataset(str(folder / "corpus"), tok.encode_documents(default_corpus()), tok.vocab_size)
    return str(folder / "corpus.bin")


def samples_read(out: Path, rank: int) -> dict[int, list[int]]:
    lines = (out / "logs" / f"samples_rank{rank}.jsonl").read_text().splitlines()
    return {rec["step"]: rec["samples"] for rec in map(json.loads, lines)}


def test_data_parallel_under_msrun_matches_one_process(tmp_path, one_process_tiny):
    """Same global batch, DP=2 under msrun vs one process, the DP run reading the corpus as a memory-mapped indexed
    dataset: at every step its ranks read disjoint samples whose union is the one-process run's global batch.
    Only the reduction order differs (per-rank means, then a
    mean over ranks, instead of one mean), so after the first step Adam's first moment (linear in the gradient)
    agrees within the fp32 tolerance of that reduction. Adam then moves each weight by at most lr per step whatever
    the gradient, so after n steps the weights cannot differ by more than 2 * sum(lr) per element (a tighter
    weight bound would be a guess: an element whose gradient is near zero may take a step of either sign)."""
    one, two = one_process_tiny, tmp_path / "dp2"     # the one-process run has z-loss on: every loss is compared
    common = SHORT + PARALLEL_COMMON + ["training.dump_steps=1", "data.log_samples=true"]
    corpus = indexed_copy_of_the_default_corpus(tmp_path, one / "tokenizer.model")
    proc, logs = msrun(2, tmp_path / "msrun_logs", "run_train.py", "--recipe", "tiny",
                       *sets(*common, "parallel_config.data_parallel=2", f"data.tokenizer={one / 'tokenizer.model'}",
                             f"data.paths=[{corpus}]", f"output_dir={two}"), cluster_time_out=120)
    assert proc.returncode == 0, logs
    assert "world=2" in logs
    whole, halves = samples_read(one, 0), [samples_read(two, r) for r in (0, 1)]
    assert sorted(whole) == sorted(halves[0]) == sorted(halves[1]) == [1, 2, 3, 4]
    for step in whole:
        first, second = halves[0][step], halves[1][step]
        assert not set(first) & set(second), step
        assert sorted(first + second) == sorted(whole[step]) and len(first) == len(second), step

    def at(out: Path, rank: int, step: int) -> dict[str, np.ndarray]:
        return load_file(str(out / "checkpoints" / f"rank_{rank}" / f"step_{step:08d}" / "weights.safetensors"))

    for step in (1, 3):
        a, b = at(two, 0, step), at(two, 1, step)
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"ranks disagree on {name} at step {step}")
    tokens = 4 * 64
    first = chain_tolerance("float32", [tokens])
    single, parallel = at(one, 0, 1), at(two, 0, 1)
    worst_m = max(relative_error(parallel[n], single[n]) for n in single if n.startswith("adam_m."))
    print(f"DP=2 vs one process after step 1: worst first-moment relative error {worst_m:.2e} "
          f"(tolerance {first.rtol:.2e})")
    assert worst_m <= first.rtol
    single, parallel = at(one, 0, 3), at(two, 0, 3)
    lrs = [rec["lr"] for rec in metrics(one).values()]
    names = [n for n in single if not n.startswith(("adam_", "global_step", "learning_rate"))]
    for n in names:
        assert np.max(np.abs(parallel[n] - single[n])) <= 2 * sum(lrs), n
    worst_w = max(relative_error(parallel[n], single[n]) for n in names)
    print(f"DP=2 vs one process after 3 steps: worst weight relative error {worst_w:.2e}")

    # what the user reads: the step lines, metrics.jsonl and TensorBoard show the global batch's losses and the
    # held-out loss covers the one-process run's held-out samples. Step 1 starts from the same weights, so only
    # the loss's reduction order differs (per-rank means, then their mean); later steps also carry the weights'
    # differences, which the first-moment bound above keeps within the same chain over the step's tokens.
    logged_one, logged_two = metrics(one), metrics(two)
    assert sorted(logged_one) == sorted(logged_two) == [1, 2, 3, 4]
    keys = ("loss", "lm_loss", "mtp_loss", "aux_loss", "z_loss", "grad_norm")
    step_tol = chain_tolerance("float32", [tokens, tokens])
    for step in (1, 2, 3, 4):
        for key in keys:
            err = relative_error(logged_two[step][key], logged_one[step][key])
            print(f"step {step} {key}: one process {logged_one[step][key]:.7f}, DP=2 {logged_two[step][key]:.7f}, "
                  f"relative error {err:.2e}")
            assert err <= (first if step == 1 else step_tol).rtol, (step, key, err)
    eval_one = json.loads((one / "logs" / "summary.json").read_text())["eval_lm_loss"]
    eval_two = json.loads((two / "logs" / "summary.json").read_text())["eval_lm_loss"]
    print(f"held-out lm_loss: one process {eval_one:.7f}, DP=2 {eval_two:.7f}")
    assert relative_error(eval_two, eval_one) <= step_tol.rtol

    # the alignment tool on the same two runs: the DP run's dump holds the global batch's forward outputs and
    # losses (gathered and averaged over the ranks), so it aligns tensor by tensor with the one-process run's
    report = run_cli("-m", "precision.compare", str(one / "dump"), str(two / "dump"), "--png", "")
    assert report.returncode == 0, report.stdout + report.stderr
    assert "no divergence" in report.stdout, report.stdout
