"""Run under msrun by tests/test_tensor_parallel.py: each tensor-parallel layer of parallel/tp over tp = world ranks
(ParallelLayout(dp=1, tp=world), CPU transport, graph mode) against the plain one-process layer built from the same
full weights. Every rank builds the plain layer too, runs it on the whole input, and compares its own part: the
output (its shard or the whole), the gradient w.r.t. its input (its sequence positions or columns, or the whole)
and w.r.t. each of its weight shards (the matching rows or columns of the plain weight's gradient). One graph per
case holds both. Writes `<out>/rank_<r>.json`."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.communication import get_group_size, get_rank, init

from parallel.comm import ProcessGroups, transport_for
from parallel.layout import Axis, ParallelLayout
from parallel.tp import (ColumnParallelLinear, RowParallelLinear, VocabParallelCrossEntropy, VocabParallelEmbedding,
                         full_normal, vocab_parallel_cross_entropy)
from precision.tolerance import chain_tolerance, relative_error

B, S, H, F, V = 2, 8, 16, 32, 64     # batch, sequence (divisible by 4), hidden, intermediate, vocabulary
N = B * S


# ---- the plain one-process layers ------------------------------------------------------------------------------
class PlainLinear(nn.Cell):
    def __init__(self, full):
        super().__init__()
        self.weight = Parameter(Tensor(full), name="weight")

    def construct(self, x):
        return ops.matmul(x, self.weight.T)


class PlainEmbedding(nn.Cell):
    def __init__(self, full):
        super().__init__()
        self.weight = Parameter(Tensor(full), name="weight")

    def construct(self, ids):
        return ops.gather(self.weight, ids, 0)


class PlainCrossEntropy(nn.Cell):
    def construct(self, logits, labels, mask):
        logits = logits.reshape(-1, logits.shape[-1])
        logp = ops.log_softmax(logits, -1)
        nll = -(logp * ops.one_hot(labels.reshape(-1), logits.shape[-1], Tensor(1.0), Tensor(0.0))).sum(-1)
        mask = mask.reshape(-1)
        return (nll * mask).sum() / ops.maximum(mask.sum(), 1.0)


# ---- blocks built alike from either kind of layer -----------------------------------------------------------------
class MLP(nn.Cell):
    """Megatron's pattern: two column-parallel projections, SwiGLU on the shards, a row-parallel projection."""

    def __init__(self, gate, up, down):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    def construct(self, x):
        return self.down(ops.silu(self.gate(x)) * self.up(x))


class CrossEntropyOf(nn.Cell):
    """Logits -> loss against fixed labels and mask (the graph's only input is the logits)."""

    def __init__(self, ce, labels, mask, through_function=False):
        super().__init__()
        self.ce, self.labels, self.mask = ce, Tensor(labels), Tensor(mask)
        self.through_function = through_function

    def construct(self, logits):
        if self.through_function:
            return vocab_parallel_cross_entropy(logits, self.labels, self.mask, self.ce)
        return self.ce(logits, self.labels, self.mask)


class Chain(nn.Cell):
    """ids -> embedding -> x + MLP(x) -> vocabulary head -> cross-entropy."""

    def __init__(self, embedding, mlp, head, ce, labels, mask):
        super().__init__()
        self.embedding, self.mlp, self.head = embedding, mlp, head
        self.loss = CrossEntropyOf(ce, labels, mask)

    def construct(self, ids):
        x = self.embedding(ids)
        return self.loss(self.head(x + self.mlp(x)))


class OutputAndGrads(nn.Cell):
    def __init__(self, net, wrt_input: bool):
        super().__init__()
        self.net = net
        self.weights = ms.ParameterTuple(net.trainable_params())
        self.grad = ops.GradOperation(get_all=wrt_input, get_by_list=True, sens_param=True)

    def construct(self, x, cotangent):
        return self.net(x), self.grad(self.net, self.weights)(x, cotangent)


class Both(nn.Cell):
    """The tensor-parallel net and the plain one in one graph (one compile per case)."""

    def __init__(self, par, ref, wrt_input: bool):
        super().__init__()
        self.par, self.ref = OutputAndGrads(par, wrt_input), OutputAndGrads(ref, wrt_input)

    def construct(self, x_par, cot_par, x_ref, cot_ref):
        return self.par(x_par, cot_par), self.ref(x_ref, cot_ref)


