"""precision/envelope.py: the rounding envelope of a run, and bench.layout_agreement's --control."""
import pytest

from bench.layout_agreement import main
from precision.envelope import rounding_envelope


def test_the_envelope_is_the_chain_tolerance_plus_the_controls_worst_error_so_far():
    reference = {1: 10.0, 2: 9.0, 3: 8.0, 4: 7.0}
    chain = {1: 1e-6, 2: 2e-6, 3: 3e-6, 4: 4e-6}
    # the first control agrees to rounding, then parts at step 3 and comes back near the reference at step 4; the
    # second parts later
    controls = [{1: 10.0, 2: 9.0 * (1 + 1e-7), 3: 8.0 * (1 + 1e-3), 4: 7.0 * (1 + 1e-5)},
                {1: 10.0, 2: 9.0, 3: 8.0, 4: 7.0 * (1 - 2e-4)}]
    envelope = rounding_envelope(reference, controls, chain)
    assert envelope[1] == chain[1]                                       # the controls equal: the chain tolerance
    assert envelope[2] == pytest.approx(chain[2] + 1e-7)                 # rounding level: within twice of it
    # the worst error of any control so far, plus the rounding a layout may add to the control it follows
    assert envelope[3] == pytest.approx(1e-3 + chain[3]) and envelope[4] == pytest.approx(1e-3 + chain[4])
    assert rounding_envelope(reference, [], chain) == chain


def test_a_control_must_be_one_process(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--layout", "cp2", "--control", "dp2"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stop.value.code == 2 and len(err) == 1 and "--control" in err[0], err
