"""Analytical time and memory of one training step, vectorised over many candidate layouts at once.

Every quantity is a NumPy array with one entry per layout, so the same code scores a million layouts in the
search and one layout in `--evaluate`.

Per block kind (dense layer, MoE layer, embedding, head+loss, MTP depth) and per micro-batch on one device:
- GEMMs by roofline: max(FLOPs / (peak * matmul_efficiency), bytes / (memory bandwidth * memory_efficiency));
  backward = the data-gradient and weight-gradient GEMMs. Routed experts are one grouped GEMM over the local
  experts, so few tokens per expert become weight-bandwidth bound.
- Attention: MLA or GQA projections (ModelShape), GQA's KV heads sharded over tp or, where tp exceeds them, each
  computed on the tp / kv ranks that hold it. Attention core: causal FLOPs at `attention_efficiency`; with flash
  attention the backward recomputes scores (2.5x forward); without it the full S x S scores are computed and
  streamed through memory (CPU).
- Memory-bound elementwise work (norms, residuals, SwiGLU, RoPE, routing, permutation) as bytes over bandwidth,
  plus a per-operator launch overhead.
- Tensor parallelism always with sequence parallelism, its collectives those parallel/tp issues
  (`tp_traffic.py`, the list `--show-parallel` reports and tests/test_show_parallel.py checks against the model),
  each priced by `all_gather` (all-gathers and reduce-scatters) or `all_reduce`, none overlapped: per layer an
  all-gather and a reduce-scatter of the hidden state around attention and around each FFN (compute dtype), in an
  MoE layer also the router's loss statistics summed over tp (forward); the embedding's reduce-scatter (backward:
  all-gather) of the residual stream; the head's all-gather of its float32 input and the vocab-parallel
  cross-entropy's statistics; an MTP depth's embedding lookup and eh_proj's gathers. Replicated parts (MLA
  down-projections, router) run on all tokens.
- Expert parallelism: dispatch and combine all-to-all, `flat` (one all-to-all over the EP group), `hierarchical`
  (all-gather across nodes among devices with the same local index, local filtering, all-to-all inside the node)
  or `node_dedup` (DeepEP-style: each token crosses once to each distinct destination node, at most `topk_group`
  nodes under group-limited routing, and is forwarded inside the node). An all-to-all's latency grows with its
  group (the pairwise-exchange, Hockney model): one message per peer, each paying its link's latency, in-node
  peers the intra-node and the others the inter-node one, serially: the collective libraries post a peer's
  send/receive after another's (an upper bound for a dispatcher whose RDMA writes to all peers are in flight at
  once). A dense model (no routed experts) has no MoE block and no exchange.
  With `ep_overlap` the micro-batch runs as two chunks on two streams: time = max(C, A) + min(C, A) / 2 for
  expert-block compute C and all-to-all A; otherwise C + A. An uneven expert placement (`expert_load`: max/mean
  copies per EP rank) multiplies the routed expert compute: the slowest rank paces the combine.
- Pipeline: point-to-point send of the (sequence-parallel) hidden state per micro-batch and stage boundary.
- Data parallelism (ZeRO-1): gradient reduce-scatter overlapped with the last micro-batch's backward, parameter
  all-gather overlapped with the first micro-batch's forward; only the excess is exposed. Expert gradients reduce
  over the expert-data-parallel group. Under sequence parallelism every weight replicated over tp (norms, MLA's
  down-projections and their norms, routers) has a partial gradient on each rank, all-reduced over tp after the
  backward, exposed; so are the gradient norm's two scalar sums (over tp and ep). Then the memory-bound Adam update
  of the local shard.
Activation memory per micro-batch under recompute none / selective (norms, SwiGLU and, without flash attention, the
attention scores are recomputed) / full (only the layer input is kept; the forward, including its communication,
runs again in backward). The pipeline keeps `in_flight` micro-batches per stage (1F1B: p - s; interleaved:
Megatron's warm-up count), which decides the peak.
Activation offload (`Workload.activation_offload`): that share of every block's kept activations is copied to
host memory over the cluster's host link after the block's forward and back before its backward, on a copy
engine beside the compute; each copy is assumed to overlap one block's compute (the next block's in the forward,
the previous one's in the backward, priced as this block's own: a stage's layers are alike), so only what a copy
takes beyond that compute is exposed. The device holds the rest of each in-flight micro-batch's activations plus
the offloaded share of two blocks (the one in use and the one in flight). A runtime that keeps every operator
output (keeps_op_outputs) frees nothing by offloading.
Fixed memory (cluster.Runtime): the collective library's buffers per communication group of more than one device
and the runtime's working memory; inside the usable memory, or, for a runtime whose framework pool is the usable
memory while those live beside it (fixed_memory_in_pool false), in the rest of the device memory.
A cluster's `runtime` section (cluster.Runtime, fitted by the calibration on real steps) scales the compute, adds
a cost per micro-batch and, for a runtime that keeps every operator output (MindSpore on CPU), replaces the
activation memory by what such a runtime holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parallel.planner.blocks import BlockCost, BlockCosts, block_costs
from parallel.planner.costing import Costing
from parallel.optim.memory import accumulate_bytes, uses_distributed
from parallel.planner.model_shape import dense_layers_in, flops_per_token, rank_static_bytes
from parallel.planner.workload import FP32, Layouts, Workload


def p2p_time(w: Workload, lay: Layouts) -> np.ndarray:
    """Seconds to send one micro-batch's hidden state (sequence-parallel shard) to the next stage."""
    c = w.cluster
    nbytes = lay.mbs * w.seq_length * w.shape.hidden_size * w.precision.activation_bytes / (lay.tp * lay.cp)
    inside = lay.dp * lay.cp * lay.tp * lay.pp <= c.devices_per_node
    bw = np.where(inside, c.intra_bandwidth, c.inter_bandwidth) * c.network_efficiency
    lat = np.where(inside, c.intra_latency, c.inter_latency)
    return np.where(lay.pp > 1, nbytes / bw + lat, 0.0)


