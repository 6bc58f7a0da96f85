"""AdamW (MindFormers' implementation: PyTorch's update with bias correction and decoupled weight decay; norms
and the router's expert bias are not decayed) and the LR schedule.

The learning rate is a pure function of the step, set into the optimizer before each update, so the value that is
logged is the value that is used, and resuming at step n needs nothing but n.
"""
from __future__ import annotations

import math

import mindspore as ms
from mindspore import Parameter, Tensor, nn


def lr_at(step: int, base_lr: float, min_lr: float, warmup: int, total: int, kind: str) -> float:
    """Linear warmup over `warmup` steps, then constant or cosine decay to `min_lr` at `total`."""
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    if kind == "constant":
        return base_lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def _decays(param: Parameter) -> bool:
    return len(param.shape) >= 2


def build_adamw(params: list[Parameter], lr: float, betas, eps: float, weight_decay: float) -> nn.Optimizer:
    # MindSpore's own nn.AdamWeightDecay has no bias correction; MindFormers' AdamW matches torch.optim.AdamW.
    from mindformers.core.optim.adamw import AdamW
    groups = [{"params": [p for p in params if _decays(p)], "weight_decay": weight_decay},
              {"params": [p for p in params if not _decays(p)], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    learning_rate = Parameter(Tensor(lr, ms.float32), name="learning_rate", requires_grad=False)
    return AdamW(groups, learning_rate=learning_rate, betas=(float(betas[0]), float(betas[1])), eps=float(eps))


def set_lr(optimizer: nn.Optimizer, lr: float) -> None:
    optimizer.learning_rate.set_data(Tensor(lr, ms.float32))
