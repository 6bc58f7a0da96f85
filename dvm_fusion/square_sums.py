"""The sum of squares of each of many tensors, for the global gradient norm.

CPU: one `ops.Custom` AOT kernel over all the tensors (kernels/square_sums.cc, built by `native.py`), accumulating
in double; it has no backward (the norm is taken of gradients). Ascend: MindSpore's operators, a square and a sum
per tensor, which DVM fuses. Both return float32 [n]; `tests/test_square_sums.py` checks them against float64.
"""
from __future__ import annotations

from functools import cache

import mindspore as ms
from mindspore import ops

from dvm_fusion.native import each_float32, library


_each = ops.HyperMap()     # not a comprehension: see native.each_float32


@cache
def _kernel():
    return ops.Custom(f"{library('square_sums')}:SquareSums", out_shape=lambda *shapes: (len(shapes),),
                      out_dtype=lambda *dtypes: ms.float32, func_type="aot")


def square_sums_cpu(tensors: tuple):
    """tensors (any shapes) -> float32 [len(tensors)]: sum(t ** 2) of each."""
    return _kernel()(*each_float32(tensors))


def _square_sum(t):
    return ops.sum(ops.square(t))


def square_sums_reference(tensors: tuple):
    return ops.stack(_each(_square_sum, each_float32(tensors)))


def square_sums_for(device_target: str):
    return square_sums_reference if device_target == "Ascend" else square_sums_cpu