def in_flight(lay: Layouts, stage) -> np.ndarray:
    """Micro-batches whose activations a stage holds at its peak (chunks / vpp for interleaved 1F1B)."""
    p, v, m = lay.pp, lay.vpp, lay.m
    one_f_one_b = np.minimum(m, p - stage)
    # Megatron warms up with every micro-batch when there are only p of them
    chunks = np.where(m == p, m * v, np.minimum(m * v, (p - stage - 1) * 2 + (v - 1) * p + 1))
    return np.where(v > 1, chunks / v, one_f_one_b).astype(np.float64)


@dataclass
class StagePlan:
    """What one pipeline stage holds (arrays over layouts): layer counts per recompute mode, the embedding, and
    whether it is the last stage (head, loss and MTP, the MTP layer with recompute mode `mtp_mode`)."""
    stage: np.ndarray
    dense_by_mode: np.ndarray  # [3, N] dense layers per recompute mode
    moe_by_mode: np.ndarray  # [3, N]
    embedding: np.ndarray  # 0/1
    last: np.ndarray  # 0/1
    mtp_mode: np.ndarray  # recompute mode of the MTP layer


def _pick(per_mode: np.ndarray, mode: np.ndarray) -> np.ndarray:
    return np.take_along_axis(per_mode, np.broadcast_to(mode, per_mode.shape[1:])[None], 0)[0]


def offload_copies(w: Workload, blk: BlockCost, mode) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of a block's activation offload copies (recompute `mode`, a number or an array)
    not hidden behind one block's compute (module docstring)."""
    if not w.activation_offload:
        return 0.0, 0.0
    c = w.cluster
    copy = w.activation_offload * _pick(blk.act, mode) / (c.host_link_bandwidth * c.network_efficiency)
    return (np.maximum(0.0, copy - blk.fwd_compute),
            np.maximum(0.0, copy - blk.bwd_compute - _pick(blk.recompute, mode)))


