"""Error signatures: from the first diverging tensor of two runs, infer which parallel risk it points to.

Two things decide: the two runs' layouts and the pattern of the difference. A parallel category whose dimension
is 1 in both runs (`parallel_dims`) is never named, whatever the operator is called. Each signature is a pure
NumPy test on the two tensors (and, for data parallelism, the same tensor on other ranks); `diagnose` tries them
from the most specific to the least and says what it saw:

    drift             within NUMERIC_FACTOR tolerances and spread over many elements (a concentrated change
                      of the same size, or one number, is not what rounding does: inconclusive)
    rank disagreement data-parallel replicas hold different gradients: the all-reduce did not run
    exact factor      b == alpha * a on at least FACTOR_ELEMENTS elements that agree on alpha; alpha matching a
                      degree of either layout names the dimension (TP degree: TP scaling; micro-batch count: PP
                      accumulation; DP degree: DP averaging), another alpha is a scaling no degree explains
    routing tie       an MoE layer's output differs in a few whole tokens only (at most TIE_SHARE of them), the
                      others agreeing: those tokens chose other experts. A token whose k-th and (k+1)-th expert
                      scores lie within rounding of each other flips on any change of summation order (tensor
                      parallelism changes the forward's sums), so this is not a fault by itself
    sequence shard    the error sits in one contiguous block of sequence positions of a run that shards the
                      sequence: a shard's position offset
    permutation       the same values in another order, in a run with expert parallelism (EP)
    operator          what the operator's name implies, among the dimensions the layouts leave possible
    inconclusive      everything else: the evidence says what was seen and which dimensions were possible
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
    ROUTING_TIE = "MoE routing tie: a few tokens chose another expert, their scores tied within rounding"
    SCALE = "scaling by a factor no parallel degree explains"
    NUMERIC = "numerical drift (reduction order, dtype), not a logic fault"
    INCONCLUSIVE = "inconclusive: neither the layouts nor the pattern of the difference single out a cause"


@dataclass(frozen=True)
class Diagnosis:
    risk: Risk
    evidence: str


# Errors within NUMERIC_FACTOR tolerances can be drift, not a broken path, when they are spread as drift is
# (DRIFT_ELEMENTS below). Rounding alone stays under one tolerance unless the accumulation counts it was given
# understate the sums really done; the error grows like sqrt(K), so 10 tolerances is what rounding gives when the
# true K is 100 times the declared one (a weight gradient summed over thousands of tokens, dumped with the
# weight's last dimension as its k). The smallest logic fault, a factor 1/degree with degree >= 2, is a relative
# error of 0.5: above 10 chain tolerances even in bfloat16.
NUMERIC_FACTOR = 10.0
# What a signature leaves unexplained (the residual of a factor, the error outside a block, the difference of
# sorted values) must be drift, bounded as drift is.
SIGNATURE_FACTOR = NUMERIC_FACTOR
# Drift changes most elements a little: at least DRIFT_ELEMENTS elements, and DRIFT_SHARE of those not zero in
# both runs, must carry a difference of at least SPREAD_RATIO times the largest one. One element (or a handful
# among thousands) moved by the same amount is a change to that element, which rounding does not make.
DRIFT_ELEMENTS, DRIFT_SHARE, SPREAD_RATIO = 4, 0.01, 0.1
# b = alpha * a names a factor only when this many elements of a (of at least SPREAD_RATIO times its largest
# magnitude) agree on it: one pair of numbers fits any factor, and a second agrees with it by chance too easily.
FACTOR_ELEMENTS = 4
# A routing tie changes whole tokens, and few: at most this share of a micro-batch's tokens (at least one).
TIE_SHARE = 0.01
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


def tied_tokens(a: np.ndarray, b: np.ndarray, dims: str, tol: float) -> list[tuple[int, ...]] | None:
    """The token positions whose hidden vectors differ beyond SIGNATURE_FACTOR tolerances when they are at most
    TIE_SHARE of the tokens and every other token agrees within them; None otherwise (or without an h axis)."""
    if "h" not in dims or a.ndim != len(dims):
        return None
    h = dims.index("h")
    a2, b2 = np.moveaxis(a.astype(np.float64), h, -1), np.moveaxis(b.astype(np.float64), h, -1)
    scale = max(float(np.linalg.norm(a2, axis=-1).max()), np.finfo(np.float64).tiny)
    per_token = np.linalg.norm(b2 - a2, axis=-1) / scale
    off = per_token > SIGNATURE_FACTOR * tol
    n = int(off.sum())
    if n == 0 or n > max(1, TIE_SHARE * off.size):
        return None
    return [tuple(int(i) for i in pos) for pos in np.argwhere(off)]


def spread_elements(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """(elements whose difference is at least SPREAD_RATIO times the largest difference, elements not zero in
    both runs): how widely the difference is spread."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    diff = np.abs(b64 - a64)
    live = int(np.count_nonzero((a64 != 0) | (b64 != 0)))
    top = float(diff.max()) if diff.size else 0.0
    return (int(np.count_nonzero(diff >= SPREAD_RATIO * top)) if top > 0 else 0), live


