"""Empirical check of the tolerance model: K-term dot products summed sequentially in an emulated format.

Sequential (left-to-right) summation is the worst ordinary kernel: blocked and pairwise sums, which MindSpore's
CPU kernels and Ascend's cube unit use, have smaller errors. So if sequential sums stay inside
`tolerance(io, K, accumulate)`, real kernels do too. Products of two half-format numbers are exact in float32
(11+11 and 8+8 significant bits fit in 24), so a half kernel with a float32 accumulator only rounds the sum.

    python -m precision.summation_error            # the table quoted in precision/TOLERANCES.md
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from oneline import OneLineParser
from precision.tolerance import dtype_name, round_to, tolerance

DATA_KINDS = ("signed", "positive")


@dataclass(frozen=True)
class SummationResult:
    io: str
    accumulate: str
    k: int
    data: str
    max_rel_error: float
    rtol: float

    @property
    def ratio(self) -> float:
        return self.max_rel_error / self.rtol


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    return x if dtype == "float64" else round_to(x, dtype)


def sequential_dot_error(io, accumulate, k: int, outputs: int = 256, data: str = "signed",
                         seed: int = 0) -> SummationResult:
    """Max norm-relative error of `outputs` K-term dot products, inputs in `io`, summed left to right in
    `accumulate`, result rounded to `io`; reference in float64 from the same rounded inputs."""
    io, accumulate = dtype_name(io), dtype_name(accumulate)
    if data not in DATA_KINDS:
        raise ValueError(f"data: expected one of {DATA_KINDS}, got {data!r}")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((outputs, k))
    w = rng.standard_normal((outputs, k))
    if data == "positive":  # a sum of squares, as in RMSNorm: partial sums grow linearly
        x, w = np.abs(x), np.abs(x)
    x, w = _round(x, io), _round(w, io)
    products = x * w
    if io == "float32":  # float32 products round once; half products are exact in float32 and wider
        products = _round(products, "float32")
    exact = np.sum(x * w, axis=1)
    acc = np.zeros(outputs)
    for j in range(k):
        acc = _round(acc + products[:, j], accumulate)
    result = _round(acc, io)
    err = float(np.max(np.abs(result - exact)) / np.max(np.abs(exact)))
    return SummationResult(io, accumulate, k, data, err, tolerance(io, k, accumulate).rtol)


CASES = (("float32", "float32"), ("float16", "float32"), ("bfloat16", "float32"),
         ("float16", "float16"), ("bfloat16", "bfloat16"))


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m precision.summation_error", description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[16, 256, 4096])
    parser.add_argument("--outputs", type=int, default=256)
    args = parser.parse_args(argv)
    if any(k < 1 for k in args.k) or args.outputs < 1:
        print("--k/--outputs: expected positive integers", file=sys.stderr)
        return 2
    print(f"{'io':>9} {'accumulate':>10} {'K':>6} {'data':>8} {'max rel err':>12} {'rtol':>10} {'err/rtol':>9}")
    worst = 0.0
    for io, acc in CASES:
        for k in args.k:
            for data in DATA_KINDS:
                r = sequential_dot_error(io, acc, k, args.outputs, data)
                worst = max(worst, r.ratio)
                print(f"{io:>9} {acc:>10} {k:>6} {data:>8} {r.max_rel_error:12.3e} {r.rtol:10.3e} {r.ratio:9.3f}")
    print(f"worst err/rtol: {worst:.3f} ({'inside' if worst <= 1 else 'OUTSIDE'} the tolerance model)")
    return 0 if worst <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
