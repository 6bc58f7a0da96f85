"""The multi-process pipeline executor: each rank is one pipeline stage and runs its stage's actions of a schedule
(1F1B, interleaved 1F1B; the overlapped variant runs its fused pairs one action after the other), moving
activations forward and gradients backward through `parallel.comm` point-to-point transfers.

Placement: the model is cut into p*v chunks; chunk k (virtual stage) lives on stage k % p as its local chunk
k // p (`Schedule.virtual_stage`). Stage s is the rank at position s of this rank's pp group
(`ParallelLayout.group_of(Axis.PP, rank)`, sorted: the pp coordinate is the slowest-varying one), so the
neighbours of every chunk come from the layout.

Per action, on the stage that holds chunk k:
- F(mb, c): the input is micro-batch mb's input (k == 0) or the activation received from chunk k-1's stage; the
  chunk runs and its output is sent to chunk k+1's stage, or, on the last chunk, the loss is computed. The input
  is stored: it is the activation in flight until the backward.
- B(mb, c): the stored input is released; the output gradient is received from chunk k+1's stage (or, on the last
  chunk, is the loss scale, 1/m: the loss is the mean over micro-batches, as in `replay.py`); one GradOperation
  with sens_param on a Cell wrapping the chunk (and the loss on the last chunk) recomputes the chunk's forward and
  returns the input gradient and the weight gradients; the weight gradients are added into the per-chunk
  accumulators and the input gradient is sent to chunk k-1's stage (unless k == 0).

Ordering of the transfers (why it cannot deadlock). A transfer on the CPU transport is one all-reduce on the
pair's group: it blocks both ends until both have issued it, and two transfers on one pair pair up in issue order
(a mismatch does not hang but silently adds the wrong tensors). Issuing a send right after the producing action
and a recv right before the consuming one is not enough: with 1F1B at p=2 stage 0 runs F0 F1 B0 and stage 1
F0 B0 F1 B1, so stage 0's second transfer would be "send F1's activation" while stage 1's is "send B0's
gradient": both wait in a collective the other does not match. So every rank derives, from the schedule alone
(deterministically, so all ranks agree), one global sequence of all compute actions and all transfers:
1. a list schedule of the actions with nominal durations (forward 1, backward 2): an action starts when its
   stage has finished its previous action and its dependencies (`schedules.dependencies`) have finished, and
   its transfer happens when the producing action finishes (an eager send, as a real pipeline does);
2. all events sorted by time, transfers before computes at equal times, ties broken by (kind, stage,
   micro-batch, chunk) for computes and (source, destination, micro-batch, chunk, direction) for transfers.
Each rank's program is that sequence restricted to the events it takes part in: its own actions (in the
schedule's order for its stage, since an action starts after the previous one finished) and every transfer it
sends or receives, at its place in the global sequence. That sequence is a total order in which every transfer
comes after its producing action and before its consuming one, and in which each rank's program appears in
order. Deadlock-freedom follows by induction: the earliest event of the global sequence not yet done has all the
earlier events of each of its ranks done (they come earlier in the sequence), so each of its ranks is issuing
it; a transfer thus finds both its ends at it and completes. And the transfers of a pair are issued in the same
order on both ends (the sequence's). A received tensor waits in a buffer until its consumer runs; the buffer is
not an activation in flight in the schedule's sense (it is reported apart, `peak_buffered`).

Timeline: every action records its start and end (`time.perf_counter`), every transfer too; the executed order
is returned so that a test can assert it equals the schedule's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from oneline import InputError
from parallel.layout import Axis, ParallelLayout
from parallel.pipeline.schedules import Action, Kind, Schedule, dependencies, validate

FORWARD_COST, BACKWARD_COST = 1.0, 2.0


class ExecutorError(InputError):
    """Chunks, micro-batches, layout and schedule do not fit together."""


@dataclass(frozen=True)
class Transfer:
    """One point-to-point transfer: the activation of chunk `k` (forward) or the gradient w.r.t. chunk `k`'s input
    (backward) of micro-batch `mb`, from stage `src` to stage `dst`."""
    direction: Kind      # F: an activation to chunk k+1; B: an input gradient to chunk k-1
    mb: int
    k: int               # the producing chunk (virtual stage)
    src: int
    dst: int


@dataclass(frozen=True)
class Compute:
    stage: int
    action: Action


@dataclass
class ActionRecord:
    action: Action
    chunk: int           # virtual stage k
    start: float         # time.perf_counter()
    end: float


@dataclass
class TransferRecord:
    transfer: Transfer
    send: bool           # this rank sent it (else received)
    start: float
    end: float


@dataclass
class PipelineResult:
    stage: int
    losses: dict[int, float]                       # micro-batch -> loss (on the stage holding the last chunk)
    grads: dict[int, dict[str, np.ndarray]]        # chunk k held here -> parameter name inside the chunk ->
    #                                                gradient of the mean loss
    order: list[Action]                            # the actions in the order they ran
    log: list[ActionRecord]
    transfers: list[TransferRecord]
    peak_in_flight: int                            # most stored chunk inputs (activations) held at once
    peak_buffered: int                             # most received tensors waiting for their consumer
    program: list = field(default_factory=list)    # this rank's events, in order


# ---- the global sequence of events ------------------------------------------------------------------------------
def global_sequence(schedule: Schedule) -> list:
    """All computes and transfers of the schedule in one total order that every rank derives alike (see the
    module docstring)."""
    p, v = schedule.stages, schedule.chunks
    last = p * v - 1
    finish: dict[tuple[int, Action], float] = {}
    free = [0.0] * p
    events = []   # (time, 0 for a transfer / 1 for a compute, tiebreak, event)
    for s, i in validate(schedule).order:
        for a in schedule.slots(s)[i]:
            start = max([free[s]] + [finish[d] for d in dependencies(schedule, s, a)])
            end = start + (FORWARD_COST if a.kind is Kind.F else BACKWARD_COST)
            finish[(s, a)] = end
            free[s] = end
            events.append((start, 1, (a.kind.value, s, a.microbatch, a.chunk), Compute(s, a)))
            k = schedule.virtual_stage(s, a.chunk)
            if a.kind is Kind.F and k < last:
                t = Transfer(Kind.F, a.microbatch, k, s, (k + 1) % p)
            elif a.kind is Kind.B and k > 0:
                t = Transfer(Kind.B, a.microbatch, k, s, (k - 1) % p)
            else:
                continue
            # src == dst (p == 1: one stage holds both chunks) is a local hand-over, no collective
            events.append((end, 0, (t.src, t.dst, t.mb, t.k, t.direction.value), t))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    return [e[3] for e in events]


def program(schedule: Schedule, stage: int) -> list:
    """The events `stage` takes part in, in the global sequence's order."""
    return [e for e in global_sequence(schedule)
            if (isinstance(e, Compute) and e.stage == stage) or (isinstance(e, Transfer) and stage in (e.src, e.dst))]


