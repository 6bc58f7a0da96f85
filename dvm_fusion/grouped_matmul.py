"""Grouped matmul: rows of `x` sorted by expert, one weight matrix per expert, dropless.

y[rows of group e] = x[rows of group e] @ w[e], with group sizes given at run time. MindSpore's GroupedMatmul has
only an Ascend kernel, so the CPU path is a hand-written kernel (an `ops.Custom` pyfunc over NumPy's BLAS, with its
own backward) and the Ascend path binds MindSpore's `grouped_matmul` (split_item=3, group_type=0, cumulative
group_list). Both compute exactly the useful FLOPs: no padding to a capacity and no dense masking.

`KERNEL_CLOCK` adds up the seconds the CPU kernels spend (forward and both backward GEMMs): a rank's routed expert
compute, measured where it runs, so an expert-parallel run can show which rank its load slows.
"""
from __future__ import annotations

import time

import numpy as np
import mindspore as ms
from mindspore import ops


class KernelClock:
    """Wall seconds inside the CPU grouped-matmul kernels of this process since the last `take()`."""

    def __init__(self):
        self.seconds = 0.0

    def timed(self, kernel):
        # MindSpore's pyfunc kernel counts the function's own arguments: a wrapper of kernel(a, b, c) takes three
        def run(a, b, c):
            start = time.perf_counter()
            try:
                return kernel(a, b, c)
            finally:
                self.seconds += time.perf_counter() - start
        run.__name__, run.__doc__ = kernel.__name__, kernel.__doc__
        return run

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


KERNEL_CLOCK = KernelClock()


def _segments(group_sizes):
    start = 0
    for e, n in enumerate(np.asarray(group_sizes).tolist()):
        yield e, start, start + n
        start += n


def _rows_out(rows: int, cols: int, dtype, group_sizes):
    """The output buffer: rows past the last group (an expert-parallel receive buffer's padding) are zero."""
    out = np.empty((rows, cols), dtype=dtype)
    out[int(np.asarray(group_sizes).sum()):] = 0
    return out


def grouped_matmul_numpy(x, w, group_sizes):
    out = _rows_out(x.shape[0], w.shape[2], x.dtype, group_sizes)
    for e, a, b in _segments(group_sizes):
        if b > a:
            np.matmul(x[a:b], w[e], out=out[a:b])
    return out


def grouped_matmul_dx_numpy(dy, w, group_sizes):
    out = _rows_out(dy.shape[0], w.shape[1], dy.dtype, group_sizes)
    for e, a, b in _segments(group_sizes):
        if b > a:
            np.matmul(dy[a:b], w[e].T, out=out[a:b])
    return out


def grouped_matmul_dw_numpy(x, dy, group_sizes):
    out = np.zeros((len(group_sizes), x.shape[1], dy.shape[1]), dtype=x.dtype)
    for e, a, b in _segments(group_sizes):
        if b > a:
            np.matmul(x[a:b].T, dy[a:b], out=out[e])
    return out


def _same_dtype(*dtypes):
    return dtypes[0]


_gmm_dx = ops.Custom(KERNEL_CLOCK.timed(grouped_matmul_dx_numpy), out_shape=lambda dy, w, g: (dy[0], w[1]),
                     out_dtype=_same_dtype, func_type="pyfunc")
_gmm_dw = ops.Custom(KERNEL_CLOCK.timed(grouped_matmul_dw_numpy), out_shape=lambda x, dy, g: (g[0], x[1], dy[1]),
                     out_dtype=_same_dtype, func_type="pyfunc")


def _gmm_bprop(x, w, group_sizes, out, dout):
    return _gmm_dx(dout, w, group_sizes), _gmm_dw(x, dout, group_sizes), ops.zeros_like(group_sizes)


_gmm_cpu = ops.Custom(KERNEL_CLOCK.timed(grouped_matmul_numpy), out_shape=lambda x, w, g: (x[0], w[2]),
                      out_dtype=_same_dtype, func_type="pyfunc", bprop=_gmm_bprop)


def grouped_matmul_cpu(x, w, group_sizes):
    """x [N, in] sorted by group, w [E, in, out], group_sizes [E] int32 -> [N, out]; rows past sum(group_sizes)
    are padding and come out zero."""
    return _gmm_cpu(x, w, group_sizes)


def grouped_matmul_ascend(x, w, group_sizes):
    """The same contract through MindSpore's Ascend GroupedMatmul (group_list holds cumulative row ends)."""
    group_list = ops.cumsum(group_sizes.astype(ms.int64), 0)
    return ops.auto_generate.grouped_matmul([x], [w], group_list=group_list, split_item=3, group_type=0)[0]


def grouped_matmul_for(device_target: str):
    if device_target == "Ascend":
        return grouped_matmul_ascend
    return grouped_matmul_cpu