def stage_parts(w: Workload, b: BlockCosts, st: StagePlan) -> dict[str, np.ndarray]:
    """Seconds of one micro-batch through the stage, split into compute and exposed in-pass communication
    (TP, EP, activation offload copies), forward and backward (backward includes recompute)."""
    d = w.shape.mtp_depth
    mtp_extra = _pick(b.mtp.recompute, st.mtp_mode)
    mtp_extra_comm = _pick(b.mtp.recompute_comm, st.mtp_mode)
    mtp_copy_f, mtp_copy_b = offload_copies(w, b.mtp, st.mtp_mode)
    out = {"fwd_compute": (st.embedding * b.embedding.fwd_compute
                           + st.last * (b.head.fwd_compute + d * b.mtp.fwd_compute)),
           "fwd_comm": (st.embedding * b.embedding.fwd_comm
                        + st.last * (b.head.fwd_comm + d * (b.mtp.fwd_comm + mtp_copy_f))),
           "bwd_compute": (st.embedding * b.embedding.bwd_compute
                           + st.last * (b.head.bwd_compute + d * (b.mtp.bwd_compute + mtp_extra))),
           "bwd_comm": (st.embedding * b.embedding.bwd_comm
                        + st.last * (b.head.bwd_comm + d * (b.mtp.bwd_comm + mtp_extra_comm + mtp_copy_b)))}
    for mode in range(3):
        for blk, count in ((b.dense, st.dense_by_mode[mode]), (b.moe, st.moe_by_mode[mode])):
            copy_f, copy_b = offload_copies(w, blk, np.full(len(blk.fwd_compute), mode))
            out["fwd_compute"] = out["fwd_compute"] + count * blk.fwd_compute
            out["fwd_comm"] = out["fwd_comm"] + count * (blk.fwd_comm + copy_f)
            out["bwd_compute"] = out["bwd_compute"] + count * (blk.bwd_compute + blk.recompute[mode])
            out["bwd_comm"] = out["bwd_comm"] + count * (blk.bwd_comm + blk.recompute_comm[mode] + copy_b)
    return out


def stage_time(w: Workload, b: BlockCosts, st: StagePlan) -> tuple[np.ndarray, np.ndarray]:
    """(forward seconds, backward seconds incl. recompute) of one micro-batch through the stage."""
    p = stage_parts(w, b, st)
    return p["fwd_compute"] + p["fwd_comm"], p["bwd_compute"] + p["bwd_comm"]


