"""The CPU AdamW kernel (dvm_fusion/adamw.py): three steps of parameters of several sizes, updated in place inside a
graph by one call over them all (as the optimizer does), against torch.optim.AdamW's arithmetic in float64
(precision.reference_ops.adamw) with the gradients' factor applied first; with and without weight decay, on one
thread and split over two and three (more than the kernel's 256K elements a thread, split inside a parameter and
across them); a step that is not finite changes nothing; a float16 parameter is refused."""
from __future__ import annotations

import numpy as np
import pytest

from precision import reference_ops as ref
from precision.tolerance import relative_error, tolerance

SHAPES = [(3, 5), (7,), (1,), (512, 1030), (300_001,), (786_433,)]


def _graph_mode():
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE)


def _updater(arrays, threads: int):
    import mindspore as ms
    from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
    from dvm_fusion.adamw import adamw_hyper, adamw_update_cpu

    class Update(nn.Cell):
        def __init__(self):
            super().__init__()
            self.p = ParameterTuple([Parameter(Tensor(a), name=f"p{i}") for i, a in enumerate(arrays)])
            self.m = self.p.clone("m", "zeros")
            self.v = self.p.clone("v", "zeros")
            self.threads = Tensor(threads, ms.float32)

        def construct(self, grads, decays, lr, factor, step, finite):
            beta1, beta2, eps = Tensor(0.9, ms.float32), Tensor(0.95, ms.float32), Tensor(1e-8, ms.float32)
            bc1 = 1.0 - ops.pow(beta1, step)
            root_bc2 = ops.sqrt(1.0 - ops.pow(beta2, step))
            hyper = adamw_hyper(lr, beta1, beta2, eps, factor, bc1, root_bc2, self.threads, finite)
            return adamw_update_cpu(self.p, self.m, self.v, grads, hyper, decays)

    return Update()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_adamw_kernel_matches_torch_arithmetic(threads):
    import mindspore as ms
    from mindspore import Tensor
    _graph_mode()
    rng = np.random.default_rng(threads)
    arrays = [rng.standard_normal(s).astype(np.float32) * 0.02 for s in SHAPES]
    decays = [0.1 if len(s) >= 2 else 0.0 for s in SHAPES]
    update = _updater(arrays, threads)
    params = [a.astype(np.float64) for a in arrays]
    moments = [(np.zeros_like(p), np.zeros_like(p)) for p in params]
    decay_rates = Tensor(np.array(decays, np.float32))
    for step, (lr, factor) in enumerate([(1e-3, 1.0), (3e-3, 0.25), (2e-3, 4.0)], start=1):
        grads = [rng.standard_normal(s).astype(np.float32) * 10.0 ** -(i % 3) for i, s in enumerate(SHAPES)]
        before = [p.asnumpy().copy() for p in update.p]
        state = [t.asnumpy().copy() for t in (*update.p, *update.m, *update.v)]
        args = (tuple(Tensor(g) for g in grads), decay_rates, Tensor(lr, ms.float32), Tensor(factor, ms.float32),
                Tensor(step, ms.float32))
        skipped = update(*args, Tensor(False))                 # not finite: nothing moves
        assert float(skipped.asnumpy()[0]) == 0.0
        assert all(np.array_equal(t.asnumpy(), b) for t, b in zip((*update.p, *update.m, *update.v), state))
        assert float(update(*args, Tensor(True)).asnumpy()[0]) == 0.0
        for i, (g, decay) in enumerate(zip(grads, decays)):
            p, m, v = ref.adamw(before[i].astype(np.float64), g.astype(np.float64) * factor, *moments[i], lr=lr,
                                beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=decay, step=step)
            moments[i] = (m, v)
            got_m, got_v = update.m[i].asnumpy(), update.v[i].asnumpy()
            assert relative_error(got_m, m) <= 4 * tolerance("float32").rtol, (i, step)
            assert relative_error(got_v, v) <= 4 * tolerance("float32").rtol, (i, step)
            # the step taken against the expected one: exact up to the rounding of the stored parameter
            moved, expected = update.p[i].asnumpy() - before[i], p - before[i]
            scale = float(np.abs(before[i]).max())
            err = relative_error(moved, expected)
            assert err <= 4 * tolerance("float32").rtol * max(1.0, scale / lr), (i, step, err)
            assert np.count_nonzero(moved) > 0.99 * moved.size     # every element written, by whichever thread


def test_adamw_kernel_refuses_a_half_precision_parameter():
    import mindspore as ms
    from mindspore import Tensor
    _graph_mode()
    update = _updater([np.ones(8, np.float16)], 1)
    with pytest.raises(RuntimeError, match="function\\(AdamW\\) is 1"):
        update((Tensor(np.ones(8, np.float32)),), Tensor(np.zeros(1, np.float32)), Tensor(1e-3, ms.float32),
               Tensor(1.0, ms.float32), Tensor(1.0, ms.float32), Tensor(True)).asnumpy()
