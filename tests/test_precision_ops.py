"""Operator checker: the table passes for fp32 and fp16, broken operators fail, the CLI behaves; the float64
references are checked against their defining properties and an independent YaRN implementation."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

from precision import ms_ops, op_check
from precision import reference_ops as ref
from precision.tolerance import assert_close, tolerance

ROOT = Path(__file__).resolve().parents[1]
ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_every_operator_passes(dtype):
    results = op_check.check_all(list(op_check.REGISTRY), [dtype])
    assert {r.op for r in results} >= {"matmul", "rmsnorm", "rope_yarn", "mla_attention", "softmax", "router",
                                       "dispatch_combine", "swiglu_ffn", "cross_entropy", "adamw"}
    bad = [op_check.format_row(r) for r in results if r.status != "pass"]
    assert not bad, "\n".join(bad)
    assert all(0 <= r.max_rel_error <= r.rtol for r in results)


def test_graph_mode_passes():
    results = op_check.check_all(["rmsnorm", "mla_attention", "router"], ["float32"], mode="graph")
    assert [r.status for r in results] == ["pass"] * len(results)


@pytest.mark.skipif(ms.get_context("device_target") != "CPU", reason="bf16 availability is a CPU-backend fact")
def test_bfloat16_without_cpu_kernels_is_reported_not_faked():
    matmul = op_check.check_case(op_check.REGISTRY["matmul"], "bf16")
    assert all(r.status == "not runnable" and "MatMul" in r.note for r in matmul)
    assert not any(r.failed for r in matmul)
    # operators that only cast bf16 and compute in float32 do run, and are measured for real
    norm = op_check.check_case(op_check.REGISTRY["rmsnorm"], "bf16")
    assert all(r.status == "pass" and r.max_rel_error > tolerance("float32").rtol for r in norm)


def _matmul_through_half(x, w):
    return ops.matmul(x.astype(ms.float16), w.astype(ms.float16)).astype(x.dtype)


def _router_in_half(x, weight, bias):
    return ms_ops.make_router(op_check.ROUTER_TOP_K, op_check.ROUTED_SCALING)(
        x.astype(ms.float16).astype(ms.float32), weight.astype(ms.float16).astype(ms.float32), bias)


def _rope_with_wrong_sign(x, cos, sin):
    return ms_ops.apply_rope(x, cos, -sin)


def _adamw_without_bias_correction(param, grad, exp_avg, exp_avg_sq):
    config = dict(op_check.ADAMW_CONFIG, step=1)
    return ms_ops.make_adamw(**config)(param, grad, exp_avg, exp_avg_sq)


@pytest.mark.parametrize("name,broken,dtype", [
    ("matmul", _matmul_through_half, "float32"),
    ("router", _router_in_half, "float16"),
    ("rope_yarn", _rope_with_wrong_sign, "float32"),
    ("adamw", _adamw_without_bias_correction, "float32"),
])
def test_broken_operator_fails(name, broken, dtype):
    case = dataclasses.replace(op_check.REGISTRY[name], mindspore_fn=broken)
    results = op_check.check_case(case, dtype)
    assert all(r.status == "FAIL" and r.max_rel_error > r.rtol for r in results)


def test_cli_table_and_exit_codes(monkeypatch):
    proc = subprocess.run([sys.executable, "-m", "precision.op_check", "--ops", "softmax,matmul", "--dtype", "fp32",
                           "bf16"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["operator", "dtype"]
    assert sum(line.endswith(" pass") for line in lines) == 6 and "failed" in lines[-1]
    # a failing operator makes the command fail
    monkeypatch.setitem(op_check.REGISTRY, "matmul",
                        dataclasses.replace(op_check.REGISTRY["matmul"], mindspore_fn=_matmul_through_half))
    assert op_check.main(["--ops", "matmul", "--dtype", "fp32"]) == 1


@pytest.mark.parametrize("args,field", [(["--ops", "matmull"], "--ops"), (["--dtype", "fp8"], "--dtype"),
                                        (["--dtype", "fp64"], "--dtype")])
def test_cli_bad_arguments(args, field):
    proc = subprocess.run([sys.executable, "-m", "precision.op_check", *args], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and field in proc.stderr and "Traceback" not in proc.stderr


# ---- the references themselves -------------------------------------------------------------------------
def test_rope_is_a_rotation_with_relative_positions():
    rng = np.random.default_rng(0)
    inv_freq = ref.yarn_inv_freq(32, factor=8.0, original_max_position=64)
    q, k = rng.standard_normal((1, 1, 1, 32)), rng.standard_normal((1, 1, 1, 32))
    for interleaved in (False, True):
        def at(x, p):
            cos, sin = ref.rope_tables(np.array([p]), inv_freq, interleaved=interleaved)
            return ref.apply_rope(x, cos, sin, interleaved)
        assert_close(np.linalg.norm(at(q, 37)), np.linalg.norm(q), tolerance("float64", 32))
        assert_close(np.sum(at(q, 10) * at(k, 3)), np.sum(at(q, 107) * at(k, 100)), tolerance("float64", 32))


def test_yarn_matches_transformers():
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    config = SimpleNamespace(rope_theta=10000.0, head_dim=64, hidden_size=256, num_attention_heads=4,
                             max_position_embeddings=163840, rope_scaling=scaling, partial_rotary_factor=1.0)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    ours = ref.yarn_inv_freq(64, 10000.0, 40.0, 4096, 32.0, 1.0)
    np.testing.assert_allclose(ours, inv_freq.double().numpy(), rtol=tolerance("float32").rtol)
    assert_close(attention_factor, ref.yarn_mscale(40.0, 1.0) / ref.yarn_mscale(40.0, 1.0), tolerance("float64"))
    assert not np.allclose(ours, ref.yarn_inv_freq(64))  # the scaling does something


def test_router_and_dispatch_references():
    rng = np.random.default_rng(1)
    x, w, bias = rng.standard_normal((20, 8)), rng.standard_normal((6, 8)), np.zeros(6)
    indices, weights = ref.router_topk(x, w, bias, 3, 2.5)
    assert_close(weights.sum(-1), np.full(20, 2.5), tolerance("float64", 3))
    scores = ref.sigmoid(x @ w.T)
    assert np.all(np.take_along_axis(scores, indices, -1).min(-1) >= np.sort(scores, -1)[:, -3])
    # a large bias on one expert forces its selection but does not change the weights' formula
    biased, _ = ref.router_topk(x, w, np.array([0, 0, 0, 0, 0, 10.0]), 3, 2.5)
    assert np.all(biased[:, 0] == 5)
    scale = rng.standard_normal((6, 8))
    loop = np.array([sum(weights[t, j] * x[t] * scale[indices[t, j]] for j in range(3)) for t in range(20)])
    assert_close(ref.dispatch_combine(x, indices, weights, scale), loop, tolerance("float64", 3))


def test_adamw_reference_against_a_written_out_step():
    p, g, m, v = 0.5, 0.1, 0.02, 0.001
    out = ref.adamw(np.array(p), np.array(g), np.array(m), np.array(v), lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8,
                    weight_decay=0.1, step=2)
    m1, v1 = 0.9 * m + 0.1 * g, 0.99 * v + 0.01 * g * g
    expected = p * (1 - 0.001) - 0.01 * (m1 / (1 - 0.81)) / (np.sqrt(v1 / (1 - 0.99 ** 2)) + 1e-8)
    assert_close(np.array(out), np.array([expected, m1, v1]), tolerance("float64", 2))


def test_attention_reference_is_causal():
    rng = np.random.default_rng(2)
    args = [rng.standard_normal(s) for s in ((1, 5, 2, 4), (1, 5, 2, 2), (1, 5, 2, 4), (1, 5, 2), (1, 5, 2, 3))]
    out = ref.mla_attention(*args, scale=0.4)
    changed = [a.copy() for a in args]
    for a in changed[2:]:
        a[:, 3:] += 1.0  # perturb keys and values of the last two positions
    assert_close(ref.mla_attention(*changed, scale=0.4)[:, :3], out[:, :3], tolerance("float64", 5))
    assert_close(out[:, 0], args[4][:, 0], tolerance("float64", 5))  # the first token sees only itself