def stage_memory(w: Workload, lay: Layouts, b: BlockCosts, st: StagePlan) -> dict[str, np.ndarray]:
    """Bytes per device of the stage: weights, gradients, optimizer states and gradients held between micro-batches
    ('static', the dry run's figure), activations at the peak (those kept for in-flight micro-batches plus the
    largest transient of one block)."""
    p, d = w.precision, w.shape.mtp_depth
    dense = st.embedding * b.embedding.dense_params + st.last * (b.head.dense_params + d * b.mtp.dense_params)
    # MTP's copy of the embedding on a last stage apart from it (model_shape.stage_parameters); its gradient and the
    # first stage's are summed over the pair of stages (telechat_moe/pipeline_step.py: SumShared)
    mtp_copy = d > 0 and not w.shape.tie_embeddings
    copies = mtp_copy * np.logical_xor(st.embedding > 0, st.last > 0)
    dense = dense + st.last * (1 - st.embedding) * mtp_copy * b.embedding.dense_params
    largest_act = st.last * (d > 0) * _pick(b.mtp.act, st.mtp_mode)  # the largest block's kept activations
    replicated = st.last * (b.head.replicated_params + d * b.mtp.replicated_params)
    expert = st.last * d * b.mtp.expert_params
    act = st.last * d * _pick(b.mtp.act, st.mtp_mode)
    act_none = st.last * d * b.mtp.act[0]  # what the stage would keep without recompute
    transient = st.last * np.maximum(b.head.transient[0], d * _pick(b.mtp.transient, st.mtp_mode))
    transient_none = st.last * np.maximum(b.head.transient[0], d * b.mtp.transient[0])
    for mode in range(3):
        nd, ne = st.dense_by_mode[mode], st.moe_by_mode[mode]
        dense = dense + nd * b.dense.dense_params + ne * b.moe.dense_params
        replicated = replicated + nd * b.dense.replicated_params + ne * b.moe.replicated_params
        expert = expert + ne * b.moe.expert_params
        act = act + nd * b.dense.act[mode] + ne * b.moe.act[mode]
        act_none = act_none + nd * b.dense.act[0] + ne * b.moe.act[0]
        for blk, count in ((b.dense, nd), (b.moe, ne)):
            transient = np.maximum(transient, np.where(count > 0, blk.transient[mode], 0.0))
            transient_none = np.maximum(transient_none, np.where(count > 0, blk.transient[0], 0.0))
            largest_act = np.maximum(largest_act, np.where(count > 0, blk.act[mode], 0.0))
    shards_dense = lay.dp * lay.cp if w.shard_optimizer else 1     # the dense gradients' group is dp x cp
    shards_expert = lay.edp if w.shard_optimizer else 1
    params = dense + expert
    rt = w.cluster.runtime
    # on the device: the kept activations but their offloaded share, and that share of the two blocks in transfer
    offload = 0.0 if rt.keeps_op_outputs else w.activation_offload
    static = rank_static_bytes(dense, expert, shards_dense, shards_expert, p.param_bytes, p.grad_bytes,
                               p.optimizer_bytes, p.master, held_gradient_bytes(w, lay))  # the dry run's formula
    out = {"weights": static["weights"], "grads": static["grads"], "optimizer": static["optimizer"],
           "grad_buffers": static["grad_buffers"],
           "activation_per_microbatch": (1 - offload) * act,
           "activations": (1 - offload) * act * in_flight(lay, st.stage),
           "transient": transient + offload * 2 * largest_act,
           "dense_params": dense, "expert_params": expert, "replicated_params": replicated,
           "pair_params": copies * b.embedding.dense_params}
    transient = out["transient"]
    if rt.keeps_op_outputs:  # see cluster.Runtime: nothing is freed or reused inside a step
        graphs = np.where(lay.m > 1, 2.0, 1.0)
        held = rt.activation_outputs * (act_none + transient_none) + rt.recompute_outputs * (act_none - act)
        out["activations"] = graphs * held * in_flight(lay, st.stage)
        out["grads"] = params * p.grad_bytes * (rt.weight_outputs + (lay.m > 1))  # its accumulators included
        out["grad_buffers"] = np.zeros(len(lay))
        transient = np.zeros(len(lay))
    out["fixed"] = fixed_memory(w, lay)
    out["transient"] = transient = transient + (out["fixed"] if rt.fixed_memory_in_pool else 0.0)
    out["static"] = out["weights"] + out["grads"] + out["optimizer"] + out["grad_buffers"]
    out["total"] = out["static"] + out["activations"] + transient
    return out


def held_gradient_bytes(w: Workload, lay: Layouts) -> np.ndarray:
    """Bytes per parameter of the gradients each layout holds between micro-batches, by the trainer's rule
    (parallel/optim/memory.py, as the dry run asks it): the distributed optimizer's float32 buckets, or
    accumulators in the weights' dtype under pipeline parallelism or the replicated optimizer."""
    distributed = uses_distributed(w.shard_optimizer, lay.dp * lay.cp, lay.edp,
                                   "float32" if w.precision.param_bytes >= 4 else "below float32")
    return accumulate_bytes(distributed, lay.m, lay.pp > 1, w.precision.param_bytes)


