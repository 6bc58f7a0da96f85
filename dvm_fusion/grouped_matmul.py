"""Grouped matmul: rows of `x` sorted by expert, one weight matrix per expert, dropless.

y[rows of group e] = x[rows of group e] @ w[e], with group sizes given at run time. MindSpore's GroupedMatmul has
only an Ascend kernel, so the CPU path is a hand-written kernel (`ops.Custom` AOT kernels in
kernels/grouped_matmul.cc: one BLAS GEMM per group on MindSpore's own buffers, with its own backward) and the
Ascend path binds MindSpore's `grouped_matmul` (split_item=3, group_type=0, cumulative group_list). Both compute
exactly the useful FLOPs: no padding to a capacity and no dense masking.

`KERNEL_CLOCK` adds up the seconds the CPU kernels spend (forward and both backward GEMMs): a rank's routed expert
compute, measured where it runs, so an expert-parallel run can show which rank its load slows.
"""
from __future__ import annotations

import ctypes
from functools import cache

import mindspore as ms
from mindspore import ops

from dvm_fusion.native import aot_kernel, library


class KernelClock:
    """Wall seconds inside the CPU grouped-matmul kernels of this process since the last `take()` (the kernels
    count them; the library MindSpore loaded is the one read here, loading a path twice giving one copy)."""

    def take(self) -> float:
        return _clock()() if _cpu_ops.cache_info().currsize else 0.0


KERNEL_CLOCK = KernelClock()


@cache
def _clock():
    take = ctypes.CDLL(str(library("grouped_matmul"))).GroupedMatmulTakeSeconds
    take.restype = ctypes.c_double
    return take


def _same_dtype(*dtypes):
    return dtypes[0]


@cache
def _cpu_ops():
    """The forward kernel with its backward (built on first use, so that an Ascend run never needs g++)."""
    lib = library("grouped_matmul")
    dx = aot_kernel(lib, "GroupedMatmulDx", _same_dtype)
    dw = aot_kernel(lib, "GroupedMatmulDw", _same_dtype)

    def bprop(x, w, group_sizes, out, dout):
        return dx(dout, w, group_sizes), dw(x, dout, group_sizes), ops.zeros_like(group_sizes)

    return aot_kernel(lib, "GroupedMatmul", _same_dtype, bprop)


def grouped_matmul_cpu(x, w, group_sizes):
    """x [N, in] sorted by group, w [E, in, out], group_sizes [E] int32 -> [N, out]; rows past sum(group_sizes)
    are padding and come out zero. The kernels compute in float32: other dtypes are cast to it and the result back
    (float32 accumulation, as Ascend's GroupedMatmul does for half-precision inputs)."""
    if x.dtype == ms.float32:
        return _cpu_ops()(x, w, group_sizes)
    return _cpu_ops()(x.astype(ms.float32), w.astype(ms.float32), group_sizes).astype(x.dtype)


def grouped_matmul_ascend(x, w, group_sizes):
    """The same contract through MindSpore's Ascend GroupedMatmul (group_list holds cumulative row ends)."""
    group_list = ops.cumsum(group_sizes.astype(ms.int64), 0)
    return ops.auto_generate.grouped_matmul([x], [w], group_list=group_list, split_item=3, group_type=0)[0]


def grouped_matmul_for(device_target: str):
    if device_target == "Ascend":
        return grouped_matmul_ascend
    return grouped_matmul_cpu
