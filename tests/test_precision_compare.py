"""Tensor dumps and run-vs-run comparison on synthetic runs: round trips, walk order, error signatures, and the
CLI's answers to runs that cannot be compared."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from precision.compare import compare_runs, walk_order
from precision.dump import DumpError, DumpWriter, TensorRecord, config_hash, open_run, parse_steps
from precision.harness import first_diverging_change
from precision.signatures import Risk, diagnose
from precision.tolerance import tolerance

ROOT = Path(__file__).resolve().parents[1]
META = {"model_config_hash": config_hash({"layers": 3, "hidden": 8}), "layout": {"tp": 1}}


def fake_step(seed=0, layers=3, batch=2, seq=8, hidden=8, edit=None):
    """float32 records of a pretend 3-layer step; `edit(name, array)` may change a tensor before it is dumped."""
    rng = np.random.default_rng(seed)
    records = [TensorRecord("embed", "forward", rng.standard_normal((batch, seq, hidden)), None, "embedding",
                            dims="bsh")]
    for i in range(layers):
        records += [TensorRecord(f"layers.{i}.attn.rope_q", "forward", rng.standard_normal((batch, seq, 2, 4)), i,
                                 "rope", dims="bsnd"),
                    TensorRecord(f"layers.{i}.attn", "forward", rng.standard_normal((batch, seq, hidden)), i,
                                 "mla_attention", dims="bsh"),
                    TensorRecord(f"layers.{i}.moe.combine_weights", "forward", rng.uniform(0.1, 1, (batch * seq, 2)),
                                 i, "moe.combine", dims="tk"),
                    TensorRecord(f"layers.{i}.out", "forward", rng.standard_normal((batch, seq, hidden)), i, "layer",
                                 dims="bsh")]
    records.append(TensorRecord("loss", "loss", np.array(rng.uniform(2, 5)), None, "cross_entropy"))
    for name, layer in [("embed", None)] + [(f"layers.{i}.w", i) for i in range(layers)] + [("head", None)]:
        records.append(TensorRecord(f"grad.{name}", "grad", rng.standard_normal((hidden, hidden)), layer, "grad"))
    records.append(TensorRecord("exp_avg.head", "optimizer", rng.standard_normal((hidden, hidden)), None, "adamw"))
    edit = edit or (lambda name, a: a)
    return [TensorRecord(r.name, r.kind, edit(r.name, np.array(r.value, np.float32)).astype(np.float32), r.layer,
                         r.operator, r.k, r.dims) for r in records]


def dump(root, records, meta=META, step=0, rank=0):
    DumpWriter(root, meta, rank=rank).write(step, records)
    return root


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "precision.compare", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT)


# ---- dumps ---------------------------------------------------------------------------------------------
def test_dump_round_trip_with_index_and_mindspore_tensors(tmp_path):
    import mindspore as ms
    bf16 = ms.Tensor(np.array([[1.5, -2.25]], np.float32)).astype(ms.bfloat16)
    records = fake_step() + [TensorRecord("layers.0.bf16", "forward", bf16, 0, "cast"),
                             TensorRecord("layers.0.fp16", "forward", ms.Tensor(np.ones(3, np.float16)), 0, "x")]
    dump(tmp_path / "run", records, step=7)
    run = open_run(tmp_path / "run")
    assert run.steps == [7] and run.meta == META
    entries = {e.name: e for e in run.entries(7)}
    assert entries["layers.0.bf16"].dtype == "bfloat16" and entries["layers.0.fp16"].dtype == "float16"
    np.testing.assert_array_equal(run.load(entries["layers.0.bf16"]), [[1.5, -2.25]])
    assert entries["layers.1.attn"].layer == 1 and entries["layers.1.attn"].k == 8  # last dimension by default
    for r in fake_step():
        np.testing.assert_array_equal(run.load(entries[r.name]), r.value)
    assert not [p for p in (tmp_path / "run").iterdir() if ".tmp" in p.name]
    index = json.loads((tmp_path / "run" / "step_00000007.rank0.json").read_text())
    assert {"name", "kind", "layer", "operator", "order", "shape", "dtype", "step", "rank"} <= set(index[0])


def test_dump_refuses_another_runs_directory_and_bad_records(tmp_path):
    dump(tmp_path / "run", fake_step())
    DumpWriter(tmp_path / "run", META).write(1, fake_step())  # the same run continues (resume)
    with pytest.raises(DumpError, match="another run"):
        DumpWriter(tmp_path / "run", {**META, "model_config_hash": "other"})
    writer = DumpWriter(tmp_path / "run2", META)
    with pytest.raises(DumpError, match="kind"):
        writer.write(0, [TensorRecord("x", "activation", np.ones(2))])
    with pytest.raises(DumpError, match="twice"):
        writer.write(0, [TensorRecord("x", "forward", np.ones(2))] * 2)
    with pytest.raises(DumpError, match="dims"):
        writer.write(0, [TensorRecord("x", "forward", np.ones(2), dims="bs")])


def test_parse_steps():
    assert parse_steps("3, 10-12") == {3, 10, 11, 12}
    for bad in ("", "a", "5-2", "1,,2"):
        with pytest.raises(DumpError, match="dump_steps"):
            parse_steps(bad)


def test_walk_order_is_forward_then_backward():
    from precision.dump import IndexEntry
    entries = [IndexEntry(n, k, None, "", o, (1,), "float32", 1, "", 0, 0) for n, k, o in
               [("g0", "grad", 0), ("f0", "forward", 0), ("opt", "optimizer", 0), ("g1", "grad", 1),
                ("loss", "loss", 0), ("f1", "forward", 1)]]
    assert [e.name for e in walk_order(entries)] == ["f0", "f1", "loss", "g1", "g0", "opt"]


# ---- comparison ----------------------------------------------------------------------------------------
def test_identical_runs_agree(tmp_path):
    report = compare_runs(dump(tmp_path / "a", fake_step()), dump(tmp_path / "b", fake_step()))
    assert report.first is None and len(report.rows) == len(fake_step())
    proc = run_cli(tmp_path / "a", tmp_path / "b", "--png", tmp_path / "p.png")
    assert proc.returncode == 0 and "no divergence" in proc.stdout and (tmp_path / "p.png").stat().st_size > 0


def test_float32_noise_is_inside_the_chain_tolerance(tmp_path):
    rng = np.random.default_rng(5)
    noisy = fake_step(edit=lambda n, a: a * (1 + tolerance("float32").rtol * rng.uniform(-1, 1, a.shape)))
    assert compare_runs(dump(tmp_path / "a", fake_step()), dump(tmp_path / "b", noisy)).first is None


def _first(tmp_path, edit, meta_b=META, replicas=None):
    a = dump(tmp_path / "a", fake_step())
    b = dump(tmp_path / "b", fake_step(edit=edit), meta_b)
    for rank, rank_edit in (replicas or {}).items():
        dump(b, fake_step(edit=rank_edit), meta_b, rank=rank)
    report = compare_runs(a, b)
    assert report.first is not None
    return report


def test_tp_partial_sum_scaled(tmp_path):
    report = _first(tmp_path, lambda n, a: a / 2 if n == "layers.1.attn" else a, {**META, "layout": {"tp": 2}})
    assert (report.first.entry.name, report.first.entry.layer) == ("layers.1.attn", 1)
    assert report.diagnosis.risk is Risk.TP and "1/tp" in report.diagnosis.evidence


def test_pp_gradients_divided_twice(tmp_path):
    layout = {"pp": 2, "micro_batch_num": 4}
    report = _first(tmp_path, lambda n, a: a / 4 if n in ("grad.layers.0.w", "grad.layers.1.w", "grad.embed")
                    else a, {**META, "layout": layout})
    assert report.first.entry.name == "grad.layers.1.w"  # backward order: the later layer first
    assert report.diagnosis.risk is Risk.PP and "micro_batch_num" in report.diagnosis.evidence


def test_unexplained_factor(tmp_path):
    report = _first(tmp_path, lambda n, a: a * 3 if n == "layers.2.out" else a)
    assert report.diagnosis.risk is Risk.SCALE


def test_sp_offset_on_one_shard(tmp_path):
    def rotate_second_half(name, a):
        if name != "layers.2.attn.rope_q":
            return a
        out = a.copy()
        c, s = np.cos(0.7), np.sin(0.7)
        out[:, 4:, :, :2] = c * a[:, 4:, :, :2] - s * a[:, 4:, :, 2:]
        out[:, 4:, :, 2:] = s * a[:, 4:, :, :2] + c * a[:, 4:, :, 2:]
        return out
    report = _first(tmp_path, rotate_second_half, {**META, "layout": {"tp": 2, "sp": True}})
    assert report.first.entry.layer == 2 and report.diagnosis.risk is Risk.SP
    assert "positions 4..7 of 8" in report.diagnosis.evidence and "rotation" in report.diagnosis.evidence


def test_ep_weights_in_wrong_order(tmp_path):
    rng = np.random.default_rng(3)
    report = _first(tmp_path, lambda n, a: rng.permutation(a.ravel()).reshape(a.shape)
                    if n == "layers.1.moe.combine_weights" else a, {**META, "layout": {"ep": 2}})
    assert report.first.entry.layer == 1 and report.diagnosis.risk is Risk.EP
    assert "another order" in report.diagnosis.evidence


def test_dp_replicas_that_were_never_reduced(tmp_path):
    rng = np.random.default_rng(4)
    local = {0: rng.standard_normal((8, 8)), 1: rng.standard_normal((8, 8))}

    def rank_grad(rank):
        def edit(name, a):
            return a + local[rank] - (local[0] + local[1]) / 2 if name == "grad.layers.2.w" else a
        return edit
    report = _first(tmp_path, rank_grad(0), {**META, "layout": {"dp": 2}}, replicas={1: rank_grad(1)})
    assert report.first.entry.name == "grad.layers.2.w" and report.diagnosis.risk is Risk.DP
    assert "mean matches run A" in report.diagnosis.evidence


def test_first_diverging_change_names_the_broken_one(tmp_path):
    edits = {"fusion": lambda n, a: a * (1 + 1e-7), "tp=2": lambda n, a: a / 2 if n == "layers.2.attn" else a,
             "ep=2": lambda n, a: a}

    def make_step(changes):
        def edit(name, a):
            for change in changes:
                a = edits[change](name, a)
            return a
        return lambda: fake_step(edit=edit)
    change, report = first_diverging_change(make_step, ["fusion", "tp=2", "ep=2"], tmp_path,
                                            lambda changes: {**META, "layout": {"tp": 2 if "tp=2" in changes else 1}})
    assert change == "tp=2" and report.first.entry.name == "layers.2.attn" and report.diagnosis.risk is Risk.TP
    assert first_diverging_change(make_step, ["fusion", "ep=2"], tmp_path / "fine", lambda c: META) == (None, None)


def test_a_degree_must_explain_the_factor_to_drift():
    """b = 2 a up to a few float32 roundings is TP's factor; a factor 2.001 is not, however close."""
    a = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    tol = tolerance("float32", 8).rtol
    for factor, risk in ((np.float32(2) * (1 + np.float32(tol)), Risk.TP), (2.001, Risk.SCALE)):
        b = (a * factor).astype(np.float32)
        assert diagnose("x", "forward", "matmul", "", a, b, tol, [{"tp": 2}], False).risk is risk, factor


