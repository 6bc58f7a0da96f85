"""Error signatures: from the first diverging tensor of two runs, infer which parallel risk it points to.

Each signature is a pure NumPy test on the two tensors (and, for data parallelism, the same tensor on other
ranks); `diagnose` tries them from the most specific to the least and says what it saw:

    exact factor      b == alpha * a; alpha matching a degree of either layout names the dimension
                      (TP degree: TP scaling; micro-batch count: PP accumulation; DP degree: DP averaging)
    rank disagreement data-parallel replicas hold different gradients: the all-reduce did not run
    sequence shard    the error sits in one contiguous block of sequence positions: a shard's position offset
    permutation       the same values in another order: tokens or routing weights in the wrong order (EP)
    operator          what the operator's name implies, when the numbers alone do not decide
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Sequence

import numpy as np

from precision.tolerance import relative_error


class Risk(str, Enum):
    DP = "DP: gradient all-reduce missing"
    TP = "TP: loss or partial sums scaled by the TP degree"
    PP = "PP: accumulation order or scaling across micro-batches"
    SP = "SP: position offset in RoPE on a sequence shard"
    EP = "EP: routing or combine weights inconsistent"
    SCALE = "scaling by a factor no parallel degree explains"
    NUMERIC = "numerical drift (reduction order, dtype), not a logic fault"
    UNKNOWN = "unrecognised divergence"


@dataclass(frozen=True)
class Diagnosis:
    risk: Risk
    evidence: str


# Errors within NUMERIC_FACTOR tolerances are drift, not a broken path. Rounding alone stays under one tolerance
# unless the accumulation counts it was given understate the sums really done; the error grows like sqrt(K), so
# 10 tolerances is what rounding gives when the true K is 100 times the declared one (a weight gradient summed
# over thousands of tokens, dumped with the weight's last dimension as its k). The smallest logic fault, a
# factor 1/degree with degree >= 2, is a relative error of 0.5: above 10 chain tolerances even in bfloat16.
NUMERIC_FACTOR = 10.0
# What a signature leaves unexplained (the residual of a factor, the error outside a block, the difference of
# sorted values) must be drift, bounded as drift is.
SIGNATURE_FACTOR = NUMERIC_FACTOR
EP_WORDS = ("moe", "router", "route", "expert", "dispatch", "combine", "permute")
ROPE_WORDS = ("rope", "rotary", "pos")


def best_scale(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(alpha, residual): the least-squares alpha with b ~ alpha * a and the relative error left after it."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    norm = float(a64 @ a64)
    if norm == 0.0:
        return 1.0, relative_error(b64, a64)
    alpha = float(a64 @ b64) / norm
    return alpha, relative_error(b64, alpha * a64)


DEGREE_RISK = {"tp": Risk.TP, "micro_batch_num": Risk.PP, "pp": Risk.PP, "dp": Risk.DP, "ep": Risk.EP,
               "cp": Risk.SP}


def match_degree(a: np.ndarray, b: np.ndarray, layouts: Sequence[Mapping], kind: str,
                 tol: float) -> tuple[Risk, str] | None:
    """The parallel degree d (of either run) with b = d * a or b = a / d up to drift, preferring the dimension
    that scales this kind of tensor first: forward outputs by TP partial sums, gradients by micro-batch
    accumulation."""
    preference = ("tp", "cp", "ep", "micro_batch_num", "dp", "pp") if kind in ("forward", "loss") else \
        ("micro_batch_num", "dp", "tp", "pp", "ep", "cp")
    for key in preference:
        for layout in layouts:
            degree = layout.get(key, 1)
            if isinstance(degree, int) and degree > 1:
                for value, text in ((degree, f"{key}={degree}"), (1.0 / degree, f"1/{key} (1/{degree})")):
                    if relative_error(b, value * a.astype(np.float64)) <= SIGNATURE_FACTOR * tol:
                        return DEGREE_RISK[key], text
    return None


def sequence_block(a: np.ndarray, b: np.ndarray, dims: str, tol: float) -> tuple[int, int, int] | None:
    """(first, last + 1, length) of the one contiguous block of sequence positions that holds the whole
    error, or None when the error is not confined to such a block."""
    if "s" not in dims or a.ndim != len(dims):
        return None
    axis = dims.index("s")
    scale = max(float(np.max(np.abs(a))), np.finfo(np.float64).tiny)
    err = np.moveaxis(np.abs(b.astype(np.float64) - a.astype(np.float64)), axis, 0)
    per_position = err.reshape(err.shape[0], -1).max(axis=1) / scale
    dirty = np.flatnonzero(per_position > SIGNATURE_FACTOR * tol)
    length = per_position.size
    if dirty.size == 0 or dirty.size == length:
        return None
    first, last = int(dirty[0]), int(dirty[-1]) + 1
    outside = np.concatenate([per_position[:first], per_position[last:]])
    if outside.size and outside.max() > SIGNATURE_FACTOR * tol:
        return None
    return first, last, length


def sequence_shards(layouts: Sequence[Mapping]) -> int:
    """How many sequence shards either run cut the sequence into: context parallel, or sequence parallel
    (which shards over the tensor-parallel ranks)."""
    counts = [layout.get("cp", 1) for layout in layouts]
    counts += [layout.get("tp", 1) for layout in layouts if layout.get("sp")]
    return max([c for c in counts if isinstance(c, int)] or [1])


def per_position_norms_equal(a: np.ndarray, b: np.ndarray, dims: str, tol: float) -> bool:
    """True when every (position, head) vector kept its length: a rotation, as a wrong RoPE angle is."""
    axis = dims.index("s")
    a2, b2 = np.moveaxis(a.astype(np.float64), axis, 0), np.moveaxis(b.astype(np.float64), axis, 0)
    return relative_error(np.linalg.norm(b2, axis=-1), np.linalg.norm(a2, axis=-1)) <= SIGNATURE_FACTOR * tol


def is_permutation(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    """True when b holds a's values in another order."""
    return relative_error(np.sort(b.astype(np.float64), axis=None), np.sort(a.astype(np.float64), axis=None)) \
        <= SIGNATURE_FACTOR * tol