def fixed_memory(w: Workload, lay: Layouts) -> np.ndarray:
    """Bytes a device holds whatever the stage (cluster.Runtime): the collective library's buffers of each of its
    communication groups of more than one device, and the runtime's working memory (once per compiled graph where
    the runtime keeps every operator output: two when a step accumulates gradients)."""
    rt = w.cluster.runtime
    groups = sum((np.asarray(g) > 1).astype(np.float64) for g in (lay.dp, lay.tp, lay.pp, lay.ep, lay.etp, lay.cp))
    graphs = np.where(rt.keeps_op_outputs & (lay.m > 1), 2.0, 1.0)
    return groups * rt.communicator_memory + graphs * rt.graph_memory


def gradient_comm(w: Workload, lay: Layouts, mem: dict) -> dict[str, np.ndarray]:
    """Seconds of a stage's gradient collectives of one step, by group: 'dp' / 'edp' the dense and the expert
    weights' (ZeRO-1) gradient reduce-scatter and parameter all-gather, each as (reduce-scatter, all-gather); 'tp'
    the all-reduce of the weights replicated over tp (their partial gradients) and of the gradient norm's tp scalar;
    'ep' the norm's scalar over the EP group; 'pair' the embedding's gradient summed with its MTP copy's over the
    first and the last stage (across nodes). `mem`: stage_memory's dense_params, expert_params, replicated_params,
    pair_params."""
    p, c = w.precision, Costing(w, lay)
    edp, ep = lay.edp, lay.ep * lay.etp
    dense, expert = mem["dense_params"], mem["expert_params"]
    dense_group = c.dp * c.cp      # a context-parallel rank's gradient is its share of the sequence's (parallel/cp)
    return {"dp": (c.all_gather(dense * p.grad_bytes, dense_group, c.tp),
                   c.all_gather(dense * p.param_bytes, dense_group, c.tp)),
            "edp": (c.all_gather(expert * p.grad_bytes, edp, ep), c.all_gather(expert * p.param_bytes, edp, ep)),
            "tp": c.all_reduce(mem["replicated_params"] * p.grad_bytes, c.tp) + c.all_reduce(FP32, c.tp),
            "ep": c.all_reduce(FP32, c.ep, c.etp),
            "pair": c.all_reduce(mem["pair_params"] * p.grad_bytes, 2.0, c.dpn)}


def update_time(w: Workload, lay: Layouts, mem: dict, fwd, bwd) -> np.ndarray:
    """Exposed gradient communication plus the optimizer update of one stage, after the pipeline drains, and the
    runtime's separate gradient-accumulation passes; `fwd` / `bwd` are the stage's per-micro-batch times that the
    data-parallel reduce-scatter / all-gather hide behind (the sums over tp and ep run after the backward)."""
    p, c = w.precision, Costing(w, lay)
    dense, expert = mem["dense_params"], mem["expert_params"]
    g = gradient_comm(w, lay, mem)
    rs, ag = g["dp"][0] + g["edp"][0], g["dp"][1] + g["edp"][1]
    exposed = np.maximum(0.0, rs - bwd) + np.maximum(0.0, ag - fwd) if w.overlap_grad_reduce else rs + ag
    exposed = exposed + g["tp"] + g["ep"] + g["pair"]
    per_param = p.grad_bytes + 2 * p.optimizer_bytes + 2 * p.master + p.param_bytes
    shards_d = c.dp * c.cp if w.shard_optimizer else 1.0
    shards_e = lay.edp if w.shard_optimizer else 1.0
    rt = c.c.runtime
    update = rt.update_scale / rt.compute_scale  # the update kernels' own scale
    # with micro-batches, m - 1 passes add into the buffer, then one adds it to the last and one zeroes it
    passes = np.where(lay.m > 1, lay.m + 1.0, 0.0) * rt.accumulate_scale / rt.compute_scale
    return (exposed + update * c.stream(per_param * (dense / shards_d + expert / shards_e))
            + passes * c.stream(3 * p.grad_bytes * (dense + expert)) + rt.step_overhead)


