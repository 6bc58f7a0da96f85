"""Run under msrun by tests/test_expert_parallel.py: one MoE layer split over expert-parallel ranks (and each expert's
FFN over expert-tensor-parallel ranks) against the same layer in one process, in graph mode. Every rank builds the one-process layer too (on the whole batch) and
compares its own rows and its own experts with it. Writes `<out>/rank_<r>.json`."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.communication import get_group_size, get_rank, init

from dvm_fusion.grouped_matmul import grouped_matmul_cpu
from parallel.comm import ProcessGroups, transport_for
from parallel.layout import Axis, ParallelLayout
from precision.tolerance import chain_tolerance, relative_error
from telechat_moe.config import ModelConfig
from telechat_moe.moe.dispatch import ExpertParallel
from parallel.tp.expert import packed_columns
from telechat_moe.moe.layer import MoELayer
from tests.workers.collectives import check_collectives

B, S, H, E, I = 2, 8, 32, 16, 16


class Loss(nn.Cell):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, cot):
        return (self.layer(x)[0] * cot).sum()


class Grads(nn.Cell):
    """The gradients of sum(layer(x) * cotangent) w.r.t. x and the layer's trainable weights. (Its own graph: a
    graph that also returned layer(x) from a second call of the layer failed to compile in MindSpore 2.9 once the
    layer ran its tokens in slices.)"""

    def __init__(self, layer):
        super().__init__()
        self.loss = Loss(layer)
        self.weights = ms.ParameterTuple(layer.trainable_params())
        self.grad = ops.GradOperation(get_all=True, get_by_list=True)

    def construct(self, x, cot):
        return self.grad(self.loss, self.weights)(x, cot)


def output_and_grads(layer, x, cot):
    return layer(Tensor(x))[0], Grads(layer)(Tensor(x), Tensor(cot))


def skewed_bias(kind: str) -> np.ndarray:
    bias = np.zeros(E, np.float32)
    if kind == "skewed":     # expert 0 in every token's choice, the last 4 experts (a whole rank at ep=4) in none
        bias[0], bias[12:] = 8.0, -8.0
    return bias


def expert_shard(name: str, value: np.ndarray, first: int, last: int, etp) -> np.ndarray:
    """This rank's share of a one-process routed-expert weight [E, ...]: its experts, and under expert tensor
    parallelism its columns of w1 (gate and up) or rows of w2."""
    value = value[first:last]
    if etp.etp == 1:
        return value
    if name.endswith("w1"):
        return packed_columns(value, etp.etp, etp.index)
    n = value.shape[1] // etp.etp
    return value[:, etp.index * n:(etp.index + 1) * n]


def run_case(rank, world, layout, kind, k, chunks, routing, x_all, cot_all, capacity=None):
    """`capacity`: (factor, drop policy). Each rank then drops its own tokens' copies to capacity, so the reference
    is the one-process layer on this rank's rows (dropping alike), its expert gradients summed over all ranks."""
    factor, policy = capacity or (None, "probs")
    cfg = ModelConfig(hidden_size=H, n_routed_experts=E, num_experts_per_tok=k, moe_intermediate_size=I,
                      moe_shared_expert_intermediate_size=I, seq_length=S, moe_token_dispatcher_type=kind,
                      moe_comm_chunks=chunks, moe_aux_loss_coeff=0.0, moe_expert_capacity_factor=factor,
                      moe_token_drop_policy=policy)
    # unsliced (with a capacity, sliced alike: each slice has its own)
    ref = MoELayer(cfg if capacity else dataclasses.replace(cfg, moe_comm_chunks=1), grouped_matmul_cpu, layer=1)
    ep = ExpertParallel.of(layout, rank, kind, "CPU")
    par = MoELayer(cfg, grouped_matmul_cpu, layer=1, ep=ep)
    first, last = ep.experts(E)
    same_init = all(np.array_equal(getattr(par.experts, w).asnumpy(), expert_shard(
        w, getattr(ref.experts, w).asnumpy(), first, last, ep.tensor)) for w in ("w1", "w2"))
    mine = dict(par.parameters_and_names())
    for name, p in ref.parameters_and_names():
        value = expert_shard(name, p.asnumpy(), first, last, ep.tensor) if ".experts." in f".{name}" \
            else p.asnumpy()
        mine[name].set_data(Tensor(value))
    for layer in (ref, par):
        layer.gate.expert_bias.set_data(Tensor(skewed_bias(routing)))
    rows = slice(rank * B, (rank + 1) * B)   # every rank holds its own B rows of the global batch
    sum_all = ops.AllReduce()
    if capacity:
        y_ref, g_ref = output_and_grads(ref, x_all[rows], cot_all[rows])
        y_ref, dx_ref = y_ref.asnumpy(), g_ref[0][0].asnumpy()
        ref_grads = [sum_all(g).asnumpy() for g in g_ref[1]]
    else:
        y_ref, g_ref = output_and_grads(ref, x_all, cot_all)
        y_ref, dx_ref = y_ref.asnumpy()[rows], g_ref[0][0].asnumpy()[rows]
        ref_grads = [g.asnumpy() for g in g_ref[1]]
    y_par, g_par = output_and_grads(par, x_all[rows], cot_all[rows])
    names = [p.name for p in par.trainable_params()]
    edp = transport_for(ProcessGroups(layout, rank).axis(Axis.EDP), "CPU")
    errors = {"output": relative_error(y_par.asnumpy(), y_ref),
              "grad_input": relative_error(g_par[0][0].asnumpy(), dx_ref)}
    for name, gr, gp in zip(names, ref_grads, g_par[1]):
        gp = gp.asnumpy()
        if ".experts." in f".{name}":     # this rank's experts: the gradient of its EP group's tokens arrives
            gp = edp.all_reduce(Tensor(gp)).asnumpy()     # here; the other EP groups hold the same experts
            errors[f"grad {name}"] = relative_error(gp, expert_shard(name, gr, first, last, ep.tensor))
        else:                             # replicated: each rank's gradient is its tokens' share
            errors[f"grad {name}"] = relative_error(sum_all(Tensor(gp)).asnumpy(), gr)
    tol = chain_tolerance("float32", [H, 2 * I, I, k, world * B * S])
    loads = par.gate(Tensor(x_all[rows].reshape(-1, H)), B)[4].asnumpy()
    drop = f" capacity={factor} {policy}" if capacity else ""
    etp = f" etp={layout.etp}" if layout.etp > 1 else ""
    return {"case": f"{kind} top-{k} chunks={chunks} {routing} ep={layout.ep}{etp}{drop}", "errors": errors,
            "tolerance": tol.rtol, "same_init": bool(same_init),
            "tokens_per_expert": sum_all(Tensor(loads)).asnumpy().tolist()}


