"""Replay a pipeline schedule in one process: the PP check of the alignment tools.

The model is cut into p*v chunks (virtual stage k = chunk c of stage s, as `Schedule.virtual_stage` maps them:
c*p + s when interleaved, a V for DualPipeV). Every action of the schedule runs in the schedule's order, one
micro-batch at a time: a forward runs chunk k on the activations "received" from chunk k-1, "sends" its output on
and stores its input on the stage; a backward takes that stored input and the gradient "received" from chunk k+1,
runs the chunk's vector-Jacobian product (re-running the chunk's forward under autodiff, as full recompute does:
MindSpore's PyNative mode keeps one open autodiff graph at a time, so closures cannot wait across other
micro-batches' passes) and adds the chunk's parameter gradients into the accumulators. The loss is the mean over
micro-batches, so the last chunk's backward starts from 1/m. With exact arithmetic the accumulated gradients equal
plain training on the whole batch; in floating point they differ only by the order of summation, which is what the
equivalence tests bound.

Contract (plain MindSpore Cells, nothing model-specific):
- chunks[k](acts: tuple[Tensor], side: tuple) -> tuple[Tensor]: the activations passed to chunk k+1;
- loss_fn(acts, side) -> scalar Tensor: the micro-batch's loss from the last chunk's activations;
- a micro-batch is (acts0, side): chunk 0's inputs and the side inputs every chunk may read (positions, masks,
  labels), which are not differentiated.
A parameter shared by several chunks (a tied embedding) receives the sum of their gradients, as the all-reduce
between the stages that hold its copies would give.

Two hooks serve the alignment harness (precision/): every parameter gradient of a backward goes through
`Accumulator.add`, so a test breaks a stage's accumulation by overriding that one method; and each backward's
re-run of its chunk's forward runs inside `recompute()`, where a forward capture can stand aside so that a dump
holds each forward pass once.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import numpy as np

from oneline import InputError
from parallel.pipeline.schedules import Action, Kind, Schedule, validate


@dataclass
class ReplayResult:
    loss: float  # mean of the micro-batch losses
    losses: list[float]  # per micro-batch
    grads: dict[str, np.ndarray]  # parameter name -> gradient of the mean loss
    trace: list[tuple[int, Action]]  # (stage, action) in the order they ran
    peak_stored: tuple[int, ...]  # per stage: most stored chunk inputs (activations) held at once


class ReplayError(InputError):
    """Chunks, micro-batches and schedule do not fit together."""


class Accumulator:
    """The stages' gradient accumulators: per parameter, the sum of its micro-batch gradients. The 1/m of the mean
    loss has already entered once, through the last chunk's backward, so nothing is divided here."""

    def __init__(self):
        self.grads: dict[str, np.ndarray] = {}

    def add(self, stage: int, name: str, grad: np.ndarray) -> None:
        """Add one backward's gradient of parameter `name`, computed on `stage`."""
        self.grads[name] = self.grads[name] + grad if name in self.grads else grad


def replay(schedule: Schedule, chunks: Sequence, loss_fn: Callable, microbatches: Sequence[tuple],
           accumulator: Accumulator | None = None,
           recompute: Callable[[], ContextManager] = nullcontext) -> ReplayResult:
    import mindspore as ms
    from mindspore import Tensor

    p, v, m = schedule.stages, schedule.chunks, schedule.microbatches
    if len(chunks) != p * v:
        raise ReplayError(f"chunks: the schedule has {p} stages x {v} chunks = {p * v} virtual stages, "
                          f"got {len(chunks)} chunks")
    if len(microbatches) != m:
        raise ReplayError(f"microbatches: the schedule runs {m}, got {len(microbatches)}")
    last = p * v - 1
    weights = [list(c.trainable_params()) for c in chunks]
    loss_params = loss_fn.trainable_params() if hasattr(loss_fn, "trainable_params") else []
    weights[last] += [w for w in loss_params if all(w is not x for x in weights[last])]
    owner: dict[str, int] = {}
    for w in (w for ws in weights for w in ws):
        if owner.setdefault(w.name, id(w)) != id(w):
            raise ReplayError(f"two different parameters are named {w.name!r}: build the chunks inside one Cell "
                              f"(e.g. an nn.CellList) so that MindSpore gives them unique names")
    accumulator = Accumulator() if accumulator is None else accumulator
    sent: dict[tuple[int, int], tuple] = {}  # (mb, k) -> activations from chunk k, waiting for chunk k+1
    returned: dict[tuple[int, int], tuple] = {}  # (mb, k) -> gradient w.r.t. chunk k's inputs, for chunk k-1
    stored: dict[tuple[int, int], tuple] = {}  # (mb, k) -> chunk k's input activations, on chunk k's stage
    losses: dict[int, float] = {}
    held = [0] * p
    peak = [0] * p
    trace = []
    scale = Tensor(np.float32(1.0 / m))

    def forward_fn(k: int, side: tuple) -> Callable:
        if k == last:
            return lambda *acts: (loss_fn(chunks[k](acts, side), side),)
        return lambda *acts: tuple(chunks[k](acts, side))

    for s, i in validate(schedule).order:
        for a in schedule.slots(s)[i]:
            k = schedule.virtual_stage(s, a.chunk)
            acts0, side = microbatches[a.microbatch]
            key = (a.microbatch, k)
            if a.kind is Kind.F:
                acts = tuple(acts0) if k == 0 else sent.pop((a.microbatch, k - 1))
                out = forward_fn(k, side)(*acts)
                stored[key] = acts
                held[s] += 1
                peak[s] = max(peak[s], held[s])
                if k == last:
                    losses[a.microbatch] = float(out[0].asnumpy())
                else:
                    sent[key] = out
            else:
                acts = stored.pop(key)
                held[s] -= 1
                sens = (scale,) if k == last else returned.pop((a.microbatch, k + 1))
                with recompute():
                    _, vjp_fn = ms.vjp(forward_fn(k, side), *acts, weights=weights[k] or None)
                result = vjp_fn(sens)
                input_grads, weight_grads = result if weights[k] else (result, ())
                for w, g in zip(weights[k], weight_grads):
                    accumulator.add(s, w.name, g.asnumpy())
                if k > 0:
                    returned[key] = tuple(input_grads) if isinstance(input_grads, tuple) else (input_grads,)
            trace.append((s, a))
    if stored or sent or returned:
        raise ReplayError("activations or gradients left over after the schedule: it does not close")
    ordered = [losses[i] for i in range(m)]
    return ReplayResult(float(np.mean(ordered)), ordered, accumulator.grads, trace, tuple(peak))
