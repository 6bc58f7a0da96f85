"""The bytes one rank's collectives carry in a training step, by kind, as the planner prices them: what
`bench/plan_vs_run.py` holds against the counters of what the comm layer issued (parallel/comm/counters.py).

The same terms the cost model turns into seconds, as bytes in the counters' convention (the tensor as it enters the
collective on this rank: an all-gather's input, a reduce-scatter's, all-reduce's and all-to-all's whole input, a
point-to-point transfer's sent tensor):
- tensor parallelism: parallel/planner/tp_traffic.py's collectives of each block the stage holds (its embedding,
  dense and MoE layers, head and MTP depths), per micro-batch; under full recompute the layers' forward ones again;
- expert parallelism (flat exchange): per MoE layer and micro-batch, the forward's per-expert counts (E float32
  per token slice), the dispatch and combine rows of `Costing.ep_copies` in each direction, and under expert tensor
  parallelism the rows' exchange over etp (`expert_exchange_bytes`);
- the step (`cost_model.gradient_comm`'s terms): the distributed optimizer's reduce-scatter of the float32
  gradients and all-gather of the updated weights over the dense (dp x cp) and the expert-data-parallel groups, the
  tp all-reduce of the weights replicated over tp, and under pipeline parallelism with MTP the embedding's gradient
  summed with its last-stage copy's; without the distributed optimizer those groups all-reduce the gradients;
  the gradient norm's scalar sums are left out (a few 4-byte all-reduces, which the bench names);
- pipeline: each micro-batch's hidden state sent to the next stage from every chunk but the model's last, and its
  gradient to the previous one from every chunk but the first (`cost_model.p2p_time`'s bytes).
Under the flat EP scheme only (the bench's layouts run in one node); context parallelism's gathers are left out.
"""
from __future__ import annotations

from math import prod

import numpy as np

from parallel.planner import tp_traffic
from parallel.planner.costing import Costing
from parallel.planner.workload import FP32, Layouts, Workload

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p")


def _tp_bytes(c: Costing, collectives, forward_again: bool = False) -> dict:
    """Bytes by kind of tp_traffic's `collectives` of one block, per micro-batch (the forward's twice where
    `forward_again`: full recompute)."""
    out = dict.fromkeys(KINDS, 0.0)
    for col in collectives:
        times = 2 if forward_again and col.direction == "forward" else 1
        out[col.kind] = out[col.kind] + times * prod(col.shape) * c.role_bytes[col.dtype]
    return out


def _add(total: dict, part: dict, times=1.0) -> None:
    for k, v in part.items():
        total[k] = total[k] + times * v


def expert_exchange_bytes(c: Costing) -> dict:
    """One MoE layer's expert-parallel exchange on a rank, per micro-batch, forward and backward (flat scheme), as
    the mean over ranks (a rank receives what routing sends it; the ranks together receive what they sent).
    Expert tensor parallelism (parallel/tp/expert.py) issues, per layer: an all-gather of the rows per local expert
    (forward), and uneven all-to-alls over etp of the rows tiled etp times to the peers and of the peers' partial
    sums back, each mirrored in the backward; `Costing.ep_all_to_all` prices each leg as an all-gather of the same
    wire bytes."""
    h, E = c.s.hidden_size, c.s.num_routed_experts
    flat_rows, _ = c.ep_copies()
    dispatch = c.w.precision.dispatch_bytes or c.ab
    out = dict.fromkeys(KINDS, 0.0)
    out["all_to_all"] = (c.ep > 1) * (c.slices * E * FP32 + 2 * flat_rows * h * (dispatch + c.ab))
    tensor = c.etp > 1
    out["all_to_all"] = out["all_to_all"] + tensor * 4 * c.etp * flat_rows * h * c.ab
    out["all_gather"] = tensor * (E / c.ep + 1) * FP32
    return out


def step_collective_bytes(w: Workload, lay: Layouts, st, distributed) -> dict[str, np.ndarray]:
    """Bytes by kind (KINDS) one rank of the stage `st` (cost_model.StagePlan) issues in a step, under the
    distributed optimizer where `distributed` (parallel/optim/memory.py: uses_distributed); module docstring."""
    from parallel.planner.blocks import block_costs
    from parallel.planner.cost_model import stage_memory
    c, p, d = Costing(w, lay), w.precision, w.shape.mtp_depth
    args = c.sp_args()
    full = lay.recompute == 2
    per_micro = dict.fromkeys(KINDS, 0.0)
    dense_layers = st.dense_by_mode.sum(axis=0)
    moe_layers = st.moe_by_mode.sum(axis=0)
    moe = w.shape.num_routed_experts > 0
    E = w.shape.num_routed_experts
    # around attention and the shared expert, and the router's sums over the ranks routing a sequence (tp x cp)
    moe_tp = (tp_traffic.moe_layer(*args) + tp_traffic.router_sums(c.mbs, c.tp * c.cp, E, w.shape.device_aux_loss,
                                                                 w.shape.z_loss)) if moe else ()
    _add(per_micro, _tp_bytes(c, tp_traffic.embedding_lookup(*args, True)), st.embedding)
    _add(per_micro, _tp_bytes(c, tp_traffic.dense_layer(*args), full), dense_layers)
    _add(per_micro, _tp_bytes(c, moe_tp, full), moe_layers)
    _add(per_micro, _tp_bytes(c, tp_traffic.head(*args, w.shape.tie_embeddings)), st.last)
    if moe:
        _add(per_micro, expert_exchange_bytes(c), moe_layers + st.last * d)
        _add(per_micro, _tp_bytes(c, moe_tp + tp_traffic.mtp_extra(*args)
                                  + tp_traffic.head(*args, w.shape.tie_embeddings)), st.last * d)
    # pipeline: forward sends from every chunk of the stage but the model's last, backward from all but the first
    hidden = lay.mbs * w.seq_length * w.shape.hidden_size * p.activation_bytes / (lay.tp * lay.cp)
    per_micro["p2p"] = np.where(lay.pp > 1, hidden * (2 * lay.vpp - st.last - st.embedding), 0.0)
    out = {k: lay.m * v for k, v in per_micro.items()}
    mem = stage_memory(w, lay, block_costs(w, lay), st)
    dense, expert = mem["dense_params"], mem["expert_params"]
    for params, group in ((dense, lay.dp * lay.cp), (expert, lay.edp)):
        reduced = (group > 1) * params * FP32
        out["reduce_scatter"] = out["reduce_scatter"] + np.where(distributed, reduced, 0.0)
        out["all_gather"] = out["all_gather"] + np.where(distributed, reduced / group * p.param_bytes / FP32, 0.0)
        out["all_reduce"] = out["all_reduce"] + np.where(distributed, 0.0, reduced)
    out["all_reduce"] = (out["all_reduce"] + (lay.tp > 1) * mem["replicated_params"] * FP32
                         + mem["pair_params"] * p.grad_bytes)
    return out