# ---- the case table -------------------------------------------------------------------------------------------
def part(a: np.ndarray, axis: int, tp: int, r: int) -> np.ndarray:
    """Rank r's contiguous 1/tp share of `a` along `axis` (written here, not taken from parallel/tp)."""
    n = a.shape[axis] // tp
    return np.take(a, np.arange(r * n, (r + 1) * n), axis=axis)


def weight_axes(net) -> dict[int, int | None]:
    """id(parameter) -> the axis its tensor-parallel layer splits (rows 0, columns 1)."""
    axes = {}
    for _, cell in net.cells_and_names():
        if isinstance(cell, (ColumnParallelLinear, VocabParallelEmbedding)):
            axes[id(cell.weight)] = 0
        elif isinstance(cell, RowParallelLinear):
            axes[id(cell.weight)] = 1
    return axes


def run_case(name, par, ref, x_par, x_ref, cot_par, cot_ref, expect_y, expect_dx, tol, tp, r, wrt_input=True):
    """`expect_y(y_ref)`, `expect_dx(dx_ref)`: this rank's part of the plain output and input gradient."""
    start = time.perf_counter()
    both = Both(par, ref, wrt_input)
    par_params, axes = list(both.par.weights), weight_axes(par)
    weight_names = [p.name.removeprefix("par.net.") for p in par_params]
    (y_par, g_par), (y_ref, g_ref) = both(Tensor(x_par), Tensor(cot_par), Tensor(x_ref), Tensor(cot_ref))
    errors = {"output": relative_error(y_par.asnumpy(), expect_y(y_ref.asnumpy()))}
    if wrt_input:
        errors["grad input"] = relative_error(g_par[0][0].asnumpy(), expect_dx(g_ref[0][0].asnumpy()))
        g_par, g_ref = g_par[1], g_ref[1]
    assert len(par_params) == len(g_par) == len(g_ref) == len(set(weight_names)), weight_names
    for p, weight, gp, gr in zip(par_params, weight_names, g_par, g_ref):
        axis = axes.get(id(p))
        want = gr.asnumpy() if axis is None else part(gr.asnumpy(), axis, tp, r)
        errors[f"grad {weight}"] = relative_error(gp.asnumpy(), want)
    seconds = time.perf_counter() - start
    print(f"rank {r}: {name}: worst {max(errors.values()):.2e} (tolerance {tol.rtol:.1e}), {seconds:.2f} s",
          flush=True)
    return {"case": name, "errors": errors, "tolerance": tol.rtol, "seconds": seconds}


