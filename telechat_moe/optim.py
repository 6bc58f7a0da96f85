"""AdamW (PyTorch's update: bias correction, decoupled weight decay; norms and the router's expert bias are not
decayed), one fused kernel per parameter, and the LR schedule.

Two optimizers behind one contract (prepare the gradients -> (gradients, factor, norm, finite); update):
- replicated (`build_adamw`): every rank holds every parameter's moments and steps all of them; the one-process
  reference and `parallel_config.optimizer_shard: false`.
- distributed (`build_distributed`, parallel/optim): ZeRO-1. Gradients reduce-scattered per bucket over the
  parameter's data-parallel group, each rank's slice of the moments (and a float32 master below float32 weights)
  stepped, the weights all-gathered back. Used where it changes what a rank holds: `optimizer_shard` with a
  data-parallel group of more than one rank, or working weights below float32 (parallel/optim/memory.py:
  `uses_distributed`).

The learning rate is a pure function of the step, assigned to the optimizer's rate inside the training graph before
each update, so the value that is logged is the value that is used, and resuming at step n needs nothing but n.
"""
from __future__ import annotations

import math

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.nn.optim.adam import _fused_adam_weight_decay

from dvm_fusion.adamw import adamw_hyper, adamw_update_cpu, cpu_threads
from parallel.optim import BucketPlan, Route
from parallel.optim.distributed import ShardedAdamW, ShardedGradients


def lr_at(step: int, base_lr: float, min_lr: float, warmup: int, total: int, kind: str) -> float:
    """Linear warmup over `warmup` steps, then constant or cosine decay to `min_lr` at `total`."""
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    if kind == "constant":
        return base_lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


class AdamW(nn.AdamWeightDecay):
    """torch.optim.AdamW that also applies the gradients' factor (unscaling, the mean over ranks, clipping) and
    skips a step whose gradients are not finite. CPU: dvm_fusion/adamw.py's kernel, the factor, both moments and
    the update in one pass (MindSpore's AdamWeightDecay after a Mul per gradient took twice
    as long). Ascend: the gradients multiplied by the factor, then MindSpore's AdamWeightDecay per parameter
    (MindFormers' AdamW, a chain of elementwise ops, was 5x slower per step on CPU). That kernel computes
    p -= lr * (m / (sqrt(v) + eps) + wd * p) without bias correction, so each step folds it in:
    lr' = lr * sqrt(bc2) / bc1, eps' = eps * sqrt(bc2) and wd' = wd * bc1 / sqrt(bc2) give exactly
    p * (1 - lr * wd) - lr * (m / bc1) / (sqrt(v / bc2) + eps)."""

    def __init__(self, params, learning_rate, beta1: float, beta2: float, eps: float, device_target: str = "CPU"):
        super().__init__(params, learning_rate=learning_rate, beta1=beta1, beta2=beta2, eps=eps)
        self.fused = device_target != "Ascend"
        self.threads = Tensor(cpu_threads(), ms.float32)
        self.weight_decays = Tensor([float(w.asnumpy()) for w in self.weight_decay], ms.float32)
        if self.fused:
            # MindSpore's zero moments are pages the OS has not handed out yet: the kernel's first step read-faulted
            # each to the shared zero page, then write-faulted it from two threads, each fault a TLB shootdown (perf:
            # 2.7 s of small's first step). Written here from one thread (asnumpy() is a view of a CPU tensor's
            # buffer; were it a copy, this would only cost time): small's first step 13.4-14.9 -> 12.0-12.4 s,
            # Trainer() 0.3 s longer.
            for moment in (*self.moments1, *self.moments2):
                moment.asnumpy()[...] = 0.0

    @property
    def exp_avg(self):
        return self.moments1

    @property
    def exp_avg_sq(self):
        return self.moments2

    def construct(self, gradients, grad_factor, finite):
        """Steps every parameter by its gradient times `grad_factor` (a float32 scalar tensor), if `finite` (a bool
        tensor; else nothing changes, the step count included)."""
        if self.fused:      # no branch in the graph: the kernel skips a step that is not finite
            self.assignadd(self.global_step, finite.astype(ms.int32))
            bc1, root_bc2 = self.corrections()
            hyper = adamw_hyper(self.get_lr(), self.beta1, self.beta2, self.eps, grad_factor, bc1, root_bc2,
                                self.threads, finite)
            # one call over all parameters (a profile of each: a call per parameter took 24 ms of a tiny step, this 19)
            return adamw_update_cpu(self._parameters, self.moments1, self.moments2, gradients, hyper,
                                    self.weight_decays)
        if finite:
            self.assignadd(self.global_step, self.global_step_increase_tensor)
            bc1, root_bc2 = self.corrections()
            gradients = self.hyper_map(ops.partial(ops.mul, grad_factor), gradients)
            lr_t = self.get_lr() * root_bc2 / bc1
            eps_t = self.eps * root_bc2
            weight_decay = self.hyper_map(ops.partial(ops.mul, bc1 / root_bc2), self.get_weight_decay())
            self.hyper_map(ops.partial(_fused_adam_weight_decay, self.fused_opt, self.beta1, self.beta2, eps_t, lr_t),
                           weight_decay, self._parameters, self.moments1, self.moments2, gradients,
                           self.decay_flags, self.optim_filter)
        return ops.zeros((1,), ms.float32)

    def corrections(self):
        """1 - beta1^t and sqrt(1 - beta2^t) at this step t (global_step, already counting it)."""
        step = self.global_step.astype(ms.float32)
        return 1.0 - ops.pow(self.beta1, step), ops.sqrt(1.0 - ops.pow(self.beta2, step))