def _has(words: Sequence[str], *texts: str) -> bool:
    return any(w in t.lower() for w in words for t in texts)


def diagnose(name: str, kind: str, operator: str, dims: str, a: np.ndarray, b: np.ndarray, tol: float,
             layouts: Sequence[Mapping], forward_clean: bool,
             replicas_b: Mapping[int, np.ndarray] | None = None) -> Diagnosis:
    """Classify the first tensor over tolerance. `a`, `b`: its values in the two runs; `forward_clean`: every
    forward tensor and the loss agreed; `replicas_b`: rank -> value of this tensor on run B's other
    data-parallel ranks."""
    err = relative_error(b, a)
    norm_ratio = float(np.linalg.norm(b)) / max(float(np.linalg.norm(a)), np.finfo(np.float64).tiny)
    alpha, residual = best_scale(a, b)
    facts = f"rel err {err:.3g} = {err / tol:.3g} x tolerance; norm ratio B/A {norm_ratio:.4g}"
    if err <= NUMERIC_FACTOR * tol:
        return Diagnosis(Risk.NUMERIC, f"{facts}; within {NUMERIC_FACTOR:g} tolerances: reduction order or "
                                       f"precision, not a missing or wrong parallel step")

    if kind == "grad" and replicas_b:
        others = {r: v for r, v in replicas_b.items() if v.shape == b.shape}
        spread = max((relative_error(v, b) for v in others.values()), default=0.0)
        if spread > NUMERIC_FACTOR * tol:
            mean = (b.astype(np.float64) + sum(v.astype(np.float64) for v in others.values())) / (1 + len(others))
            mean_err = relative_error(mean, a)
            tail = (f"; their mean matches run A (rel err {mean_err:.3g}): each replica kept its local gradient"
                    if mean_err <= SIGNATURE_FACTOR * tol else "")
            return Diagnosis(Risk.DP, f"{facts}; the {1 + len(others)} data-parallel replicas of run B hold "
                                      f"different gradients (rel spread {spread:.3g}), which an all-reduce would "
                                      f"have made equal{tail}")

    if residual <= SIGNATURE_FACTOR * tol and abs(alpha - 1.0) > NUMERIC_FACTOR * tol:
        matched = match_degree(a, b, layouts, kind, tol)
        if matched:
            return Diagnosis(matched[0], f"{facts}; B = {alpha:.6g} x A exactly (residual {residual:.2g}), "
                                         f"the factor is {matched[1]}")
        return Diagnosis(Risk.SCALE, f"{facts}; B = {alpha:.6g} x A exactly (residual {residual:.2g}), "
                                     f"no parallel degree of either run is this factor")

    block = sequence_block(a, b, dims, tol)
    if block:
        first, last, length = block
        rotation = per_position_norms_equal(a, b, dims, tol)
        shards = sequence_shards(layouts)
        aligned = shards > 1 and length % shards == 0 and first % (length // shards) == 0 and \
            last % (length // shards) == 0
        if rotation or aligned or _has(ROPE_WORDS, name, operator):
            shape_note = ("every vector kept its length (a rotation by a wrong angle)" if rotation
                          else f"exactly whole shards of the {shards} sequence shards" if aligned
                          else "in a rotary-position operator")
            return Diagnosis(Risk.SP, f"{facts}; the error is confined to sequence positions {first}..{last - 1} "
                                      f"of {length}, {shape_note}: that shard's positions are offset")

    if is_permutation(a, b, tol):
        where = "" if _has(EP_WORDS, name, operator) else " (outside a routing operator: check what feeds it)"
        return Diagnosis(Risk.EP, f"{facts}; B holds exactly A's values in another order: tokens or routing "
                                  f"weights were applied in the wrong order{where}")

    if _has(EP_WORDS, name, operator):
        return Diagnosis(Risk.EP, f"{facts}; first divergence in a routing/expert operator while everything "
                                  f"upstream agrees")
    if _has(ROPE_WORDS, name, operator):
        return Diagnosis(Risk.SP, f"{facts}; first divergence in a rotary-position operator")
    if kind == "grad" and forward_clean:
        return Diagnosis(Risk.DP, f"{facts}; forward and loss agree but gradients differ with no common factor "
                                  f"(B/A = {alpha:.4g} +- {residual:.2g}): gradients were not reduced as in run A")
    return Diagnosis(Risk.UNKNOWN, facts)