def looks_like_drift(a: np.ndarray, b: np.ndarray) -> tuple[bool, str]:
    """Whether the difference is spread as rounding spreads it, and what was seen."""
    spread, live = spread_elements(a, b)
    enough = spread >= max(DRIFT_ELEMENTS, DRIFT_SHARE * live)
    return enough, f"the difference sits in {spread} of {live} nonzero elements (those within " \
                   f"{1 / SPREAD_RATIO:g}x of its largest)"


def factor_elements(a: np.ndarray) -> int:
    """How many elements of `a` pin a factor b = alpha * a: those of at least SPREAD_RATIO times its largest
    magnitude (smaller ones agree with any factor to within the tolerance)."""
    mag = np.abs(a.astype(np.float64)).ravel()
    return int(np.count_nonzero(mag >= SPREAD_RATIO * mag.max())) if mag.size and mag.max() > 0 else 0


def parallel_dims(layouts: Sequence[Mapping]) -> dict[Risk, str]:
    """The parallel categories that either run's layout makes possible, each with the degrees that do ('tp=2');
    a category whose dimension is 1 in both runs cannot be the cause. A missing degree is 1."""
    def degree(layout, key):
        value = layout.get(key, 1)
        return value if isinstance(value, int) and not isinstance(value, bool) else 1
    found: dict[Risk, list[str]] = {}
    for layout in layouts:
        for risk, keys in ((Risk.DP, ("dp",)), (Risk.TP, ("tp",)), (Risk.PP, ("pp", "micro_batch_num")),
                           (Risk.EP, ("ep",)), (Risk.SP, ("cp",))):
            for key in keys:
                if degree(layout, key) > 1:
                    found.setdefault(risk, []).append(f"{key}={degree(layout, key)}")
        if layout.get("sp") and degree(layout, "tp") > 1:
            found.setdefault(Risk.SP, []).append(f"sp over tp={degree(layout, 'tp')}")
    return {risk: ", ".join(dict.fromkeys(texts)) for risk, texts in found.items()}


def _possible_text(dims: Mapping[Risk, str]) -> str:
    if not dims:
        return "every parallel degree is 1 in both runs, so no parallel dimension can be the cause"
    return "parallel dimensions of either run: " + "; ".join(f"{r.name} ({t})" for r, t in dims.items())


def _has(words: Sequence[str], *texts: str) -> bool:
    return any(w in t.lower() for w in words for t in texts)


