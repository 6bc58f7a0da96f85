"""The multi-process pipeline executor: each rank is one pipeline stage and runs its stage's actions of a schedule
(1F1B, interleaved 1F1B, GPipe, DualPipeV; the fused pairs of the overlapped variant and of DualPipeV run one
action after the other), moving activations forward and gradients backward through `parallel.comm`
point-to-point transfers.

Placement: the model is cut into p*v chunks (virtual stages); the schedule's chunk layout says which stage holds
chunk k (`Schedule.stage_and_chunk`: k % p for the interleaved order, DualPipeV's V puts k and 2p-1-k on stage k).
Stage s is the rank at position s of this rank's pp group (`ParallelLayout.group_of(Axis.PP, rank)`, sorted: the
pp coordinate is the slowest-varying one), so the neighbours of every chunk come from the layout.

A chunk is a Cell `chunk(x, *side) -> (y, loss, stats)`: `x` is micro-batch mb's input (chunk 0) or the previous
chunk's activation, `side` the micro-batch's other inputs (every chunk gets them: labels, masks, positions), `y`
the activation for the next chunk (ignored on the last), `loss` the chunk's part of the micro-batch loss (the
last chunk's loss; others may add terms of their own, such as auxiliary losses, whose gradient stays local) and
`stats` any tensor the caller wants back per micro-batch (not differentiated).

The schedule runs in MindSpore's PyNative mode over compiled chunks (`Compiled`: the chunk's construct under
`ms.jit`, one graph). Per action, on the stage that holds chunk k:
- F(mb, c): the chunk's forward runs once, under PyNative's grad flag: MindSpore's autograd records it and keeps
  the tensors its backward needs (a compiled graph's saved activations), until B. The output is sent to chunk
  k+1's stage.
- B(mb, c): the output gradient is received from chunk k+1's stage (none on the last chunk); with the loss scale
  on the loss (1/m by default: the loss is the mean over micro-batches, as in `replay.py`) MindSpore's autograd
  engine runs the recorded backward (`run_backward`; `ms.vjp` keeps one record at a time and finishes them
  last-in first-out, and 1F1B finishes them first-in first-out), the weight gradients are added into the chunk's
  accumulators (one graph), and the input gradient is sent to chunk k-1's stage (unless k == 0). So no forward
  runs twice: recompute happens only inside the chunk's graph, where its cells ask for it (recompute_config).
The host does not wait for a transfer: a send is issued and left to run, a received tensor goes to its consumer's
graph as it is; losses and statistics are read once the schedule is done. With `timed` (default on the CPU) each
action's end is awaited to time it for the timeline; off (Ascend's default), nothing syncs per action.

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
                t = Transfer(Kind.F, a.microbatch, k, s, schedule.stage_and_chunk(k + 1)[0])
            elif a.kind is Kind.B and k > 0:
                t = Transfer(Kind.B, a.microbatch, k, s, schedule.stage_and_chunk(k - 1)[0])
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

    class Compiled(nn.Cell):
        """The chunk as one compiled graph called from PyNative: under the grad flag its forward runs once and
        leaves the tensors its backward needs in the autograd record (only where the chunk's cells ask for
        recompute does the backward run their forward again)."""

        def __init__(self, chunk):
            super().__init__(auto_prefix=False)     # the chunk's parameters keep their names
            self.chunk = chunk

        @ms.jit
        def construct(self, x, *side):
            return self.chunk(x, *side)

    class AddInto(nn.Cell):
        """The weight gradients of one backward added into the chunk's accumulators, in one graph."""

        def __init__(self, accumulators):
            super().__init__(auto_prefix=False)
            self.accumulators = ms.ParameterTuple(accumulators)
            self.map = ops.HyperMap()

        @ms.jit
        def construct(self, *grads):
            self.map(ops.assign_add, self.accumulators, grads)
            return grads[0]

    class Send(nn.Cell):
        def __init__(self, transport):
            super().__init__()
            self.t = transport

        @ms.jit
        def construct(self, x):
            return self.t.send(x)

    class Recv(nn.Cell):
        def __init__(self, transport, shape, dtype):
            super().__init__()
            self.t, self.shape, self.dtype = transport, tuple(shape), dtype

        @ms.jit
        def construct(self):
            return self.t.recv(self.shape, self.dtype)

    return Compiled, AddInto, Send, Recv


class _PyNative:
    """MindSpore's PyNative mode for the schedule's run (the chunks stay compiled graphs: `Compiled`), the caller's
    mode back afterwards."""

    def __enter__(self):
        import mindspore as ms
        self.mode = ms.get_context("mode")
        ms.set_context(mode=ms.PYNATIVE_MODE)

    def __exit__(self, *exc):
        import mindspore as ms
        ms.set_context(mode=self.mode)


def _grad_flag(on: bool) -> None:
    from mindspore.graph.api import _pynative_executor
    _pynative_executor.set_grad_flag(on)


def _leaf(x):
    """A received (or handed-over) activation as the start of this chunk's autograd record."""
    from mindspore import ops
    x = ops.stop_gradient(x)
    x.requires_grad_(True)
    return x