def test_small_drift_is_called_numerical():
    a = np.random.default_rng(0).standard_normal((4, 8))
    tol = 1e-6
    diagnosis = diagnose("x", "forward", "matmul", "", a, a * (1 + 3e-6), tol, [{}], False)
    assert diagnosis.risk is Risk.NUMERIC


def test_drift_spread_over_the_elements_is_numerical():
    a = np.random.default_rng(0).standard_normal((4, 8))
    b = a * (1 + 3e-6 * np.random.default_rng(1).uniform(-1, 1, a.shape))
    assert diagnose("x", "forward", "matmul", "", a, b, 1e-6, [{}, {}], False).risk is Risk.NUMERIC


# ---- faults the classifier once misnamed (issue 19): each gets its category or "inconclusive" ------------------
def _jitter(name, a, target="layers.1.moe.combine_weights"):
    """Combine weights off by up to 10%, not in another order and not by one factor."""
    return a * (1 + 0.1 * np.random.default_rng(7).uniform(-1, 1, a.shape)) if name == target else a


def test_a_routing_operator_is_not_ep_when_neither_run_has_expert_parallelism(tmp_path):
    """Was "EP: routing or combine weights inconsistent" from the operator's name with ep=1 in both runs."""
    report = _first(tmp_path / "ep1", _jitter)
    assert report.first.entry.name == "layers.1.moe.combine_weights"
    assert report.diagnosis.risk is Risk.INCONCLUSIVE, report.diagnosis
    assert "every parallel degree is 1" in report.diagnosis.evidence
    # the same values in another order, still without expert parallelism: no EP either
    rng = np.random.default_rng(3)
    shuffled = _first(tmp_path / "perm", lambda n, a: rng.permutation(a.ravel()).reshape(a.shape)
                      if n == "layers.1.moe.combine_weights" else a)
    assert shuffled.diagnosis.risk is Risk.INCONCLUSIVE and "another order" in shuffled.diagnosis.evidence
    # with ep=2 in run B the routing operator does point to EP
    ep2 = _first(tmp_path / "ep2", _jitter, {**META, "layout": {"ep": 2, "dp": 2}})
    assert ep2.diagnosis.risk is Risk.EP and "ep=2" in ep2.diagnosis.evidence