def diagnose(name: str, kind: str, operator: str, dims: str, a: np.ndarray, b: np.ndarray, tol: float,
             layouts: Sequence[Mapping], forward_clean: bool,
             replicas_b: Mapping[int, np.ndarray] | None = None) -> Diagnosis:
    """Classify the first tensor over tolerance. `a`, `b`: its values in the two runs; `layouts`: the two runs'
    layouts (precision.dump.layout_meta); `forward_clean`: every forward tensor and the loss agreed;
    `replicas_b`: rank -> value of this tensor on run B's other data-parallel ranks."""
    err = relative_error(b, a)
    norm_ratio = float(np.linalg.norm(b)) / max(float(np.linalg.norm(a)), np.finfo(np.float64).tiny)
    alpha, residual = best_scale(a, b)
    facts = f"rel err {err:.3g} = {err / tol:.3g} x tolerance; norm ratio B/A {norm_ratio:.4g}"
    possible = parallel_dims(layouts)
    drift, spread_text = looks_like_drift(a, b)

    def inconclusive(seen: str) -> Diagnosis:
        return Diagnosis(Risk.INCONCLUSIVE, f"{facts}; {seen}; {_possible_text(possible)}")

    if err <= NUMERIC_FACTOR * tol:
        if drift:
            return Diagnosis(Risk.NUMERIC, f"{facts}; within {NUMERIC_FACTOR:g} tolerances and spread ("
                                           f"{spread_text}): reduction order or precision, not a missing or wrong "
                                           f"parallel step")
        return inconclusive(f"within {NUMERIC_FACTOR:g} tolerances but concentrated ({spread_text}), which "
                            f"rounding does not do: look at what produced this tensor")

    if kind == "grad" and replicas_b and Risk.DP in possible:
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
        pinning = factor_elements(a)
        matched = match_degree(a, b, layouts, kind, tol)
        if pinning < FACTOR_ELEMENTS:
            equals = f" (equal to {matched[1]})" if matched else ""
            return inconclusive(f"B/A = {alpha:.6g}{equals}, but only {pinning} element(s) of A pin it: so few "
                                f"numbers fit any factor (a factor needs {FACTOR_ELEMENTS} agreeing on it)")
        if matched:
            return Diagnosis(matched[0], f"{facts}; B = {alpha:.6g} x A exactly on {pinning} elements (residual "
                                         f"{residual:.2g}), the factor is {matched[1]}")
        return Diagnosis(Risk.SCALE, f"{facts}; B = {alpha:.6g} x A exactly on {pinning} elements (residual "
                                     f"{residual:.2g}), no parallel degree of either run is this factor")

    if kind == "forward" and _has(EP_WORDS, name, operator):
        tokens = tied_tokens(a, b, dims, tol)
        if tokens:
            shown = ", ".join(str(t) for t in tokens[:5]) + (" ..." if len(tokens) > 5 else "")
            return Diagnosis(Risk.ROUTING_TIE, f"{facts}; only {len(tokens)} token(s) differ, at positions "
                                               f"{shown} ({dims.replace('h', '')} indices), every other token "
                                               f"agreeing: they were routed to other experts; compare their "
                                               f"routers' k-th and (k+1)-th scores (a gap within rounding is a "
                                               f"tie, not a fault)")

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
            where = f"the error is confined to sequence positions {first}..{last - 1} of {length}, {shape_note}"
            if Risk.SP not in possible:
                return inconclusive(f"{where}, but neither run shards the sequence")
            return Diagnosis(Risk.SP, f"{facts}; {where}: that shard's positions are offset")

    if is_permutation(a, b, tol):
        seen = "B holds exactly A's values in another order"
        if Risk.EP not in possible:
            return inconclusive(f"{seen}, but neither run has expert parallelism: check what orders this tensor")
        where = "" if _has(EP_WORDS, name, operator) else " (outside a routing operator: check what feeds it)"
        return Diagnosis(Risk.EP, f"{facts}; {seen}: tokens or routing weights were applied in the wrong "
                                  f"order{where}")

    if _has(EP_WORDS, name, operator) and Risk.EP in possible:
        return Diagnosis(Risk.EP, f"{facts}; first divergence in a routing/expert operator while everything "
                                  f"upstream agrees, with {possible[Risk.EP]}")
    if _has(ROPE_WORDS, name, operator) and Risk.SP in possible:
        return Diagnosis(Risk.SP, f"{facts}; first divergence in a rotary-position operator, with "
                                  f"{possible[Risk.SP]}")
    if kind == "grad" and forward_clean and Risk.DP in possible:
        return Diagnosis(Risk.DP, f"{facts}; forward and loss agree but gradients differ with no common factor "
                                  f"(B/A = {alpha:.4g} +- {residual:.2g}), with {possible[Risk.DP]}: gradients "
                                  f"were not reduced as in run A")
    return inconclusive(f"no signature fits ({spread_text}; best factor B/A = {alpha:.4g} +- {residual:.2g})")
