"""The multi-process pipeline executor: each rank is one pipeline stage and runs its stage's actions of a schedule
(1F1B, interleaved 1F1B; the overlapped variant runs its fused pairs one action after the other), moving
activations forward and gradients backward through `parallel.comm` point-to-point transfers.

Placement: the model is cut into p*v chunks; chunk k (virtual stage) lives on stage k % p as its local chunk
k // p (`Schedule.virtual_stage`). Stage s is the rank at position s of this rank's pp group
(`ParallelLayout.group_of(Axis.PP, rank)`, sorted: the pp coordinate is the slowest-varying one), so the
neighbours of every chunk come from the layout.

A chunk is a Cell `chunk(x, *side) -> (y, loss, stats)`: `x` is micro-batch mb's input (chunk 0) or the previous
chunk's activation, `side` the micro-batch's other inputs (every chunk gets them: labels, masks, positions), `y`
the activation for the next chunk (ignored on the last), `loss` the chunk's part of the micro-batch loss (the
last chunk's loss; others may add terms of their own, such as auxiliary losses, whose gradient stays local) and
`stats` any tensor the caller wants back per micro-batch (not differentiated).

Per action, on the stage that holds chunk k:
- F(mb, c): the chunk runs on its input and its output is sent to chunk k+1's stage. The input is stored: it is
  the activation in flight until the backward.
- B(mb, c): the stored input is released; the output gradient is received from chunk k+1's stage (zero on the
  last chunk); with the loss's gradient, the loss scale (1/m by default: the loss is the mean over micro-batches,
  as in `replay.py`), one GradOperation with sens_param recomputes the chunk's forward and adds the weight
  gradients into the chunk's accumulators inside the same graph (a graph's gradient outputs handed to another
  graph stayed alive on MindSpore 2.9's CPU), returning the input gradient, which is sent to chunk k-1's stage
  (unless k == 0).

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
is returned so that a test can assert it equals the schedule's. `forward_only` runs the micro-batches through
the chunks without a backward (evaluation), its transfers in (micro-batch, chunk) order.
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
    stats: dict[tuple[int, int], np.ndarray]       # (micro-batch, chunk k held here) -> the chunk's stats
    order: list[Action]                            # the actions in the order they ran
    log: list[ActionRecord]
    transfers: list[TransferRecord]
    peak_in_flight: int                            # most stored chunk inputs (activations) held at once
    peak_buffered: int                             # most received tensors waiting for their consumer
    peak_in_flight_bytes: int = 0                  # the bytes of those stored inputs at their most
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

    class ChunkGrad(nn.Cell):
        """The input gradient of chunk(x, *side) for the output gradients `sens` (y, loss, stats), its weight
        gradients added into `accumulators` (recomputes the forward)."""

        def __init__(self, chunk, weights, accumulators):
            super().__init__(auto_prefix=False)     # the chunk's parameters keep their names
            self.chunk = chunk
            self.weights = ms.ParameterTuple(weights)
            self.accumulators = ms.ParameterTuple(accumulators)
            self.grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)
            self.map = ops.HyperMap()

        def construct(self, x, *rest):
            # flat arguments (side..., the three output gradients): a tuple argument is a new constant to the graph
            # at every call
            inputs, weights = self.grad(self.chunk, self.weights)(x, *rest[:-3], rest[-3:])
            self.map(ops.assign_add, self.accumulators, weights)
            return inputs[0]

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

    return ChunkGrad, Send, Recv


class PipelineExecutor:
    """Runs `schedule` for this rank's stage.

    chunks: all p*v chunks of the model as Cells of the contract above (only this stage's are built into graphs
    and run; the others may be None). activation_shape, dtype: what a chunk sends the next (a run may give other
    shapes). accumulator_of(weight) -> the Parameter its gradients are added into (by default zeros-initialised
    copies, read by `gradients()`). transport_of(peer_stage) -> the transport of the pair (this rank, that stage's
    rank); by default `ProcessGroups(layout, rank).pair(peer)` + `transport_for(group, device_target)`.
    """

    def __init__(self, schedule: Schedule, layout: ParallelLayout, rank: int, chunks: Sequence,
                 activation_shape: Sequence[int], dtype=None, device_target: str = "CPU",
                 transport_of: Callable | None = None, accumulator_of: Callable | None = None):
        import mindspore as ms
        from mindspore import Parameter
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
        ChunkGrad, self._Send, self._Recv = _cells()
        self.mine = [schedule.virtual_stage(self.stage, c) for c in range(v)]
        self.fwd, self.bwd, self.weights, self.accumulators = {}, {}, {}, {}
        for k in self.mine:
            # names relative to the chunk (a wrapping Cell may rename MindSpore's parameters)
            named = [(n, w) for n, w in chunks[k].parameters_and_names() if w.requires_grad]
            if accumulator_of is None:
                accumulators = [Parameter(ms.ops.zeros(w.shape, w.dtype), name=f"grad_accum.{k}.{n}",
                                          requires_grad=False) for n, w in named]
            else:
                accumulators = [accumulator_of(w) for _, w in named]
            self.fwd[k], self.bwd[k] = chunks[k], ChunkGrad(chunks[k], [w for _, w in named], accumulators)
            self.weights[k] = [n for n, _ in named]
            self.accumulators[k] = accumulators
        groups = ProcessGroups(layout, rank)
        if transport_of is None:
            def transport_of(peer_stage):
                return transport_for(groups.pair(self.stage_ranks[peer_stage]), device_target)
        self.transports, self.send, self.recv = {}, {}, {}
        self.program = program(schedule, self.stage)
        # every pair group up front, in the same order on all ranks (the training program's, then evaluation's)
        for peer in [e.dst if e.src == self.stage else e.src for e in self.program
                     if isinstance(e, Transfer) and e.src != e.dst] + self._forward_peers():
            if peer not in self.transports:
                self.transports[peer] = transport_of(peer)
                self.send[peer] = self._Send(self.transports[peer])

    def _forward_peers(self) -> list[int]:
        p = self.schedule.stages
        return [s for k in range(self.last) for s in (k % p, (k + 1) % p)
                if self.stage in (k % p, (k + 1) % p) and s != self.stage]

    def _receive(self, peer: int, shape: tuple):
        key = (peer, shape)
        if key not in self.recv:
            self.recv[key] = self._Recv(self.transports[peer], shape, self.dtype)
        return self.recv[key]()

    def gradients(self) -> dict[int, dict[str, np.ndarray]]:
        """chunk k held here -> parameter name inside the chunk -> its accumulated gradient."""
        return {k: {n: a.asnumpy() for n, a in zip(self.weights[k], self.accumulators[k])} for k in self.mine}

    def zero_gradients(self) -> None:
        from mindspore import ops
        for k in self.mine:
            for a in self.accumulators[k]:
                a.set_data(ops.zeros(a.shape, a.dtype))

    def run(self, microbatches: Sequence[tuple], activation_shape: Sequence[int] | None = None,
            loss_sens: float | None = None) -> PipelineResult:
        """microbatches[mb] = (input of chunk 0, side inputs...) (numpy or Tensors); every rank passes all of them
        (a stage reads what its chunks need). The weight gradients of loss_sens x each micro-batch's loss (default
        1/m: of the mean loss) are added into the accumulators."""
        from mindspore import Tensor, ops

        sch, m = self.schedule, self.schedule.microbatches
        if len(microbatches) != m:
            raise ExecutorError(f"microbatches: the schedule runs {m}, got {len(microbatches)}")
        shape = tuple(activation_shape or self.shape)
        as_t = lambda x: x if isinstance(x, Tensor) else Tensor(x)   # noqa: E731
        mbs = [tuple(as_t(x) for x in mb) for mb in microbatches]
        sens = Tensor(np.float32(1.0 / m if loss_sens is None else loss_sens))
        inbox: dict[tuple, Tensor] = {}      # (direction, mb, producing k) -> received tensor
        outbox: dict[tuple, Tensor] = {}     # produced here, waiting for its transfer
        stored: dict[tuple[int, int], Tensor] = {}   # (mb, k) -> chunk k's input, until its backward
        shapes: dict[tuple[int, int], tuple] = {}    # (mb, k) -> shapes of chunk k's outputs (y, stats)
        losses, stats = {}, {}
        order, log, tlog = [], [], []
        peak = peak_buf = held = peak_held = 0
        for e in self.program:
            if isinstance(e, Transfer):
                key = (e.direction, e.mb, e.k)
                t0 = time.perf_counter()
                if e.src == e.dst:
                    inbox[key] = outbox.pop(key)
                elif e.src == self.stage:
                    self.send[e.dst](outbox.pop(key)).asnumpy()   # wait for the collective to finish
                else:
                    inbox[key] = self._receive(e.src, shape)
                    inbox[key].asnumpy()
                tlog.append(TransferRecord(e, e.src == self.stage, t0, time.perf_counter()))
                peak_buf = max(peak_buf, len(inbox))
                continue
            a = e.action
            k = sch.virtual_stage(self.stage, a.chunk)
            x0, *side = mbs[a.microbatch]
            t0 = time.perf_counter()
            if a.kind is Kind.F:
                x = x0 if k == 0 else inbox.pop((Kind.F, a.microbatch, k - 1))
                y, loss, st = self.fwd[k](x, *side)
                stored[(a.microbatch, k)] = x
                shapes[(a.microbatch, k)] = (y, st)
                peak = max(peak, len(stored))
                held += x.nbytes
                peak_held = max(peak_held, held)
                stats[(a.microbatch, k)] = st.asnumpy()
                if k == self.last:
                    losses[a.microbatch] = float(loss.asnumpy())
                else:
                    outbox[(Kind.F, a.microbatch, k)] = y
            else:
                x = stored.pop((a.microbatch, k))
                held -= x.nbytes
                y, st = shapes.pop((a.microbatch, k))
                dy = ops.zeros_like(y) if k == self.last else inbox.pop((Kind.B, a.microbatch, k + 1))
                dx = self.bwd[k](x, *side, dy, sens, ops.zeros_like(st))
                dx.asnumpy()                 # the action's end on the timeline
                if k > 0:
                    outbox[(Kind.B, a.microbatch, k)] = dx
            log.append(ActionRecord(a, k, t0, time.perf_counter()))
            order.append(a)
        if stored or inbox or outbox:
            raise ExecutorError("activations or gradients left over after the schedule: it does not close")
        return PipelineResult(self.stage, losses, stats, order, log, tlog, peak, peak_buf, peak_held, self.program)

    def forward_only(self, microbatches: Sequence[tuple], activation_shape: Sequence[int] | None = None,
                     chunks: dict | None = None) -> dict[tuple[int, int], np.ndarray]:
        """Each micro-batch through the chunks, no backward: (micro-batch, chunk k held here) -> its stats (the
        last chunk's loss is also its stats' first entry, as the caller's chunk defines). `chunks`: other Cells of
        the same contract for the chunks held here (k -> Cell; e.g. ones whose stats are what a tensor dump
        records); by default the training chunks. Transfers in (micro-batch, chunk) order, the same on every rank,
        so that both ends of each meet."""
        run = self.fwd if chunks is None else chunks
        from mindspore import Tensor
        p = self.schedule.stages
        shape = tuple(activation_shape or self.shape)
        as_t = lambda x: x if isinstance(x, Tensor) else Tensor(x)   # noqa: E731
        stats = {}
        for mb, batch in enumerate(microbatches):
            x0, *side = (as_t(x) for x in batch)
            x = x0
            for k in range(self.last + 1):
                here, nxt = k % p, (k + 1) % p
                if here == self.stage:
                    y, _, st = run[k](x, *side)
                    stats[(mb, k)] = st.asnumpy()
                    x = y
                if k == self.last or here == nxt:
                    continue
                if here == self.stage:
                    self.send[nxt](x).asnumpy()
                elif nxt == self.stage:
                    x = self._receive(here, shape)
        return stats