def test_a_concentrated_fault_under_ten_tolerances_is_not_drift():
    """A norm weight with one element moved by 1e-3, 5 tolerances of a deep float32 gradient: was "numerical
    drift, not a logic fault". Spread over its elements, the same size is drift."""
    a = np.random.default_rng(0).uniform(0.5, 1.5, 32)
    tol = 2e-4
    faulty = a.copy()
    faulty[5] += 1e-3 * np.max(np.abs(a))
    diagnosis = diagnose("norm.weight", "optimizer", "rmsnorm", "h", a, faulty, tol, [{}, {}], True)
    assert diagnosis.risk is Risk.INCONCLUSIVE and "concentrated" in diagnosis.evidence, diagnosis
    drift = a * (1 + 1e-3 * np.random.default_rng(1).uniform(-1, 1, a.shape))
    assert diagnose("norm.weight", "optimizer", "rmsnorm", "h", a, drift, tol, [{}, {}], True).risk is Risk.NUMERIC


def test_a_one_element_fault_among_real_drift_is_not_drift(deep_reference, tmp_path):
    """Real rounding drift (every sum reordered) and one gradient element moved by 1e-3: the fault stays under 10
    tolerances, and is inconclusive, not drift; the drift alone, over a tightened tolerance, is drift."""
    faulty = dump(tmp_path / "fault", deep_step(reorder=True, fault=("grad.layers.0.experts.0", 1e-3)), DEEP_META)
    report = compare_runs(deep_reference, faulty)
    assert report.first.entry.name == "grad.layers.0.experts.0"
    assert report.first.max_rel_error < 10 * report.first.rtol
    assert report.diagnosis.risk is Risk.INCONCLUSIVE, report.diagnosis
    drift = compare_runs(deep_reference, dump(tmp_path / "drift", deep_step(reorder=True), DEEP_META),
                         rtol_scale=0.05)
    assert drift.first.max_rel_error > drift.first.rtol and drift.diagnosis.risk is Risk.NUMERIC, drift.diagnosis


