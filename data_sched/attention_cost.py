"""The per-sample cost model t = a * sum(l_i^2) + b * sum(l_i) + c, its least-squares fit, and its calibration file.

l_i are the lengths of the document pieces of a sample: attention work grows with each piece's square (a
per-document mask, FlashAttention's actual_seq_len), everything else with the token count. The coefficients are
fitted from measured forward+backward times; a calibration file (JSON) holds them for the recipe to name.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from scipy.optimize import nnls

from data_sched.errors import DataError


@dataclass(frozen=True)
class CostModel:
    a: float            # per squared document length
    b: float            # per token
    c: float = 0.0      # per sample
    r2: float = float("nan")   # coefficient of determination of the fit that produced it
    num_points: int = 0
    source: str = ""    # what was measured (model, device, lengths), for people reading the file

    def sample_costs(self, doc_lens: Sequence[np.ndarray]) -> np.ndarray:
        """Modelled cost of each sample from its document lengths."""
        sq, tok = length_moments(doc_lens)
        return self.a * sq + self.b * tok + self.c

    def save(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: str) -> "CostModel":
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise DataError(f"{path}: attention cost calibration file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError, IsADirectoryError):
            raise DataError(f"{path}: expected a JSON attention cost calibration file") from None
        if not isinstance(doc, dict):
            raise DataError(f"{path}: expected a JSON object with fields a, b, c")
        for key in ("a", "b"):
            if not isinstance(doc.get(key), (int, float)) or doc[key] < 0:
                raise DataError(f"{path}: field {key!r} must be a non-negative number, got {doc.get(key)!r}")
        known = {k: doc[k] for k in ("a", "b", "c", "r2", "num_points", "source") if k in doc}
        return cls(**known)

    @classmethod
    def from_flops_per_token(cls, flops_per_token: Callable[[int], float], length: int,
                             source: str = "") -> "CostModel":
        """Analytic model from training FLOPs per token at a given attention length (linear in the length).

        A document of length l costs l * f(l) = b*l + a*l^2 where f(L) = b + a*L is the per-token cost at
        context L; two evaluations give a and b. Time is FLOPs here: ratios are what balancing needs.
        """
        f1, f2 = float(flops_per_token(length)), float(flops_per_token(2 * length))
        a = (f2 - f1) / length
        return cls(a=a, b=f1 - a * length, c=0.0, source=source or "analytic FLOPs")


def length_moments(doc_lens: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(sum of squared lengths, sum of lengths) per sample, float64."""
    sq = np.array([float(np.dot(l, l)) for l in (np.asarray(x, dtype=np.float64) for x in doc_lens)])
    tok = np.array([float(np.sum(x)) for x in doc_lens])
    return sq, tok


def fit_attention_cost(doc_lens: Sequence[np.ndarray], times: Sequence[float], source: str = "") -> CostModel:
    """Least-squares fit of t = a*sum(l^2) + b*sum(l) + c with a, b, c >= 0 (time cannot fall with work).

    The design needs samples of different token counts as well as different length mixes; with one token
    count b and c cannot be told apart, so the fit refuses (ValueError) rather than invent a split.
    """
    sq, tok = length_moments(doc_lens)
    t = np.asarray(times, dtype=np.float64)
    if len(t) != len(sq) or len(t) < 3:
        raise ValueError(f"fit_attention_cost: need >= 3 measurements with lengths, got {len(t)} / {len(sq)}")
    design = np.stack([sq, tok, np.ones_like(sq)], axis=1)
    if np.linalg.matrix_rank(design) < 3:
        raise ValueError("fit_attention_cost: measurements must vary both the token count and the document mix")
    # Columns differ by many orders of magnitude (l^2 vs 1): scale them so NNLS is well conditioned.
    scale = np.abs(design).max(axis=0)
    coef, _ = nnls(design / scale, t)
    coef = coef / scale
    pred = design @ coef
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")
    return CostModel(a=float(coef[0]), b=float(coef[1]), c=float(coef[2]), r2=r2, num_points=len(t), source=source)
