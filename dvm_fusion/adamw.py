"""AdamW's update on CPU as one kernel: the gradients' scaling, both moments and the decoupled weight decay in a
single pass over any number of parameters, in place (kernels/adamw.cc, built by `native.py`). The optimizer calls
it once over all of them.

`adamw_update_cpu(params, exp_avgs, exp_avg_sqs, grads, hyper, weight_decays)` writes the Parameters and their
moments through their own buffers, as MindSpore's AdamWeightDecay does; the primitive is marked `side_effect_mem`,
so the graph keeps the call although nothing reads its one-element output, and orders it with the graph's other
reads and writes of those Parameters. `hyper` is `adamw_hyper(...)`'s float32 [9]; a step whose `finite` is false
leaves everything as it was, so the training graph needs no branch around it (on CPU a branch splits the graph,
costing milliseconds of host time a step). Ascend keeps MindSpore's AdamWeightDecay (telechat_moe/optim.py
chooses). `tests/test_adamw_kernel.py` checks it against torch.optim.AdamW's arithmetic.

`adamw_slice_update_cpu` is the same update over one rank's slice of a bucket of parameters laid end to end (the
distributed optimizer of parallel/optim, float32 weights: the weights themselves are the master, as in
Megatron-Core, and only the slice's elements are stepped).
"""
from __future__ import annotations

from functools import cache
import os

import mindspore as ms
from mindspore import ops

from dvm_fusion.native import each_float32, library


@cache
def _kernel():
    kernel = ops.Custom(f"{library('adamw')}:AdamW", out_shape=lambda *shapes: (1,),
                        out_dtype=lambda *dtypes: ms.float32, func_type="aot")
    return kernel.add_prim_attr("side_effect_mem", True)


@cache
def _slice_kernel():
    kernel = ops.Custom(f"{library('adamw')}:AdamWSlice", out_shape=lambda *shapes: (1,),
                        out_dtype=lambda *dtypes: ms.float32, func_type="aot")
    return kernel.add_prim_attr("side_effect_mem", True)


def cpu_threads() -> int:
    """The threads a kernel may use: OMP_NUM_THREADS where set (as for the BLAS), else the CPUs this process may
    run on."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else len(os.sched_getaffinity(0))


def adamw_hyper(lr, beta1, beta2, eps, grad_factor, correction1, root_correction2, threads, finite):
    """The kernel's float32 [9] from scalar tensors ([] or [1]): lr, betas, eps, the factor every gradient is
    multiplied by first, 1 - beta1^t, sqrt(1 - beta2^t), threads, and whether to step at all (bool)."""
    return ops.stack([ops.cast(x, ms.float32).reshape(()) for x in
                      (lr, beta1, beta2, eps, grad_factor, correction1, root_correction2, threads, finite)])


def adamw_update_cpu(params, exp_avgs, exp_avg_sqs, grads, hyper, weight_decays):
    """One AdamW step of float32 `params` (a tuple) and their moments in place, all in one kernel call (their
    elements end to end split over the threads); `weight_decays` float32 [n], one rate a parameter. Returns the
    kernel's status ([1], 0)."""
    return _kernel()(*(tuple(params) + tuple(exp_avgs) + tuple(exp_avg_sqs) + each_float32(tuple(grads))
                       + (hyper, weight_decays)))


def adamw_slice_update_cpu(params, exp_avg, exp_avg_sq, grad, hyper, weight_decay, lo):
    """One AdamW step of elements [lo, lo + S) of float32 `params` laid end to end (a bucket of the distributed
    optimizer; the elements past the last parameter are padding, skipped), in place; `exp_avg`, `exp_avg_sq`,
    `grad` float32 [S] (this rank's slice), `weight_decay` float32 [1], `lo` int64 [1]. Returns the status ([1])."""
    return _slice_kernel()(*(tuple(params) + (exp_avg, exp_avg_sq, grad, hyper, weight_decay, lo)))