def test_one_number_does_not_make_a_factor(tmp_path):
    """The loss alone differs: was "B = 1.00167 x A exactly", which any two numbers satisfy."""
    report = _first(tmp_path / "loss", lambda n, a: a * 1.00167 if n == "loss" else a)
    assert report.first.entry.name == "loss"
    assert report.diagnosis.risk is Risk.INCONCLUSIVE, report.diagnosis
    assert "exactly" not in report.diagnosis.evidence and "1 element" in report.diagnosis.evidence
    # even a ratio equal to a degree of the layout is no evidence when one number carries it
    halved = _first(tmp_path / "half", lambda n, a: a / 2 if n == "loss" else a, {**META, "layout": {"tp": 2}})
    assert halved.diagnosis.risk is Risk.INCONCLUSIVE and "1/tp" in halved.diagnosis.evidence


# ---- runs that cannot be compared ----------------------------------------------------------------------
def _expect_rc2(proc, *words):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in lines[0]


def test_cli_rejects_incomparable_runs(tmp_path):
    a = dump(tmp_path / "a", fake_step())
    _expect_rc2(run_cli(a, dump(tmp_path / "missing", fake_step()[:-1])), "exp_avg.head", "missing")
    bad_shape = [TensorRecord(r.name, r.kind, np.zeros((3,)) if r.name == "loss" else r.value, r.layer, r.operator,
                              r.k, r.dims) for r in fake_step()]
    _expect_rc2(run_cli(a, dump(tmp_path / "shape", bad_shape)), "'loss'", "shape")
    _expect_rc2(run_cli(a, dump(tmp_path / "model", fake_step(), {**META, "model_config_hash": "abc"})),
                "different models")
    # a control run whose initializer range moved by one ulp hashes as another model; the bench compares it on purpose
    assert compare_runs(a, tmp_path / "model", same_model=False).first is None
    _expect_rc2(run_cli(a, tmp_path / "nowhere"), "no such dump directory")
    (tmp_path / "empty").mkdir()
    _expect_rc2(run_cli(a, tmp_path / "empty"), "no run.json")
    _expect_rc2(run_cli(a, dump(tmp_path / "later", fake_step(), step=5)), "no step")
    _expect_rc2(run_cli(a, a, "--rank", "1"), "rank 1")
    _expect_rc2(run_cli(a, a, "--rtol-scale", "0"), "--rtol-scale")
    corrupt = dump(tmp_path / "corrupt", fake_step())
    (corrupt / "step_00000000.rank0.json").write_text("{not json")
    _expect_rc2(run_cli(a, corrupt), "unreadable index")
    truncated = dump(tmp_path / "truncated", fake_step())
    (truncated / "step_00000000.rank0.safetensors").write_bytes(b"\0\1")
    _expect_rc2(run_cli(a, truncated), "unreadable tensor")


