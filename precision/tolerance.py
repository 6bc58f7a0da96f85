"""Tolerances as a function of dtype and the accumulation count K inside an operator.

The derivation and its empirical check are in precision/TOLERANCES.md; in short, for an output that passes
through one operator whose outputs each accumulate K terms,

    rtol = FLOOR_ULPS * u_io  +  SAFETY * sqrt(K) * u_acc

where u_io is the unit roundoff of the format the operator reads and writes (its output is rounded once, and
short elementwise chains add a few more roundings) and u_acc that of the format it accumulates in. Random-sign
rounding errors of a K-term sum grow like sqrt(K) * u_acc relative to the size of the result; SAFETY covers the
maximum over many outputs and kernels that sum sequentially. Half formats accumulate in float32 by default: the
Ascend cube unit and MindSpore's CPU kernels (measured, TOLERANCES.md) do; pass `accumulate=` for a kernel that
accumulates in its own half format.

Errors are measured norm-relatively, max|a - e| / max|e|, so entries near zero do not blow the ratio up.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np

UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
HALF_FORMATS = ("float16", "bfloat16")
SAFETY = 8.0
FLOOR_ULPS = 8.0


@dataclass(frozen=True)
class Tolerance:
    """rtol bounds the norm-relative error; atol is the same bound for data of unit scale (np.allclose use)."""
    rtol: float
    atol: float


def dtype_name(dtype) -> str:
    """Canonical name ('float32', ...) of a dtype given as a string, NumPy, MindSpore or torch dtype."""
    name = str(dtype).lower().replace("mindspore.", "").replace("torch.", "").replace("<class 'numpy.", "")
    name = name.rstrip("'>")
    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64", "half": "float16",
               "float": "float32", "double": "float64"}
    name = aliases.get(name, name)
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype: expected one of {sorted(UNIT_ROUNDOFF)}, got {dtype!r}")
    return name


def unit_roundoff(dtype) -> float:
    return UNIT_ROUNDOFF[dtype_name(dtype)]


def accumulation_dtype(dtype, accumulate=None) -> str:
    """The format a kernel of `dtype` accumulates in: float32 for half formats unless told otherwise."""
    if accumulate is not None:
        return dtype_name(accumulate)
    name = dtype_name(dtype)
    return "float32" if name in HALF_FORMATS else name


def tolerance(dtype="float32", k: int = 1, accumulate=None) -> Tolerance:
    """rtol/atol for one operator whose outputs each accumulate `k` terms, reading and writing `dtype`."""
    if k < 1:
        raise ValueError(f"k: expected a positive accumulation count, got {k}")
    u_io = unit_roundoff(dtype)
    u_acc = unit_roundoff(accumulation_dtype(dtype, accumulate))
    rtol = FLOOR_ULPS * u_io + SAFETY * math.sqrt(k) * u_acc
    return Tolerance(rtol=rtol, atol=rtol)


def chain_tolerance(dtype="float32", ks: Iterable[int] = (1,), accumulate=None) -> Tolerance:
    """Tolerance of a chain of operators (a layer, a whole step): to first order their relative errors add."""
    total = sum(tolerance(dtype, k, accumulate).rtol for k in ks)
    return Tolerance(rtol=total, atol=total)


def relative_error(actual, expected) -> float:
    """max |a-e| / max |e|: a norm-relative error that does not explode on entries near zero."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise ValueError(f"relative_error: shapes differ, {a.shape} vs {e.shape}")
    if not e.size:
        return 0.0
    scale = max(float(np.max(np.abs(e))), np.finfo(np.float64).tiny)
    return float(np.max(np.abs(a - e))) / scale


def mean_relative_error(actual, expected) -> float:
    """mean |a-e| / mean |e|: the typical error, beside relative_error's worst case."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if not e.size:
        return 0.0
    scale = max(float(np.mean(np.abs(e))), np.finfo(np.float64).tiny)
    return float(np.mean(np.abs(a - e))) / scale


def assert_close(actual, expected, tol: Tolerance, name: str = "tensor") -> None:
    err = relative_error(actual, expected)
    if not err <= tol.rtol:
        raise AssertionError(f"{name}: relative error {err:.3e} exceeds tolerance {tol.rtol:.3e}")


def round_to_bfloat16(x) -> np.ndarray:
    """Values of `x` rounded to bfloat16 (round to nearest even), returned as float32: NumPy has no bfloat16."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def round_to(x, dtype) -> np.ndarray:
    """`x` rounded to `dtype` and returned in float64: the exact inputs a `dtype` kernel sees."""
    name = dtype_name(dtype)
    arr = np.asarray(x, dtype=np.float64)
    if name == "bfloat16":
        return round_to_bfloat16(arr.astype(np.float32)).astype(np.float64)
    return arr.astype(name).astype(np.float64)