# ---- MindSpore cells ----------------------------------------------------------------------------------------------
def _cells():
    import mindspore as ms
    from mindspore import nn, ops

    class ChunkLoss(nn.Cell):
        """Chunk k's output, or on the last chunk the micro-batch loss of it."""

        def __init__(self, chunk, loss_fn=None):
            super().__init__()
            self.chunk, self.loss_fn = chunk, loss_fn

        def construct(self, x, side):
            y = self.chunk(x)
            if self.loss_fn is not None:
                return self.loss_fn(y, side)
            return y

    class ChunkGrad(nn.Cell):
        """(input gradients, weight gradients) of ChunkLoss for the output gradient `sens` (recomputes the
        forward)."""

        def __init__(self, net, weights):
            super().__init__()
            self.net = net
            self.weights = ms.ParameterTuple(weights)
            self.grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)

        def construct(self, x, side, sens):
            return self.grad(self.net, self.weights)(x, side, sens)

    class Send(nn.Cell):
        def __init__(self, transport):
            super().__init__()
            self.t = transport

        def construct(self, x):
            return self.t.send(x)

    class Recv(nn.Cell):
        def __init__(self, transport, shape, dtype):
            super().__init__()
            self.t, self.shape, self.dtype = transport, tuple(shape), dtype

        def construct(self):
            return self.t.recv(self.shape, self.dtype)

    return ChunkLoss, ChunkGrad, Send, Recv