def test_cli_reports_divergence_table_and_plot(tmp_path):
    a = dump(tmp_path / "a", fake_step())
    b = dump(tmp_path / "b", fake_step(edit=lambda n, x: x / 2 if n == "layers.1.attn" else x),
             {**META, "layout": {"tp": 2}})
    proc = run_cli(a, b, "--png", tmp_path / "err.png", "--json", tmp_path / "r.json")
    assert proc.returncode == 1, proc.stderr
    assert "first divergence" in proc.stdout and "layer 1, operator mla_attention" in proc.stdout
    assert "category: TP" in proc.stdout and "DIVERGED" in proc.stdout
    assert (tmp_path / "err.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "r.json").read_text())["first_divergence"]["category"] == "TP"


# ---- tolerances follow the computation, not the number of tensors dumped -------------------------------------
DEEP_LAYERS, DEEP_HIDDEN, DEEP_TOKENS = 4, 256, 64


def deep_step(blocks=256, reorder=False, fault=None):
    """float32 records of a step computed for real: four tanh layers (outputs, k = hidden), a mean-square loss,
    each layer's weight gradient dumped in `blocks` column blocks as an MoE layer dumps its experts' gradients
    (k = tokens, what dW = X^T dY sums over) and two Adam moments of each block: 3077 tensors at 256 blocks, all
    4 layers deep. `reorder` runs every sum in another order (a permuted reduction axis): the same step, other
    roundings. `fault` = (name, size) moves one element of that tensor by size * max|tensor|."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((DEEP_TOKENS, DEEP_HIDDEN)).astype(np.float32)
    ws = [(rng.standard_normal((DEEP_HIDDEN, DEEP_HIDDEN)) / np.sqrt(DEEP_HIDDEN)).astype(np.float32)
          for _ in range(DEEP_LAYERS)]
    orders = np.random.default_rng(1)

    def matmul(a, b):
        p = orders.permutation(a.shape[1]) if reorder else slice(None)
        return a[:, p] @ b[p]
    hs = [x]
    for w in ws:
        hs.append(np.tanh(matmul(hs[-1], w)))
    squares = (hs[-1] ** 2).ravel()
    loss = np.mean(squares[orders.permutation(squares.size)] if reorder else squares, dtype=np.float32)
    dh, grads = 2 * hs[-1] / np.float32(squares.size), [None] * DEEP_LAYERS
    for i in reversed(range(DEEP_LAYERS)):
        dz = dh * (1 - hs[i + 1] ** 2)
        grads[i] = matmul(hs[i].T, dz)
        dh = matmul(dz, ws[i].T)
    width = DEEP_HIDDEN // blocks
    parts = [(f"layers.{i}.experts.{j}", i, grads[i][:, j * width:(j + 1) * width])
             for i in range(DEEP_LAYERS) for j in range(blocks)]
    records = [TensorRecord(f"layers.{i}.out", "forward", h, i, "layer", k=DEEP_HIDDEN, dims="th")
               for i, h in enumerate(hs[1:])]
    records.append(TensorRecord("loss", "loss", np.array(loss), None, "mse", k=squares.size))
    records += [TensorRecord(f"grad.{n}", "grad", g, i, "grad", k=DEEP_TOKENS) for n, i, g in parts]
    records += [TensorRecord(f"{state}.{n}", "optimizer", g * np.float32(0.1) if state == "exp_avg" else
                             g * g * np.float32(0.05), i, state, k=1)
                for state in ("exp_avg", "exp_avg_sq") for n, i, g in parts]
    if fault:
        name, size = fault
        records = [TensorRecord(r.name, r.kind, _moved(r.value, size) if r.name == name else r.value, r.layer,
                                r.operator, r.k, r.dims) for r in records]
    return records


def _moved(value, size):
    out = np.array(value, np.float32)
    out.flat[0] += np.float32(size * np.max(np.abs(out)))
    return out


DEEP_META = {"model_config_hash": "deep"}


@pytest.fixture(scope="module")
def deep_reference(tmp_path_factory):
    return dump(tmp_path_factory.mktemp("deep") / "a", deep_step(), DEEP_META)


def test_reordered_sums_of_a_deep_many_tensor_run_agree(deep_reference, tmp_path):
    report = compare_runs(deep_reference, dump(tmp_path / "b", deep_step(reorder=True), DEEP_META))
    assert report.first is None
    assert all(r.max_rel_error > 0 for r in report.rows if r.entry.kind == "forward")  # the sums did change


@pytest.mark.parametrize("fault", [("grad.layers.0.experts.0", 3e-3),             # the last gradient walked
                                   ("exp_avg_sq.layers.3.experts.255", 5e-3)])   # the last tensor walked
def test_a_small_fault_late_in_a_many_tensor_run_is_caught(deep_reference, tmp_path, fault):
    """Before tolerances followed the computation, the 3000 tensors walked before these gave them a chain of
    4.5e-3 and 6.4e-3: a fault of a few 1e-3 in one expert's gradient or moment went unseen."""
    report = compare_runs(deep_reference, dump(tmp_path / "b", deep_step(reorder=True, fault=fault), DEEP_META))
    assert report.first is not None and report.first.entry.name == fault[0]
    assert report.first.max_rel_error > 10 * report.first.rtol


def test_tolerance_follows_depth_not_the_tensor_count(tmp_path):
    def rtols(blocks):
        root = dump(tmp_path / str(blocks), deep_step(blocks), DEEP_META)
        return {r.entry.name: r.rtol for r in compare_runs(root, root).rows}
    few, many = rtols(4), rtols(256)
    for name in ("layers.3.out", "loss", "grad.layers.0.experts.0", "exp_avg_sq.layers.3.experts.3"):
        assert few[name] == many[name], name
    # deeper forward outputs and gradients further down the backward get more
    assert many["layers.0.out"] < many["layers.3.out"] < many["loss"]
    assert many["loss"] < many["grad.layers.3.experts.0"] < many["grad.layers.0.experts.0"]


def test_a_few_tokens_of_an_moe_layer_differing_is_a_routing_tie():
    """Found on a real run (tiny, tp=2 x dp=2 against one process, step 30 from the same step-29 weights): layer 2's
    MoE output differed in one token of 1024, whose 4th and 5th expert scores were 3e-8 apart (float32's resolution
    at 0.65 is 6e-8). That is a routing tie; the same change in a dense operator, or in many tokens, is not."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 64, 16))
    tol = 1e-5
    b = a * (1 + 1e-7 * rng.uniform(-1, 1, a.shape))
    b[1, 37] = rng.standard_normal(16)                  # one token computed by other experts
    diagnosis = diagnose("layers.2", "forward", "moe", "bsh", a, b, tol, [{"tp": 2, "dp": 2}, {}], False)
    assert diagnosis.risk is Risk.ROUTING_TIE and "(1, 37)" in diagnosis.evidence, diagnosis
    assert diagnose("layers.2", "forward", "mlp", "bsh", a, b, tol, [{"tp": 2}, {}], False).risk \
        is not Risk.ROUTING_TIE
    many = b.copy()
    many[0, :8] = rng.standard_normal((8, 16))          # 9 of 128 tokens: more than a tie moves
    assert diagnose("layers.2", "forward", "moe", "bsh", a, many, tol, [{"tp": 2}, {}], False).risk \
        is not Risk.ROUTING_TIE


def test_a_routing_tie_behind_a_small_concentrated_difference_is_named(tmp_path):
    """Found on a real run (tiny, tp=2 against one process, step 3): two elements of the embedding differed by 2.6
    tolerances (their gradients were ~1e-8, Adam's epsilon, where AdamW's step turns a rounding-level change of the
    gradient into a change of the update), and layer 2's MoE output differed in one whole token by 1,430 tolerances.
    The first is reported first; the second, beyond ten tolerances, is reported and named too: it is what moved
    the run."""
    def edit(name, a):
        if name == "embed":
            a = a.copy()
            a[0, 3, 5] *= 1 + 3 * tolerance("float32").rtol * 8
        if name in ("layers.1.out", "layers.2.out"):
            a = a.copy()
            a[1, 4] = np.linspace(-1, 1, a.shape[-1])     # one token computed by other experts
        return a
    def moe(records):
        return [dataclasses.replace(r, operator="moe") if r.name == "layers.1.out" else r for r in records]
    a = dump(tmp_path / "a", moe(fake_step()))
    report = compare_runs(a, dump(tmp_path / "b", moe(fake_step(edit=edit)), {**META, "layout": {"tp": 2}}))
    assert report.first.entry.name == "embed" and report.diagnosis.risk is Risk.INCONCLUSIVE, report.diagnosis
    assert report.gross.entry.name == "layers.1.out", report.gross
    assert report.gross_diagnosis.risk is Risk.ROUTING_TIE and "(1, 4)" in report.gross_diagnosis.evidence
    clean = compare_runs(a, dump(tmp_path / "c", moe(fake_step(edit=lambda n, x: edit(n, x) if n == "embed" else x))))
    assert clean.first.entry.name == "embed" and clean.gross is None