def _backward(outputs, x, weights):
    """The gradients of x (None: not wanted) and of the weights for the output gradients `outputs` [(tensor,
    gradient)]: MindSpore's autograd engine over the record the forward left (`run_backward`, the engine behind
    PyNative's `Tensor` autograd; `ms.vjp` keeps one record at a time and finishes them last-in first-out only).
    Outputs without a gradient path (constants) or gradient (None) are left out; a weight or input the outputs do
    not reach gets zeros."""
    from mindspore import ops
    from mindspore._c_expression import run_backward
    pairs = [(t, g) for t, g in outputs if g is not None and t._requires_grad]   # pylint: disable=protected-access
    wanted = ([x] if x is not None else []) + list(weights)
    grads = run_backward(tuple(t for t, _ in pairs), tuple(g for _, g in pairs), False, False, tuple(wanted), True,
                         accumulate_grad=False) if pairs and wanted else [None] * len(wanted)
    grads = [ops.zeros_like(w) if g is None else g for g, w in zip(grads, wanted)]
    return (grads[0] if x is not None else None), grads[len(wanted) - len(weights):]


@dataclass
class _Run:
    """One run's state: micro-batches, buffers, what the forwards keep for their backwards, and the records."""
    mbs: list
    shape: tuple
    sens: object
    inbox: dict = field(default_factory=dict)      # (direction, mb, producing k) -> received tensor
    outbox: dict = field(default_factory=dict)     # produced here, waiting for its transfer
    stored: dict = field(default_factory=dict)     # (mb, k) -> (backward function, input bytes, y, stats)
    sent: list = field(default_factory=list)
    losses: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    order: list = field(default_factory=list)
    log: list = field(default_factory=list)
    tlog: list = field(default_factory=list)
    peak: int = 0
    peak_buf: int = 0
    held: int = 0
    peak_held: int = 0