class PipelineExecutor:
    """Runs `schedule` for this rank's stage.

    chunks: all p*v chunks of the model (Cells built inside one parent Cell so parameters have unique names); only
    those of this stage are run. chunk k maps activation [activation_shape] -> [activation_shape].
    loss_fn(y, side) -> scalar: the micro-batch loss from the last chunk's output; `side` (labels) is each
    micro-batch's second element and is not differentiated.
    transport_of(peer_stage) -> the transport of the pair (this rank, that stage's rank); by default
    `ProcessGroups(layout, rank).pair(peer)` + `transport_for(group, device_target)`.
    """

    def __init__(self, schedule: Schedule, layout: ParallelLayout, rank: int, chunks: Sequence, loss_fn,
                 activation_shape: Sequence[int], dtype=None, device_target: str = "CPU",
                 transport_of: Callable | None = None):
        import mindspore as ms
        from parallel.comm import ProcessGroups, transport_for

        p, v = schedule.stages, schedule.chunks
        if layout.pp != p:
            raise ExecutorError(f"layout: pp={layout.pp} but the schedule has {p} stages")
        if len(chunks) != p * v:
            raise ExecutorError(f"chunks: the schedule has {p} stages x {v} chunks = {p * v} virtual stages, "
                                f"got {len(chunks)} chunks")
        validate(schedule)
        self.schedule, self.layout, self.rank = schedule, layout, rank
        self.stage_ranks = sorted(layout.group_of(Axis.PP, rank))
        self.stage = self.stage_ranks.index(rank)
        self.shape, self.dtype = tuple(activation_shape), dtype or ms.float32
        self.last = p * v - 1
        ChunkLoss, ChunkGrad, Send, Recv = _cells()
        self.mine = [schedule.virtual_stage(self.stage, c) for c in range(v)]
        self.fwd, self.bwd, self.weights = {}, {}, {}
        for k in self.mine:
            net = ChunkLoss(chunks[k], loss_fn if k == self.last else None)
            # names relative to the chunk (a wrapping Cell may rename MindSpore's parameters)
            named = [(n, w) for n, w in chunks[k].parameters_and_names() if w.requires_grad]
            if k == self.last and hasattr(loss_fn, "parameters_and_names"):
                named += [(f"loss.{n}", w) for n, w in loss_fn.parameters_and_names()
                          if w.requires_grad and all(w is not x for _, x in named)]
            self.fwd[k], self.bwd[k] = net, ChunkGrad(net, [w for _, w in named])
            self.weights[k] = [n for n, _ in named]
        groups = ProcessGroups(layout, rank)
        if transport_of is None:
            def transport_of(peer_stage):
                return transport_for(groups.pair(self.stage_ranks[peer_stage]), device_target)
        self.send, self.recv = {}, {}
        self.program = program(schedule, self.stage)
        for e in self.program:   # create every pair group up front, in the same order on all ranks
            if isinstance(e, Transfer) and e.src != e.dst:
                peer = e.dst if e.src == self.stage else e.src
                if peer not in self.send:
                    t = transport_of(peer)
                    self.send[peer], self.recv[peer] = Send(t), Recv(t, self.shape, self.dtype)

    def run(self, microbatches: Sequence[tuple]) -> PipelineResult:
        """microbatches[mb] = (input of chunk 0 (numpy or Tensor), side input of the loss); every rank passes all
        of them (only the first and the last chunk's stages read them)."""
        from mindspore import Tensor

        sch, m = self.schedule, self.schedule.microbatches
        if len(microbatches) != m:
            raise ExecutorError(f"microbatches: the schedule runs {m}, got {len(microbatches)}")
        as_t = lambda x: x if isinstance(x, Tensor) else Tensor(x)   # noqa: E731
        scale = Tensor(np.float32(1.0 / m))
        inbox: dict[tuple, Tensor] = {}      # (direction, mb, producing k) -> received tensor
        outbox: dict[tuple, Tensor] = {}     # produced here, waiting for its transfer
        stored: dict[tuple[int, int], Tensor] = {}   # (mb, k) -> chunk k's input, until its backward
        grads: dict[int, dict[str, np.ndarray]] = {k: {} for k in self.mine}
        losses: dict[int, float] = {}
        order, log, tlog = [], [], []
        peak = peak_buf = 0
        for e in self.program:
            if isinstance(e, Transfer):
                key = (e.direction, e.mb, e.k)
                t0 = time.perf_counter()
                if e.src == e.dst:
                    inbox[key] = outbox.pop(key)
                elif e.src == self.stage:
                    self.send[e.dst](outbox.pop(key)).asnumpy()   # wait for the collective to finish
                else:
                    inbox[key] = self.recv[e.src]()
                    inbox[key].asnumpy()
                tlog.append(TransferRecord(e, e.src == self.stage, t0, time.perf_counter()))
                peak_buf = max(peak_buf, len(inbox))
                continue
            a = e.action
            k = sch.virtual_stage(self.stage, a.chunk)
            x0, side = microbatches[a.microbatch]
            side = as_t(side)
            t0 = time.perf_counter()
            if a.kind is Kind.F:
                x = as_t(x0) if k == 0 else inbox.pop((Kind.F, a.microbatch, k - 1))
                out = self.fwd[k](x, side)
                stored[(a.microbatch, k)] = x
                peak = max(peak, len(stored))
                if k == self.last:
                    losses[a.microbatch] = float(out.asnumpy())
                else:
                    out.asnumpy()
                    outbox[(Kind.F, a.microbatch, k)] = out
            else:
                x = stored.pop((a.microbatch, k))
                sens = scale if k == self.last else inbox.pop((Kind.B, a.microbatch, k + 1))
                input_grads, weight_grads = self.bwd[k](x, side, sens)
                acc = grads[k]
                for name, g in zip(self.weights[k], weight_grads):
                    g = g.asnumpy()
                    acc[name] = acc[name] + g if name in acc else g
                if k > 0:
                    input_grads[0].asnumpy()
                    outbox[(Kind.B, a.microbatch, k)] = input_grads[0]
            log.append(ActionRecord(a, k, t0, time.perf_counter()))
            order.append(a)
        if stored or inbox or outbox:
            raise ExecutorError("activations or gradients left over after the schedule: it does not close")
        return PipelineResult(self.stage, losses, grads, order, log, tlog, peak, peak_buf, self.program)
