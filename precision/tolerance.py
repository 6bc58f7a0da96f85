"""Tolerances as a function of dtype and the accumulation count K inside an operator.

Rounding errors of a length-K reduction in a format with unit roundoff u are bounded by K*u in the worst case;
with random-sign rounding (the usual case for random data, and what fp32/fp16 kernels show) they grow like
sqrt(K)*u. We use a safety factor over the random-walk estimate and never go below a floor of a few ulps, so
tight formats stay strict and long reductions get the room their arithmetic needs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
SAFETY = 16.0
FLOOR_ULPS = 8.0


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


def _dtype_name(dtype) -> str:
    name = str(dtype).lower().replace("mindspore.", "").replace("torch.", "")
    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64", "half": "float16",
               "float": "float32", "double": "float64"}
    name = aliases.get(name, name)
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype: expected one of {sorted(UNIT_ROUNDOFF)}, got {dtype!r}")
    return name


def tolerance(dtype="float32", k: int = 1) -> Tolerance:
    """rtol/atol for one operator whose outputs each accumulate `k` products in `dtype`."""
    u = UNIT_ROUNDOFF[_dtype_name(dtype)]
    rtol = max(FLOOR_ULPS * u, SAFETY * u * math.sqrt(max(1, k)))
    return Tolerance(rtol=rtol, atol=rtol)


def chain_tolerance(dtype="float32", ks=(1,)) -> Tolerance:
    """Tolerance of a chain of operators (a layer, a whole step): their relative errors add."""
    total = sum(tolerance(dtype, k).rtol for k in ks)
    return Tolerance(rtol=total, atol=total)


def relative_error(actual, expected) -> float:
    """max |a-e| / max |e|: a norm-relative error that does not explode on entries near zero."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    scale = max(float(np.max(np.abs(e))) if e.size else 0.0, np.finfo(np.float64).tiny)
    return float(np.max(np.abs(a - e))) / scale if e.size else 0.0


def assert_close(actual, expected, tol: Tolerance, name: str = "tensor") -> None:
    err = relative_error(actual, expected)
    if not err <= tol.rtol:
        raise AssertionError(f"{name}: relative error {err:.3e} exceeds tolerance {tol.rtol:.3e}")