class PipelineExecutor:
    """Runs `schedule` for this rank's stage.

    chunks: all p*v chunks of the model as Cells of the contract above (only this stage's are built into graphs
    and run; the others may be None). activation_shape, dtype: what a chunk sends the next (a run may give other
    shapes). accumulator_of(weight) -> the Parameter its gradients are added into (by default zeros-initialised
    copies, read by `gradients()`). transport_of(peer_stage) -> the transport of the pair (this rank, that stage's
    rank); by default `ProcessGroups(layout, rank).pair(peer)` + `transport_for(group, device_target)`.
    loss_chunks: the chunks whose loss part has a gradient (the last one always; by default it alone). The backward
    starts from the others' activation alone: a compiled graph's constant output (a zero loss part) cannot seed
    MindSpore's autograd after the graph's first call ("Try to backward the graph twice").
    """

    def __init__(self, schedule: Schedule, layout: ParallelLayout, rank: int, chunks: Sequence,
                 activation_shape: Sequence[int], dtype=None, device_target: str = "CPU",
                 transport_of: Callable | None = None, accumulator_of: Callable | None = None,
                 timed: bool | None = None, loss_chunks: Sequence[int] | None = None):
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
        Compiled, AddInto, self._Send, self._Recv = _cells()
        self.mine = [schedule.virtual_stage(self.stage, c) for c in range(v)]
        self.timed = device_target == "CPU" if timed is None else timed
        self.loss_chunks = frozenset({self.last} if loss_chunks is None else loss_chunks) | {self.last}
        self.fwd, self.compiled, self.add_into, self.params = {}, {}, {}, {}
        self.weights, self.accumulators = {}, {}
        for k in self.mine:
            # names relative to the chunk (a wrapping Cell may rename MindSpore's parameters)
            named = [(n, w) for n, w in chunks[k].parameters_and_names() if w.requires_grad]
            if accumulator_of is None:
                accumulators = [Parameter(ms.ops.zeros(w.shape, w.dtype), name=f"grad_accum.{k}.{n}",
                                          requires_grad=False) for n, w in named]
            else:
                accumulators = [accumulator_of(w) for _, w in named]
            self.fwd[k], self.compiled[k] = chunks[k], Compiled(chunks[k])
            self.params[k], self.add_into[k] = [w for _, w in named], AddInto(accumulators)
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

    def _stage_of(self, k: int) -> int:
        return self.schedule.stage_and_chunk(k)[0]

    def _forward_peers(self) -> list[int]:
        pairs = [(self._stage_of(k), self._stage_of(k + 1)) for k in range(self.last)]
        return [s for pair in pairs if self.stage in pair for s in pair if s != self.stage]

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
                ops.assign(a, ops.zeros(a.shape, a.dtype))    # in place: the compiled AddInto holds this buffer

    def run(self, microbatches: Sequence[tuple], activation_shape: Sequence[int] | None = None,
            loss_sens: float | None = None) -> PipelineResult:
        """microbatches[mb] = (input of chunk 0, side inputs...) (numpy or Tensors); every rank passes all of them
        (a stage reads what its chunks need). The weight gradients of loss_sens x each micro-batch's loss (default
        1/m: of the mean loss) are added into the accumulators."""
        from mindspore import Tensor

        m = self.schedule.microbatches
        if len(microbatches) != m:
            raise ExecutorError(f"microbatches: the schedule runs {m}, got {len(microbatches)}")
        as_t = lambda x: x if isinstance(x, Tensor) else Tensor(x)   # noqa: E731
        run = _Run([tuple(as_t(x) for x in mb) for mb in microbatches], tuple(activation_shape or self.shape),
                   Tensor(np.float32(1.0 / m if loss_sens is None else loss_sens)))
        with _PyNative():
            for e in self.program:
                if isinstance(e, Transfer):
                    self._transfer(run, e)
                else:
                    self._compute(run, e.action)
        if run.stored or run.inbox or run.outbox:
            raise ExecutorError("activations or gradients left over after the schedule: it does not close")
        # the host reads the losses and statistics once, after the schedule (no wait per action for them)
        losses = {mb: float(loss.asnumpy()) for mb, loss in run.losses.items()}
        stats = {key: st.asnumpy() for key, st in run.stats.items()}
        return PipelineResult(self.stage, losses, stats, run.order, run.log, run.tlog, run.peak, run.peak_buf,
                              run.peak_held, self.program)

    def _transfer(self, run: "_Run", e: Transfer) -> None:
        """Issues the transfer; the host does not wait for it (its consumer's graph takes the tensor)."""
        key = (e.direction, e.mb, e.k)
        t0 = time.perf_counter()
        if e.src == e.dst:
            run.inbox[key] = run.outbox.pop(key)
        elif e.src == self.stage:
            # kept until the run ends: a sent tensor's buffer is not freed while the collective may still read it
            run.sent.append(self.send[e.dst](run.outbox.pop(key)))
        else:
            run.inbox[key] = self._receive(e.src, run.shape)
        run.tlog.append(TransferRecord(e, e.src == self.stage, t0, time.perf_counter()))
        run.peak_buf = max(run.peak_buf, len(run.inbox))

    def _compute(self, run: "_Run", a: Action) -> None:
        """F: the chunk's forward once, recorded by MindSpore's PyNative autograd (the compiled chunk keeps what its
        backward needs); B: the backward of that record from the output gradient, the weight gradients added into
        the accumulators."""
        from mindspore import ops
        k = self.schedule.virtual_stage(self.stage, a.chunk)
        x0, *side = run.mbs[a.microbatch]
        t0 = time.perf_counter()
        if a.kind is Kind.F:
            x = x0 if k == 0 else _leaf(run.inbox.pop((Kind.F, a.microbatch, k - 1)))
            _grad_flag(True)
            y, loss, st = self.compiled[k](x, *side)
            _grad_flag(False)
            run.stored[(a.microbatch, k)] = (x, y, loss, st)
            run.peak = max(run.peak, len(run.stored))
            run.held += x.nbytes
            run.peak_held = max(run.peak_held, run.held)
            run.stats[(a.microbatch, k)] = st
            if k == self.last:
                run.losses[a.microbatch] = loss
            else:
                run.outbox[(Kind.F, a.microbatch, k)] = ops.stop_gradient(y)
            end = loss if k == self.last else y
        else:
            x, y, loss, st = run.stored.pop((a.microbatch, k))
            run.held -= x.nbytes
            dy = None if k == self.last else run.inbox.pop((Kind.B, a.microbatch, k + 1))
            sens = run.sens if k in self.loss_chunks else None
            dx, dw = _backward([(y, dy), (loss, sens)], x if k > 0 else None, self.params[k])
            end = self.add_into[k](*dw) if dw else dx
            if k > 0:
                run.outbox[(Kind.B, a.microbatch, k)] = dx
        if self.timed:
            end.asnumpy()           # the action's end on the measured timeline
        run.log.append(ActionRecord(a, k, t0, time.perf_counter()))
        run.order.append(a)

    def forward_only(self, microbatches: Sequence[tuple], activation_shape: Sequence[int] | None = None,
                     chunks: dict | None = None) -> dict[tuple[int, int], np.ndarray]:
        """Each micro-batch through the chunks, no backward: (micro-batch, chunk k held here) -> its stats (the
        last chunk's loss is also its stats' first entry, as the caller's chunk defines). `chunks`: other Cells of
        the same contract for the chunks held here (k -> Cell; e.g. ones whose stats are what a tensor dump
        records); by default the training chunks. Transfers in (micro-batch, chunk) order, the same on every rank,
        so that both ends of each meet."""
        run = self.fwd if chunks is None else chunks
        from mindspore import Tensor
        shape = tuple(activation_shape or self.shape)
        as_t = lambda x: x if isinstance(x, Tensor) else Tensor(x)   # noqa: E731
        stats = {}
        for mb, batch in enumerate(microbatches):
            x0, *side = (as_t(x) for x in batch)
            x = x0
            for k in range(self.last + 1):
                here, nxt = self._stage_of(k), self._stage_of(k + 1) if k < self.last else None
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