def main(out: str) -> None:
    ms.set_context(mode=ms.GRAPH_MODE)
    init()
    rank, world = get_rank(), get_group_size()
    rng = np.random.default_rng(7)
    x_all = rng.normal(size=(world * B, S, H)).astype(np.float32)
    cot_all = rng.normal(size=(world * B, S, H)).astype(np.float32)
    # (dispatcher, top-k, token slices, routing, ep, capacity); at 4 ranks: 2 nodes x 2 devices, ep=2 inside dp=4.
    # Capacity 1.0 of a rank's 16 tokens at top-4 over 16 experts: 4 copies per expert, the skewed routing's
    # expert 0 gets 16 (12 dropped)
    # (token slices: the last case; slicing is the layer's, the same for both dispatchers)
    # (the flat all-to-all at ep=world runs in the capacity case, and dropless in the expert-migration test's
    # training at ep=4 against one process)
    # Expert tensor parallelism (etp=2, each expert's FFN over 2 ranks) inside an EP group of 2
    cases = [("hierarchical", 2, 1, "skewed", world, 1, None), ("alltoall", 4, 1, "skewed", 2, 1, None),
             ("alltoall", 2, 2, "skewed", world, 1, None),
             ("alltoall", 4, 1, "skewed", world, 1, (1.0, "probs")),
             ("hierarchical", 4, 2, "skewed", world, 1, (1.0, "position")),
             ("alltoall", 4, 1, "skewed", 2, 2, None)]
    results = []
    if world == 4:
        errors = check_collectives(rank, world)
        results.append({"case": "collectives", "errors": errors, "tolerance": 1e-5, "same_init": True,
                         "tokens_per_expert": []})
        print(f"rank {rank}: collectives: worst {max(errors.values()):.2e}", flush=True)
    for kind, k, chunks, routing, ep, etp, capacity in cases:
        if world % (ep * etp):
            continue
        layout = ParallelLayout(dp=world, ep=ep, etp=etp, devices_per_node=max(1, world // 2)).validate(world)
        ms.set_seed(11)
        results.append(run_case(rank, world, layout, kind, k, chunks, routing, x_all, cot_all, capacity))
        print(f"rank {rank}: {results[-1]['case']}: worst {max(results[-1]['errors'].values()):.2e}", flush=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank_{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
