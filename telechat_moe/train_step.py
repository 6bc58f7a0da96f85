"""One optimizer step of the one-graph engine (no pipeline) as graph-mode cells, and what drives them.

`TrainStep` runs one micro-batch in one graph: forward and backward (`ForwardBackward`), gradient accumulation over
micro-batches, and on the last one the gradients' preparation (telechat_moe/gradients.py) and the optimizer update.
The router's expert bias moves by its own rule after the step (`MoveExpertBiases`), from the load summed over every
rank (`OverRanks`).
"""
from __future__ import annotations

import ctypes

import mindspore as ms
from mindspore import ParameterTuple, nn, ops

from telechat_moe.gradients import PrepareGradients
from telechat_moe.model import AbsentLayer, TeleChatMoE
from telechat_moe.moe.replicas import SumReplicaGradients


class ForwardBackward(nn.Cell):
    """Losses, expert load and the gradients of (total loss x loss scale) for one micro-batch."""

    def __init__(self, model: TeleChatMoE, weights: ParameterTuple):
        super().__init__(auto_prefix=False)
        self.model = model
        self.weights = weights
        self.grad_fn = ms.value_and_grad(self.scaled_loss, None, self.weights, has_aux=True)

    def scaled_loss(self, input_ids, labels, loss_mask, segment_ids, position_ids, scale):
        total, lm, mtp, aux, z, loads = self.model(input_ids, labels, loss_mask, segment_ids, position_ids)
        return total * scale, total, lm, mtp, aux, z, loads

    def construct(self, input_ids, labels, loss_mask, segment_ids, position_ids, scale):
        (_, total, lm, mtp, aux, z, loads), grads = self.grad_fn(input_ids, labels, loss_mask, segment_ids,
                                                                 position_ids, scale)
        return total, lm, mtp, aux, z, loads, grads


def zero_out(p):
    return ops.assign(p, ops.zeros_like(p))


class TrainStep(nn.Cell):
    """One micro-batch of a step, in ONE graph: forward, backward, and on the last micro-batch the gradient
    average over micro-batches and ranks, clipping and the optimizer update (skipped on overflow). Earlier
    micro-batches add their gradients into accumulation buffers. Gradients never leave the graph (handing a
    graph's output tensors to another graph kept each step's gradients alive in MindSpore 2.9 on CPU: +54 MB per
    step on tiny), except on dump steps, where they are returned for the tensor dump.

    The learning rate comes in as an input and is assigned inside the graph: `Parameter.set_data` between calls
    of a graph that updates parameters in place is not seen by that graph (measured: the rate stayed at its
    first value, and training crawled)."""

    def __init__(self, forward_backward: ForwardBackward, prepare: PrepareGradients, optimizer: nn.Optimizer,
                 micro_batches: int, replica_sum: SumReplicaGradients | None = None):
        super().__init__(auto_prefix=False)
        self.forward_backward = forward_backward
        self.prepare = prepare
        self.replica_sum = replica_sum
        self.optimizer = optimizer
        self.map = ops.HyperMap()
        self.accum = optimizer.parameters.clone(prefix="grad_accum", init="zeros") if micro_batches > 1 else None

    def construct(self, input_ids, labels, loss_mask, segment_ids, position_ids, scale, grad_scale, lr,
                  last: bool, return_grads: bool):
        total, lm, mtp, aux, z, loads, grads = self.forward_backward(input_ids, labels, loss_mask, segment_ids,
                                                                     position_ids, scale)
        if self.accum is not None:
            if not last:
                self.map(ops.assign_add, self.accum, grads)
                return total, lm, mtp, aux, z, loads, ops.zeros((), ms.float32), True
            grads = self.map(ops.add, grads, self.accum)
            self.map(zero_out, self.accum)
        if self.replica_sum is not None:
            grads = self.replica_sum(grads)
        grads, factor, norm, finite = self.prepare(grads, grad_scale)
        ops.assign(self.optimizer.learning_rate, lr)
        # the norm returned after the update: on CPU the kernels' statuses are all the graph would keep them by
        norm = ops.depend(norm, self.optimizer(grads, factor, finite))
        if return_grads:
            return total, lm, mtp, aux, z, loads, norm, finite, self.map(ops.partial(ops.mul, factor), grads)
        return total, lm, mtp, aux, z, loads, norm, finite


class MoveExpertBiases(nn.Cell):
    """Adds each router's bias step in a graph, for the reason TrainStep takes its learning rate as an input. The
    steps come as one [routers, E] tensor: a tuple of new tensors each step is taken for constants, and the graph
    was recompiled every step (once failing to compile at step 6 of a 4-process run)."""

    def __init__(self, biases: list):
        super().__init__(auto_prefix=False)
        self.biases = ParameterTuple(biases)

    def construct(self, deltas):
        for i in range(len(self.biases)):
            ops.assign_add(self.biases[i], deltas[i])
        return deltas


class OverRanks(nn.Cell):
    """One collective over every rank (the world group), such as ops.AllReduce(), which sums a tensor."""

    def __init__(self, collective):
        super().__init__()
        self.collective = collective

    def construct(self, x):
        return self.collective(x)


def routed_layers(model: TeleChatMoE) -> tuple[list[int], list]:
    """(the routers' indices in the order of the model's expert-load output: MoE layers, then MTP; their MoE cells)
    of the routers this rank builds (a pipeline stage builds some)."""
    moe = [layer for layer in model.layers if layer.is_moe]
    built = [(i, layer) for i, layer in enumerate(moe) if not isinstance(layer, AbsentLayer)]
    built += [(len(moe) + d, block.block) for d, block in enumerate(model.mtp)]
    return [i for i, _ in built], [layer.mlp for _, layer in built]


def release_freed_heap() -> None:
    """Hand the heap pages freed so far back to the OS (glibc's malloc_trim; nothing where there is none). A graph's
    compile frees most of what it allocates, but glibc keeps the pages, and the first step's buffers then come on
    top: trimmed in between, tiny's peak resident set is 1.10 GiB instead of 1.20."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)

