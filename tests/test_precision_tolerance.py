"""The tolerance model: its shape (grows with K, strict for fp32) and its empirical check by emulated summation."""
import math

import numpy as np
import pytest

from precision.summation_error import sequential_dot_error
from precision.tolerance import (FLOOR_ULPS, UNIT_ROUNDOFF, Tolerance, assert_close, chain_tolerance, dtype_name,
                                 mean_relative_error, relative_error, round_to, round_to_bfloat16, tolerance)


def test_fp32_stricter_than_fp16_stricter_than_bf16():
    for k in (1, 64, 4096):
        assert tolerance("fp32", k).rtol < tolerance("fp16", k).rtol < tolerance("bf16", k).rtol


def test_grows_like_sqrt_k_of_the_accumulation_format():
    small, large = tolerance("float32", 16).rtol, tolerance("float32", 16 * 64).rtol
    floor = FLOOR_ULPS * UNIT_ROUNDOFF["float32"]
    assert math.isclose((large - floor) / (small - floor), 8.0)
    # a half format accumulating in float32 barely grows; accumulating in itself grows with its own roundoff
    assert tolerance("fp16", 4096).rtol < 1.02 * tolerance("fp16", 1).rtol
    assert tolerance("fp16", 4096, accumulate="fp16").rtol > 10 * tolerance("fp16", 4096).rtol


def test_chain_adds_and_keeps_public_shape():
    chain = chain_tolerance("float32", (64, 1, 96))
    assert isinstance(chain, Tolerance)
    assert math.isclose(chain.rtol, sum(tolerance("float32", k).rtol for k in (64, 1, 96)))


@pytest.mark.parametrize("bad", ["fp8", "int32", None])
def test_unknown_dtype_names_the_field(bad):
    with pytest.raises(ValueError, match="dtype"):
        tolerance(bad)


def test_dtype_names_from_numpy_and_mindspore():
    import mindspore as ms
    assert dtype_name(np.float16) == "float16" and dtype_name(ms.bfloat16) == "bfloat16"
    assert dtype_name(np.dtype("float32")) == "float32" and dtype_name("half") == "float16"


def test_relative_errors_and_assert_close():
    e = np.array([1.0, -2.0, 4.0, 0.0])
    a = e + np.array([0.0, 0.0, 0.04, 1e-3])
    assert math.isclose(relative_error(a, e), 0.01)
    assert math.isclose(mean_relative_error(a, e), 0.041 / 7.0)
    assert_close(a, e, Tolerance(0.011, 0.011))
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close(a, e, Tolerance(0.009, 0.009), "x")
    with pytest.raises(ValueError, match="shapes"):
        relative_error(a[:2], e)


def test_bfloat16_rounding_matches_mindspore_cast():
    import mindspore as ms
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(20000) * np.exp(rng.uniform(-30, 30, 20000))).astype(np.float32)
    cast = ms.Tensor(x).astype(ms.bfloat16).astype(ms.float32).asnumpy()
    np.testing.assert_array_equal(round_to_bfloat16(x), cast)
    assert np.all(np.abs(round_to(x, "bf16") - x) <= UNIT_ROUNDOFF["bfloat16"] * np.abs(x))


@pytest.mark.parametrize("io,acc", [("float32", "float32"), ("float16", "float32"), ("bfloat16", "float32"),
                                    ("float16", "float16"), ("bfloat16", "bfloat16")])
@pytest.mark.parametrize("data", ["signed", "positive"])
def test_sequential_sums_stay_inside_the_model(io, acc, data):
    """Sequential summation, the worst ordinary kernel, keeps inside the tolerance at K=1024."""
    result = sequential_dot_error(io, acc, 1024, outputs=64, data=data)
    assert result.max_rel_error <= result.rtol


def test_model_is_not_vacuous():
    """A float32 operator that silently went through float16 fails the float32 tolerance."""
    result = sequential_dot_error("float16", "float32", 64, outputs=64)
    assert result.max_rel_error > tolerance("float32", 64).rtol


def test_summation_cli_rejects_bad_k():
    import subprocess
    import sys
    from pathlib import Path
    proc = subprocess.run([sys.executable, "-m", "precision.summation_error", "--k", "0"], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--k" in proc.stderr