def main(out: str) -> None:
    ms.set_context(mode=ms.GRAPH_MODE)
    init()
    r, world = get_rank(), get_group_size()
    tp = world
    t = transport_for(ProcessGroups(ParallelLayout(dp=1, tp=tp).validate(world), r).axis(Axis.TP), "CPU")
    assert t.group.size == tp and t.group.index == r
    rng = np.random.default_rng(7)
    x = rng.normal(size=(B, S, H)).astype(np.float32)
    x_inner = rng.normal(size=(B, S, F)).astype(np.float32)
    cot_f = rng.normal(size=(B, S, F)).astype(np.float32)
    cot_h = rng.normal(size=(B, S, H)).astype(np.float32)
    ids = rng.integers(0, V, size=N)
    ids[:6] = [0, V - 1, V // 4 - 1, V // 4, V // 2, 3 * V // 4]         # every rank's range and its edges
    ids = ids.reshape(B, S).astype(np.int32)
    labels = rng.integers(0, V, size=N)
    labels[:4] = [V - 1, 0, V // 2 - 1, V // 4]
    labels = labels.reshape(B, S).astype(np.int32)
    mask = np.ones((B, S), np.float32)
    mask.reshape(-1)[::5] = 0.0
    logits = (3.0 * rng.normal(size=(N, V))).astype(np.float32)
    w_gate, w_up = full_normal((F, H), H ** -0.5, 1), full_normal((F, H), H ** -0.5, 2)
    w_down, w_head = full_normal((H, F), F ** -0.5, 3), full_normal((V, H), H ** -0.5, 4)
    table = full_normal((V, H), 1.0, 5)
    one = np.float32(1.0)

    def seq(a):       # this rank's sequence positions of [b, s, ...]
        return part(a, 1, tp, r)

    def cols(a):      # this rank's last-axis share
        return part(a, a.ndim - 1, tp, r)

    def whole(a):
        return a

    results = []
    # the seeded initialisation: every rank keeps its slice of the one full matrix, so any tp starts alike
    inits = {"ColumnParallelLinear": (ColumnParallelLinear(H, F, t, 0.02, seed=11).weight,
                                      part(full_normal((F, H), 0.02, 11), 0, tp, r)),
             "RowParallelLinear": (RowParallelLinear(F, H, t, 0.02, seed=12).weight,
                                   part(full_normal((H, F), 0.02, 12), 1, tp, r)),
             "VocabParallelEmbedding": (VocabParallelEmbedding(V, H, t, 0.02, seed=13).weight,
                                        part(full_normal((V, H), 0.02, 13), 0, tp, r))}
    results.append({"case": "seeded init", "tolerance": 0.0, "seconds": 0.0,
                    "errors": {k: float(np.abs(p.asnumpy() - want).max()) for k, (p, want) in inits.items()}})
    linear_tol = chain_tolerance("float32", [H, F, N])
    mlp_tol = chain_tolerance("float32", [H, F, F, H, F, N])

    col = ColumnParallelLinear.from_full
    results.append(run_case("column", col(w_gate, t), PlainLinear(w_gate), x, x, cols(cot_f), cot_f, cols, whole,
                            linear_tol, tp, r))
    results.append(run_case("column gather_output", col(w_gate, t, gather_output=True), PlainLinear(w_gate), x, x,
                            cot_f, cot_f, whole, whole, linear_tol, tp, r))
    results.append(run_case("column sequence_parallel", col(w_gate, t, sequence_parallel=True), PlainLinear(w_gate),
                            seq(x), x, cols(cot_f), cot_f, cols, seq, linear_tol, tp, r))
    row = RowParallelLinear.from_full
    results.append(run_case("row", row(w_down, t), PlainLinear(w_down), cols(x_inner), x_inner, cot_h, cot_h, whole,
                            cols, linear_tol, tp, r))
    results.append(run_case("row sequence_parallel", row(w_down, t, sequence_parallel=True), PlainLinear(w_down),
                            cols(x_inner), x_inner, seq(cot_h), cot_h, seq, cols, linear_tol, tp, r))
    for sp in (False, True):
        par = MLP(col(w_gate, t, sequence_parallel=sp), col(w_up, t, sequence_parallel=sp),
                  row(w_down, t, sequence_parallel=sp))
        ref = MLP(PlainLinear(w_gate), PlainLinear(w_up), PlainLinear(w_down))
        part_of = seq if sp else whole
        results.append(run_case(f"mlp column->row{' sequence_parallel' if sp else ''}", par, ref, part_of(x), x,
                                part_of(cot_h), cot_h, part_of, part_of, mlp_tol, tp, r))
    for sp in (False, True):
        part_of = seq if sp else whole
        results.append(run_case(f"embedding{' sequence_parallel' if sp else ''}",
                                VocabParallelEmbedding.from_full(table, t, sequence_parallel=sp),
                                PlainEmbedding(table), ids, ids, part_of(cot_h), cot_h, part_of, None,
                                chain_tolerance("float32", [N, tp]), tp, r, wrt_input=False))
    ce_tol = chain_tolerance("float32", [V, V, N])
    results.append(run_case("vocab-parallel cross-entropy",
                            CrossEntropyOf(VocabParallelCrossEntropy(t), labels, mask, through_function=True),
                            CrossEntropyOf(PlainCrossEntropy(), labels, mask), cols(logits), logits, one, one,
                            whole, cols, ce_tol, tp, r))
    for sp in (False, True):
        par = Chain(VocabParallelEmbedding.from_full(table, t, sequence_parallel=sp),
                    MLP(col(w_gate, t, sequence_parallel=sp), col(w_up, t, sequence_parallel=sp),
                        row(w_down, t, sequence_parallel=sp)),
                    col(w_head, t, sequence_parallel=sp), VocabParallelCrossEntropy(t), labels, mask)
        ref = Chain(PlainEmbedding(table), MLP(PlainLinear(w_gate), PlainLinear(w_up), PlainLinear(w_down)),
                    PlainLinear(w_head), PlainCrossEntropy(), labels, mask)
        results.append(run_case(f"embedding->mlp->head->cross-entropy{' sequence_parallel' if sp else ''}", par,
                                ref, ids, ids, one, one, whole, None,
                                chain_tolerance("float32", [H, F, F, H, V, V, N, F, H, F, N]), tp, r,
                                wrt_input=False))
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank_{r}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
