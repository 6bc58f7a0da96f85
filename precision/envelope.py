"""The rounding envelope of a training run: how far one process departs from itself when only rounding changes.

`chain_tolerance` over N steps bounds the error of N reordered steps to first order, as if every step passed the
error it was given on unchanged. A run with a discontinuous decision does not: the aux-loss-free balancer moves each
expert's bias by the sign of its integer load's distance from the mean, so when a rounding-level difference tips
one token's top-k choice, a count moves by one, a sign flips and two runs' biases part by twice the update rate; from
then on they route differently and their losses part far beyond any rounding bound. Past such a step a correct
parallel layout (which sums in another order) and a wrong one both fail the chain tolerance.

The envelope measures what rounding alone does to the run instead of assuming it: control runs of one process that
differ from the reference only at rounding level (another attention kernel's summation order; the initial weights
moved by at most one ulp) give, per step, the relative error rounding grew into. A layout that is right differs
from some such run by rounding (the chain tolerance), and that run from the reference by at most the controls'
spread, so the envelope at step k is the chain tolerance plus the largest error of any control at any step up to k
(each control is one sample: another perturbation tips the same decision a step earlier or later, and a difference
in a loss passes through zero while the runs stay apart). While no control departs, the envelope is twice the chain
tolerance at most, so an error that is more than rounding shows there as before.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from precision.tolerance import relative_error


def rounding_envelope(reference: Mapping[int, float], controls: Sequence[Mapping[int, float]],
                      chain: Mapping[int, float]) -> dict[int, float]:
    """{step: envelope} of one logged value (a loss, a gradient norm): `reference` and each control {step: value},
    `chain` {step: the chain tolerance of that many steps}."""
    out, widest = {}, 0.0
    for step in sorted(reference):
        for control in controls:
            widest = max(widest, relative_error(control[step], reference[step]))
        out[step] = chain[step] + widest
    return out