def even_stage(w: Workload, lay: Layouts, stage) -> StagePlan:
    """The stage's share of an even layer split (remainder to the middle stages), uniform recompute."""
    L, pp = w.shape.num_layers, lay.pp
    stage = np.clip(np.asarray(stage), 0, pp - 1)
    base, extra = L // pp, L % pp
    start = (pp - extra) // 2
    count = base + ((stage >= start) & (stage < start + extra))
    first = stage * base + np.clip(stage - start, 0, extra)
    dense = dense_layers_in(w.shape, first, count)
    moe = count - dense
    onehot = (np.arange(3)[:, None] == lay.recompute[None]).astype(np.float64)
    return StagePlan(stage=stage, dense_by_mode=onehot * dense, moe_by_mode=onehot * moe,
                     embedding=(stage == 0).astype(np.float64), last=(stage == pp - 1).astype(np.float64),
                     mtp_mode=lay.recompute)


def step_time(m, v, pp, period_work, total_work, p2p):
    """Analytic (interleaved) 1F1B step: (m - 1/v) * per-micro-batch period + total stage work / v + fill/drain
    sends. The period is the slowest stage's forward+backward (or, per chunk, the sum over chunks of the slowest
    stage's chunk); exact for uniform stages without communication: (m + (p-1)/v) * (F+B)."""
    period = period_work + 2 * p2p
    return (m - 1.0 / v) * period + total_work / v + 2 * (pp - 1) * p2p


def evaluate(w: Workload, lay: Layouts) -> dict[str, np.ndarray]:
    """Score layouts under an even layer split: step time, throughput, MFU, peak memory, bubble."""
    b = block_costs(w, lay)
    pp = lay.pp
    extra = w.shape.num_layers % pp
    start = (pp - extra) // 2
    reps = [np.zeros_like(pp), np.ones_like(pp), start, start + extra - 1, pp - 2, pp - 1]
    times, mems, updates = [], [], []
    for r in reps:
        st = even_stage(w, lay, r)
        f, bw = stage_time(w, b, st)
        mem = stage_memory(w, lay, b, st)
        times.append(f + bw)
        mems.append(mem["total"])
        updates.append(update_time(w, lay, mem, f, bw))
    fb_max = np.max(times, axis=0)
    # the sum over all stages is the whole model's work, independent of the split
    onehot = (np.arange(3)[:, None] == lay.recompute[None]).astype(np.float64)
    all_stages = StagePlan(stage=np.zeros_like(pp), dense_by_mode=onehot * w.shape.first_k_dense,
                           moe_by_mode=onehot * w.shape.num_moe_layers, embedding=np.ones(len(lay)),
                           last=np.ones(len(lay)), mtp_mode=lay.recompute)
    f_all, b_all = stage_time(w, b, all_stages)
    p2p = p2p_time(w, lay)
    pipe = step_time(lay.m, lay.vpp, pp, fb_max, f_all + b_all, p2p)
    total = pipe + np.max(updates, axis=0)
    return summarise(w, lay, total, pipe, f_all + b_all, np.max(mems, axis=0))


def summarise(w: Workload, lay: Layouts, total, pipe, work, memory) -> dict[str, np.ndarray]:
    """Throughput, MFU, fit and bubble from the step time `total`, the pipeline part `pipe` and the per-micro-batch
    `work` summed over stages; bubble is the idle share of all stages during the pipeline part."""
    tokens = w.global_batch * w.seq_length
    tps = tokens / total / w.devices
    model_flops = flops_per_token(w.shape, w.seq_length)["training"]
    c = w.cluster
    # fixed memory outside the framework's pool must fit in what the pool leaves of the device
    beside = c.runtime.fixed_memory_in_pool | (fixed_memory(w, lay) <= c.memory_bytes - c.usable_memory)
    return {"step_time": total, "tokens_per_s_per_device": tps,
            "mfu": tps * model_flops / c.flops(w.precision.matmul_dtype),
            "memory": memory, "fits": (memory <= c.usable_memory) & beside,
            "bubble": 1.0 - lay.m * work / (lay.pp * pipe)}