def _decays(param: Parameter) -> bool:
    return len(param.shape) >= 2


def build_adamw(params: list[Parameter], lr: float, betas, eps: float, weight_decay: float,
                device_target: str = "CPU") -> nn.Optimizer:
    groups = [{"params": [p for p in params if _decays(p)], "weight_decay": weight_decay},
              {"params": [p for p in params if not _decays(p)], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    learning_rate = Parameter(Tensor(lr, ms.float32), name="learning_rate", requires_grad=False)
    return AdamW(groups, learning_rate=learning_rate, beta1=float(betas[0]), beta2=float(betas[1]), eps=float(eps),
                 device_target=device_target)


def weight_decay_of(param: Parameter, weight_decay: float) -> float:
    """The decay rate of a parameter: matrices decay, vectors (norms, biases) do not."""
    return weight_decay if _decays(param) else 0.0


def ordered_like_adamw(params: list[Parameter]) -> list[Parameter]:
    """The replicated optimizer's parameter order (decayed first): both optimizers take gradients in it."""
    return [p for p in params if _decays(p)] + [p for p in params if not _decays(p)]


def cast_weights(params: list[Parameter], params_dtype: str) -> None:
    """The working weights in `params_dtype` (the model builds them in float32; the distributed optimizer keeps
    the float32 master of weights below it). Kept in float32, as Megatron-Core keeps them: the vectors (norms,
    biases: the model multiplies them in float32) and the router's weight (its logits are float32 by
    `router_dense_type`)."""
    dtype = getattr(ms, params_dtype)
    for p in params:
        if p.dtype != dtype and _decays(p) and not p.name.endswith(".gate.weight"):
            p.set_dtype(dtype)


def build_distributed(params: list[Parameter], routes: list[Route], transports: dict, optimizer_config,
                      bucket_size: int, device_target: str = "CPU") -> ShardedAdamW:
    """The distributed optimizer's update over `params` (in `ordered_like_adamw` order) with their routes;
    `transports`: name -> transport of the groups the routes name ("dp", "edp", "tp", "ep"). Its gradient half
    is `sharded_gradients(optimizer, ...)`."""
    o = optimizer_config
    sizes = {name: t.group.size for name, t in transports.items()}
    plan = BucketPlan.of([int(p.size) for p in params], routes, sizes, bucket_size)
    return ShardedAdamW(params, plan, transports, o.learning_rate, o.betas, o.eps,
                        fused=device_target != "Ascend", threads=cpu_threads())


def sharded_gradients(optimizer: ShardedAdamW, transports: dict, dp: int, clip: float, counted=None, pp=None,
                      accumulate: bool = False) -> ShardedGradients:
    """The gradient half over `optimizer`'s buckets (see ShardedGradients)."""
    return ShardedGradients(optimizer.plan, transports, dp, clip, pp, accumulate, counted)
