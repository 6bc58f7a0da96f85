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

from dataclasses import dataclass, fields

import numpy as np

from parallel.ep.capacity import exchange_rows
from parallel.layout import EP_SCHEMES, RECOMPUTE, ParallelLayout
from parallel.planner import tp_traffic
from parallel.planner.cluster import Cluster
from parallel.planner.model_shape import (ModelShape, block_parameters, dense_layers_in, flops_per_token,
                                          kv_per_device, master_copy_bytes)

FP32 = 4


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor, each stated on its own (e.g. BF16 weights, FP32 gradients, an FP32
    master copy and FP32 moments: param_bytes=2, grad_bytes=4, master_bytes=4, optimizer_bytes=8)."""
    matmul_dtype: str = "bf16"  # selects the cluster's peak FLOP/s for GEMMs and attention
    activation_bytes: int = 2  # stored / communicated activations
    param_bytes: int = 4  # the weights the passes read (MindFormers keeps params_dtype float32, cast per GEMM)
    grad_bytes: int = 4
    optimizer_bytes: int = 8  # Adam's m and v together (fp32 moments: 8)
    master_bytes: int | None = None  # the optimizer's master copy; None: fp32 where the weights are below fp32
    dispatch_bytes: int | None = None  # EP dispatch payload (e.g. 1 for FP8 dispatch); None: activation_bytes
    residual_bytes: int = 4  # the residual stream (the embedding's output, what its tp collectives move)

    @property
    def master(self) -> float:
        return master_copy_bytes(self.param_bytes, self.master_bytes)


@dataclass(frozen=True)
class Workload:
    shape: ModelShape
    cluster: Cluster
    devices: int
    seq_length: int
    global_batch: int  # sequences per step
    precision: Precision = Precision()
    shard_optimizer: bool = True
    overlap_grad_reduce: bool = True  # DP reduce-scatter / all-gather hidden behind the last backward / first forward
    # the EP exchanges move static padded buffers, as this project's dispatchers do (parallel/ep/capacity.py), not
    # exactly the routed copies (a variable-size all-to-all: Megatron's dropless dispatcher, DeepEP)
    padded_exchange: bool = False
    # max/mean routed token copies over the EP ranks (1: balanced, what routing balance alone aims at): the most
    # loaded rank computes that many times the mean copies and the combine waits for it, so it sets every rank's
    # expert time (and, without padded buffers, its receive sets the exchange's); how an expert placement is priced
    expert_load: float = 1.0
    # share (0..1) of the activations kept for the backward that waits in host memory (module docstring)
    activation_offload: float = 0.0

    def __post_init__(self):
        if not 0 <= self.activation_offload <= 1:
            raise ValueError(f"activation_offload: expected a share between 0 and 1, got {self.activation_offload}")
        if self.activation_offload and self.cluster.host_link_bandwidth <= 0:
            raise ValueError(f"activation_offload: cluster {self.cluster.name} states no host_link.bandwidth")


@dataclass
class Layouts:
    """Candidate ParallelLayouts as a struct of arrays (one entry per layout), for the vectorised model: `row(i)`
    is one as a ParallelLayout, `of(...)` the arrays of given ones. cp is 1; sp is on whenever tp > 1."""
    tp: np.ndarray
    pp: np.ndarray
    vpp: np.ndarray
    dp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    mbs: np.ndarray  # sequences per micro-batch (ParallelLayout.micro_batch_size)
    m: np.ndarray  # micro-batches per step (ParallelLayout.micro_batch_num)
    recompute: np.ndarray  # index into RECOMPUTE
    ep_scheme: np.ndarray  # index into EP_SCHEMES
    ep_overlap: np.ndarray  # 0/1
    devices_per_node: np.ndarray

    def __post_init__(self):
        n = max(np.size(getattr(self, f.name)) for f in fields(self))
        for f in fields(self):
            setattr(self, f.name, np.broadcast_to(np.asarray(getattr(self, f.name), dtype=np.int64), (n,)).copy())

    def __len__(self) -> int:
        return len(self.tp)

    def take(self, index) -> "Layouts":
        return Layouts(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def row(self, i: int) -> ParallelLayout:
        tp = int(self.tp[i])
        return ParallelLayout(dp=int(self.dp[i]), tp=tp, pp=int(self.pp[i]), vpp=int(self.vpp[i]),
                              ep=int(self.ep[i]), etp=int(self.etp[i]), sp=tp > 1, micro_batch_num=int(self.m[i]),
                              devices_per_node=int(self.devices_per_node[i]), micro_batch_size=int(self.mbs[i]),
                              recompute=RECOMPUTE[self.recompute[i]], ep_scheme=EP_SCHEMES[self.ep_scheme[i]],
                              ep_overlap=bool(self.ep_overlap[i]))

    @classmethod
    def of(cls, *layouts: ParallelLayout) -> "Layouts":
        return cls(tp=[x.tp for x in layouts], pp=[x.pp for x in layouts], vpp=[x.vpp for x in layouts],
                   dp=[x.dp for x in layouts], ep=[x.ep for x in layouts], etp=[x.etp for x in layouts],
                   mbs=[x.micro_batch_size for x in layouts], m=[x.micro_batch_num for x in layouts],
                   recompute=[RECOMPUTE.index(x.recompute) for x in layouts],
                   ep_scheme=[EP_SCHEMES.index(x.ep_scheme) for x in layouts],
                   ep_overlap=[int(x.ep_overlap) for x in layouts],
                   devices_per_node=[x.devices_per_node for x in layouts])


@dataclass
class BlockCost:
    """One block kind for one micro-batch on one device; arrays over layouts, memory in bytes.
    `recompute`, `recompute_comm` and `act` have a leading axis over RECOMPUTE modes."""
    fwd_compute: np.ndarray
    fwd_comm: np.ndarray  # exposed in-pass communication (TP, EP after chunk overlap)
    bwd_compute: np.ndarray
    bwd_comm: np.ndarray
    recompute: np.ndarray  # extra backward compute per mode
    recompute_comm: np.ndarray  # extra backward communication per mode
    act: np.ndarray  # activation bytes kept until the backward, per mode
    transient: np.ndarray  # bytes alive only while this block runs (one block at a time), per mode
    dense_params: np.ndarray
    expert_params: np.ndarray
    replicated_params: np.ndarray  # of dense_params, those replicated over tp (their gradients summed over tp)



class _Costing:
    """Shared arrays of one (workload, layouts) evaluation and the primitives built on them."""

    def __init__(self, w: Workload, lay: Layouts):
        self.w, self.s, self.c, self.lay = w, w.shape, w.cluster, lay
        c, p = w.cluster, w.precision
        f = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731 - local shorthand
        self.tp, self.ep, self.etp, self.dp = f(lay.tp), f(lay.ep), f(lay.etp), f(lay.dp)
        self.mbs = f(lay.mbs)  # sequences of one micro-batch
        self.T = self.mbs * w.seq_length  # tokens of one micro-batch (one data-parallel replica)
        self.Tl = self.T / self.tp  # tokens a device owns under sequence parallelism
        self.ab = float(p.activation_bytes)
        self.role_bytes = {tp_traffic.COMPUTE: self.ab, tp_traffic.RESIDUAL: float(p.residual_bytes),
                           tp_traffic.FLOAT32: float(FP32)}
        # processes sharing a host's cores share its compute (see cluster.Runtime)
        sharing = min(w.devices, c.devices_per_node) if c.runtime.devices_share_cores else 1
        scale = c.runtime.compute_scale * sharing
        self.flops = c.flops(p.matmul_dtype) * c.matmul_efficiency / scale
        # attention kernels stay in BF16 when the GEMMs run in FP8 (DeepSeek-V3, Megatron's FP8 recipes)
        attn_dtype = "bf16" if p.matmul_dtype == "fp8" and "bf16" in c.peak_flops else p.matmul_dtype
        self.attn_flops = c.flops(attn_dtype) * c.attention_efficiency / scale
        self.mem_bw = c.memory_bandwidth * c.memory_efficiency / scale
        self.intra_bw = c.intra_bandwidth * c.network_efficiency
        self.inter_bw = c.inter_bandwidth * c.network_efficiency
        self.dpn = float(c.devices_per_node)

    # ---- primitives ---------------------------------------------------------------------------------
    def gemm(self, M, K, N, groups=1.0):
        """(forward, backward) seconds of `groups` GEMMs [M,K]x[K,N] that each read their own weight."""
        def one(m, k, n, out_bytes):
            flops = 2.0 * m * k * n * groups
            moved = groups * (self.ab * (m * k + k * n) + out_bytes * m * n)
            return np.maximum(flops / self.flops, moved / self.mem_bw)
        fwd = one(M, K, N, self.ab)
        bwd = one(M, N, K, self.ab) + one(K, M, N, self.w.precision.grad_bytes)  # dgrad, wgrad
        return fwd, bwd

    def stream(self, nbytes):
        return nbytes / self.mem_bw

    def group_span(self, size, stride):
        """(nodes spanned, members per node) of a group of `size` ranks `stride` apart in a contiguous block."""
        nodes = np.maximum(1.0, np.ceil(size * stride / self.dpn))
        return nodes, size / nodes

    def all_gather(self, total_bytes, size, stride=1.0):
        """Seconds of an all-gather (or reduce-scatter) whose gathered result is `total_bytes`; two phases
        (across nodes among equal local indices, then inside the node) when the group spans nodes."""
        nodes, local = self.group_span(size, stride)
        c = self.c
        t = ((nodes - 1) / size * total_bytes / self.inter_bw + (nodes - 1) * c.inter_latency
             + (local - 1) / local * total_bytes / self.intra_bw + (local - 1) * c.intra_latency)
        return np.where(size > 1, t, 0.0)

    def peer_latency(self, local, remote):
        """Seconds of the messages to `local` in-node and `remote` other-node peers, one after another."""
        return local * self.c.intra_latency + remote * self.c.inter_latency

    def all_to_all(self, send_bytes, size, stride=1.0):
        """Seconds of a uniform all-to-all where each rank sends `send_bytes` spread over the group: the bytes over
        the slower of the two links, and a message to every peer (module docstring)."""
        nodes, local = self.group_span(size, stride)
        cross = send_bytes * (size - local) / size
        intra = send_bytes * (local - 1) / size
        t = np.maximum(cross / self.inter_bw, intra / self.intra_bw) + self.peer_latency(local - 1, size - local)
        return np.where(size > 1, t, 0.0)

    def all_reduce(self, nbytes, size, stride=1.0):
        """Seconds of an all-reduce of `nbytes`: a reduce-scatter and an all-gather of the buffer (ring)."""
        return 2 * self.all_gather(nbytes, size, stride)

    def tp_time(self, collectives, direction: str):
        """Seconds of a piece's tensor-parallel collectives (tp_traffic's) in one direction of the pass."""
        t = np.zeros(len(self.lay))
        for c in collectives:
            if c.direction == direction:
                nbytes = c.payload(self.tp, self.role_bytes[c.dtype])
                t = t + (self.all_reduce(nbytes, self.tp) if c.kind == "all_reduce" else
                         self.all_gather(nbytes, self.tp))
        return t

    def tp_comm(self, collectives):
        """(forward, backward) seconds of tp_traffic's collectives of a block (sequence parallel over tp)."""
        return self.tp_time(collectives, "forward"), self.tp_time(collectives, "backward")

    def sp_args(self):
        """tp_traffic's (s, b, t, h) of these layouts."""
        return float(self.w.seq_length), self.mbs, self.tp, self.s.hidden_size

    def ops(self, n):
        return n * self.c.op_overhead

    # ---- blocks -------------------------------------------------------------------------------------
    def attention_shapes(self):
        """What differs between MLA and GQA: (the projections' GEMMs [M, K, N], per-token widths on T tokens of
        the elementwise work, of the activations kept for the backward under selective recompute, and of the norm
        outputs selective recompute drops)."""
        s, T, tp = self.s, self.T, self.tp
        h, H, heads, qk, vd = s.hidden_size, s.num_heads, s.num_heads / tp, s.qk_head_dim, s.value_head_dim
        if not s.mla:  # q and o split by head; k and v by KV head (each held whole where tp exceeds the KV heads)
            kv_heads = kv_per_device(s, tp)[0] / (2 * h * qk)
            qk_heads = heads + kv_heads
            proj = [(T, h, heads * qk), (T, h, 2 * kv_heads * qk), (T, heads * qk, h)]
            norms = qk_heads * qk * s.qk_layernorm
            return proj, 4 * heads * qk + 2 * qk_heads * qk + 3 * norms, 2 * heads * qk + 2 * kv_heads * qk, norms
        proj = [(T, s.kv_lora_rank, H * (s.qk_nope_head_dim + vd) / tp), (T, H * vd / tp, h),
                (T, h, s.kv_lora_rank + s.qk_rope_head_dim)]
        proj += ([(T, h, s.q_lora_rank), (T, s.q_lora_rank, H * qk / tp)] if s.q_lora_rank else [(T, h, H * qk / tp)])
        latent = s.q_lora_rank + s.kv_lora_rank
        elementwise = 3 * latent + 4 * heads * qk + 2 * heads * s.qk_rope_head_dim
        kept = 2 * (s.kv_lora_rank + s.qk_rope_head_dim) + s.q_lora_rank + heads * (2 * qk + 2 * vd)
        return proj, elementwise, kept, latent

    def attention(self):
        """(fwd, bwd, fwd elementwise, act per mode, transient) of an attention block incl. its input norm."""
        s, T, Tl, tp, ab = self.s, self.T, self.Tl, self.tp, self.ab
        h, H = s.hidden_size, s.num_heads
        qk, vd = s.qk_head_dim, s.value_head_dim
        fwd = bwd = 0.0
        proj, elementwise_width, kept_width, norm_width = self.attention_shapes()
        for M, K, N in proj:
            f, b = self.gemm(M, K, N)
            fwd, bwd = fwd + f, bwd + b
        seqs, S, heads = T / self.w.seq_length, float(self.w.seq_length), H / tp
        if self.c.flash_attention:
            core = seqs * heads * 2 * S * S * (qk + vd) / 2 / self.attn_flops
            fwd, bwd = fwd + core, bwd + 2.5 * core
            scores_kept = T * heads * FP32  # log-sum-exp
        else:  # the full score matrix is computed, masked and soft-maxed in fp32
            core = seqs * heads * 2 * S * S * (qk + vd) / self.attn_flops
            elems = seqs * heads * S * S
            score_bytes = 6 * elems * FP32
            fwd, bwd = fwd + core + self.stream(score_bytes), bwd + 2 * core + self.stream(2 * score_bytes)
            scores_kept = elems * FP32
        elementwise = self.stream(ab * (Tl * 7 * h + T * elementwise_width))
        fwd, bwd = fwd + elementwise + self.ops(25), bwd + 2 * elementwise + self.ops(50)
        keep_sel = ab * (Tl * h + T * kept_width)
        norms_dropped = ab * (Tl * h + T * norm_width)
        if self.c.flash_attention:  # scores are recomputed by the kernel anyway; only the log-sum-exp is kept
            keep_sel, full, recompute_sel = keep_sel + scores_kept, keep_sel + scores_kept + norms_dropped, elementwise
        else:
            full = keep_sel + norms_dropped + scores_kept
            recompute_sel = elementwise + core + self.stream(score_bytes)
        return fwd, bwd, recompute_sel, full, keep_sel, elementwise

    def swiglu_ffn(self, tokens, inter_per_device):
        """(fwd, bwd, elementwise, act full, act selective) of a SwiGLU FFN on `tokens` rows."""
        h, ab = self.s.hidden_size, self.ab
        f1, b1 = self.gemm(tokens, h, 2 * inter_per_device)
        f2, b2 = self.gemm(tokens, inter_per_device, h)
        elementwise = self.stream(ab * tokens * 3 * inter_per_device)
        act_sel = ab * tokens * (h + 2 * inter_per_device)  # fc1 input and output; SwiGLU output recomputed
        return f1 + f2 + elementwise, b1 + b2 + 2 * elementwise, elementwise, act_sel + ab * tokens * inter_per_device, act_sel

    def ep_copies(self):
        """(rows of one flat EP exchange's send buffer, those of the hierarchical in-node exchange) a device sends
        per micro-batch: this project's static buffers (parallel/ep/capacity.py: dropless worst case, or the
        experts' capacity) under padded_exchange, else the routed copies T/tp x k themselves."""
        s, k, E = self.s, self.s.top_k, self.s.num_routed_experts
        nodes, local = self.group_span(self.ep, self.etp)
        if not self.w.padded_exchange:      # the most loaded rank receives expert_load x the mean
            return self.Tl * k * self.w.expert_load, self.Tl * k * self.w.expert_load
        cf = s.expert_capacity_factor
        flat = self.ep * exchange_rows(self.Tl, k, E / self.ep, E, cf)
        inner = local * exchange_rows(nodes * self.Tl, k, E / self.ep, E, cf, nodes)
        return flat, inner

    def ep_all_to_all(self):
        """(forward, backward) seconds of one EP dispatch (token rows in `dispatch_bytes`) plus one combine (in
        activation bytes), including the gather / reduce-scatter over expert tensor parallelism. Padded buffers
        also carry each row's expert as a float32 tag, forward only. Hierarchical: the rows cross to every node
        (with their experts and weights in the residual dtype there, the sums back in activation bytes), then an
        in-node exchange."""
        s, h, k = self.s, self.s.hidden_size, self.s.top_k
        nodes, local = self.group_span(self.ep, self.etp)
        flat_rows, inner_rows = self.ep_copies()
        padded = self.w.padded_exchange
        tag = FP32 if padded else 0.0
        rb = float(self.w.precision.residual_bytes)
        directions = []
        for forward in (True, False):
            total = 0.0
            tags = tag if forward else 0.0
            for leg, nbytes in (("dispatch", self.w.precision.dispatch_bytes or self.ab), ("combine", self.ab)):
                flat = self.all_to_all(flat_rows * h * nbytes, self.ep, self.etp)
                inner = self.all_to_all(inner_rows * h * nbytes, local, self.etp)
                if padded:      # the model's rows to the nodes (+ experts, weights) and the nodes' sums back
                    row = (h + 2 * k) * rb if leg == "dispatch" else h * self.ab
                    cross = self.all_to_all(nodes * self.Tl * row, nodes, self.dpn)
                else:           # all-gather across nodes among devices with the same local index
                    cross = self.all_gather(nodes * self.Tl * h * nbytes, nodes, self.dpn)
                hier = cross + inner
                # each token crosses to each distinct destination node once, then is forwarded inside the node
                distinct = nodes * (1 - (1 - 1 / nodes) ** k)
                if s.topk_group:
                    distinct = np.minimum(distinct, s.topk_group)
                cross = self.Tl * h * nbytes * distinct * (nodes - 1) / nodes
                dedup = (np.maximum(cross / self.inter_bw, self.Tl * k * h * nbytes * (local - 1) / local
                                    / self.intra_bw) + self.peer_latency(local - 1, nodes - 1))
                scheme = self.lay.ep_scheme
                total = total + np.where(nodes > 1, np.select([scheme == 1, scheme == 2], [hier, dedup], flat), flat)
                total = total + self.all_gather(self.Tl * k * self.etp * h * nbytes, self.etp)
            if tags:
                tag_flat = self.all_to_all(flat_rows * tags, self.ep, self.etp)
                tag_hier = self.all_to_all(inner_rows * tags, local, self.etp)
                total = total + np.where((nodes > 1) & (self.lay.ep_scheme == 1), tag_hier, tag_flat)
            directions.append(total)
        return tuple(directions)

    def dense_layer(self) -> BlockCost:
        s = self.s
        af, ab_, a_rsel, a_full, a_sel, a_elem = self.attention()
        ff, fb, f_elem, f_full, f_sel = self.swiglu_ffn(self.T, s.dense_intermediate / self.tp)
        norm = self.stream(self.ab * self.Tl * 4 * s.hidden_size)
        comm_f, comm_b = self.tp_comm(tp_traffic.dense_layer(*self.sp_args()))
        fwd = af + ff + norm + self.ops(12)
        bwd = ab_ + fb + 2 * norm + self.ops(24)
        act_none = a_full + f_full + self.ab * self.Tl * s.hidden_size
        act_sel = a_sel + f_sel
        return self._block(fwd, comm_f, bwd, comm_b, a_rsel + f_elem + norm, fwd, comm_f,
                           act_none, act_sel, self.ab * self.T * s.dense_intermediate / self.tp, "dense_layer")

    def moe_layer(self) -> BlockCost:
        s, h, ab, Tl = self.s, self.s.hidden_size, self.ab, self.Tl
        af, ab_, a_rsel, a_full, a_sel, a_elem = self.attention()
        E, k = s.num_routed_experts, s.top_k
        local_experts = E / self.ep
        # token-expert rows the most loaded device computes (each expert split etp ways)
        pairs = Tl * k * self.etp * self.w.expert_load
        rows = pairs / local_experts
        inter = s.moe_intermediate / self.etp
        e1f, e1b = self.gemm(rows, h, 2 * inter, local_experts)
        e2f, e2b = self.gemm(rows, inter, h, local_experts)
        e_elem = self.stream(ab * pairs * 3 * inter)
        kernel = self.c.runtime.expert_compute_scale / self.c.runtime.compute_scale  # the grouped kernel's own scale
        e1f, e1b, e2f, e2b, e_elem = (x * kernel for x in (e1f, e1b, e2f, e2b, e_elem))
        sf, sb, s_elem, s_full, s_sel = self.swiglu_ffn(self.T, s.num_shared_experts * s.shared_intermediate / self.tp)
        rf, rb = self.gemm(Tl, h, E)
        routing = self.stream(FP32 * Tl * 6 * E + ab * Tl * k * h * 5 + ab * Tl * 4 * h)
        expert_fwd = e1f + e2f + e_elem + sf + rf + routing + self.ops(30)
        expert_bwd = e1b + e2b + 2 * e_elem + sb + rb + 2 * routing + self.ops(60)
        a2a_f, a2a_b = self.ep_all_to_all()
        overlap = self.lay.ep_overlap == 1
        exposed_f = np.where(overlap, np.maximum(expert_fwd, a2a_f) + np.minimum(expert_fwd, a2a_f) / 2 - expert_fwd,
                             a2a_f)
        exposed_b = np.where(overlap, np.maximum(expert_bwd, a2a_b) + np.minimum(expert_bwd, a2a_b) / 2 - expert_bwd,
                             a2a_b)
        # around attention and around the shared expert, and the router's sums over tp
        tp_f, tp_b = self.tp_comm(tp_traffic.moe_layer(*self.sp_args(), E, s.device_aux_loss, s.z_loss))
        # the expert block's tensors have the exchange buffer's rows (padding included)
        flat_rows, inner_rows = self.ep_copies()
        nodes, _ = self.group_span(self.ep, self.etp)
        held = np.where((nodes > 1) & (self.lay.ep_scheme == 1), inner_rows, flat_rows) * self.etp
        expert_acts = ab * held * (2 * h + 2 * inter) + FP32 * Tl * E + ab * Tl * h  # in, fc1 out, out; probs
        act_sel = a_sel + s_sel + expert_acts
        act_none = a_full + s_full + expert_acts + ab * held * inter + ab * Tl * h
        transient = ab * (held * 2 * inter + self.T * 3 * s.shared_intermediate * s.num_shared_experts / self.tp)
        return self._block(af + expert_fwd, tp_f + exposed_f, ab_ + expert_bwd, tp_b + exposed_b,
                           a_rsel + e_elem + s_elem + routing, af + expert_fwd, tp_f + exposed_f,
                           act_none, act_sel, transient, "moe")

    def _block(self, fwd, fwd_comm, bwd, bwd_comm, sel_extra, full_extra, full_comm, act_none, act_sel,
               transient, params_kind) -> BlockCost:
        n = len(self.lay)
        z = np.zeros(n)
        full_act = self.ab * self.Tl * self.s.hidden_size
        b = block_parameters(self.s, self.tp, self.ep * self.etp)
        if params_kind == "moe":
            dense, expert, replicated = b["moe_dense"], b["moe_expert"], b["moe_replicated"]
        else:
            dense, expert, replicated = b["dense_layer"], z, b["dense_replicated"]
        bc = lambda x: np.broadcast_to(np.asarray(x, dtype=np.float64), (n,))  # noqa: E731
        return BlockCost(
            fwd_compute=bc(fwd), fwd_comm=bc(fwd_comm), bwd_compute=bc(bwd), bwd_comm=bc(bwd_comm),
            recompute=np.stack([z, bc(sel_extra), bc(full_extra)]), recompute_comm=np.stack([z, z, bc(full_comm)]),
            act=np.stack([bc(act_none), bc(act_sel), bc(full_act)]),
            # a fully recomputed layer rebuilds all its activations for its own backward
            transient=np.stack([bc(transient), bc(transient), bc(transient) + bc(act_none)]),
            dense_params=bc(dense) + z, expert_params=bc(expert) + z, replicated_params=bc(replicated) + z)

    def absent(self) -> BlockCost:
        """A block the model does not have (a dense model's MoE layer and MTP depth): nothing, at no cost."""
        z, zz = np.zeros(len(self.lay)), np.zeros((3, len(self.lay)))
        return BlockCost(z, z, z, z, zz, zz, zz, zz, z, z, z)

    def embedding(self) -> BlockCost:
        n = len(self.lay)
        z = np.zeros(n)
        t = self.stream(self.ab * self.T * self.s.hidden_size * 2) + self.ops(3)
        vocab = block_parameters(self.s, self.tp, 1)["vocab"]
        comm_f, comm_b = self.tp_comm(tp_traffic.embedding_lookup(*self.sp_args(), True))
        zz = np.zeros((3, n))
        return BlockCost(t + z, comm_f, 2 * t + z, comm_b, zz, zz, zz, zz, z + vocab, z, z)

    def head(self) -> BlockCost:
        """Final norm, output projection (vocabulary split by tp) and fp32 cross-entropy."""
        s, T = self.s, self.T
        n = len(self.lay)
        z = np.zeros(n)
        V = s.vocab_size / self.tp
        f, b = self.gemm(T, s.hidden_size, V)
        loss = self.stream(FP32 * T * V * 4)
        fwd = f + loss + self.stream(self.ab * self.Tl * 4 * s.hidden_size) + self.ops(10)
        bwd = b + loss + self.ops(12)
        comm_f, comm_b = self.tp_comm(tp_traffic.head(*self.sp_args(), s.tie_embeddings))
        zz = np.zeros((3, n))
        params = block_parameters(s, self.tp, 1)
        dense = params["vocab"] + params["final_norm"]
        logits = np.broadcast_to(FP32 * T * V * 2, (3, n))  # fp32 logits and their gradient
        return BlockCost(fwd + z, comm_f, bwd + z, comm_b, zz, zz, zz, logits, z + dense, z, z + params["final_norm"])

    def mtp(self) -> BlockCost:
        """One MTP depth: the next tokens' embedding lookup, two norms, eh_proj, an MoE layer, its final norm and the
        shared head + loss."""
        layer, head = self.moe_layer(), self.head()
        h = self.s.hidden_size
        pf, pb = self.gemm(self.T, 2 * h, h / self.tp)
        b = block_parameters(self.s, self.tp, self.ep * self.etp)
        out = BlockCost(**{f.name: getattr(layer, f.name).copy() for f in fields(BlockCost)})
        out.fwd_compute = layer.fwd_compute + pf + head.fwd_compute
        extra_f, extra_b = self.tp_comm(tp_traffic.mtp_extra(*self.sp_args()))
        out.fwd_comm = layer.fwd_comm + head.fwd_comm + extra_f
        out.bwd_compute = layer.bwd_compute + pb + head.bwd_compute
        out.bwd_comm = layer.bwd_comm + head.bwd_comm + extra_b
        out.transient = np.maximum(layer.transient, head.transient)
        out.dense_params = np.full_like(layer.dense_params, b["mtp_dense"])
        out.expert_params = np.broadcast_to(b["mtp_expert"], layer.expert_params.shape).astype(np.float64)
        out.replicated_params = np.full_like(layer.replicated_params, b["mtp_replicated"])
        return out


@dataclass
class BlockCosts:
    dense: BlockCost
    moe: BlockCost
    embedding: BlockCost
    head: BlockCost
    mtp: BlockCost


def block_costs(w: Workload, lay: Layouts) -> BlockCosts:
    c = _Costing(w, lay)
    head = c.head()
    if w.shape.tie_embeddings:  # one shared matrix; on a separate last stage a synchronised copy
        head.dense_params = np.where(lay.pp > 1, head.dense_params, head.dense_params - block_parameters(
            w.shape, c.tp, 1)["vocab"])
    moe = w.shape.num_routed_experts > 0  # a dense model has neither MoE layers nor MTP depths (ModelShape)
    return BlockCosts(dense=c.dense_layer(), moe=c.moe_layer() if moe else c.absent(), embedding=c.embedding(),
                      head=head, mtp=c.mtp() if moe else c.absent())


def p2p_time(w: Workload, lay: Layouts) -> np.ndarray:
    """Seconds to send one micro-batch's hidden state (sequence-parallel shard) to the next stage."""
    c = w.cluster
    nbytes = lay.mbs * w.seq_length * w.shape.hidden_size * w.precision.activation_bytes / lay.tp
    inside = lay.dp * lay.tp * lay.pp <= c.devices_per_node
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
    """Bytes per device of the stage: weights, gradients, optimizer states, activations at the peak (those
    kept for in-flight micro-batches plus the largest transient of one block)."""
    p, d = w.precision, w.shape.mtp_depth
    dense = st.embedding * b.embedding.dense_params + st.last * (b.head.dense_params + d * b.mtp.dense_params)
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
    shards_dense = lay.dp if w.shard_optimizer else 1
    shards_expert = lay.dp * lay.tp // (lay.ep * lay.etp) if w.shard_optimizer else 1
    params = dense + expert
    rt = w.cluster.runtime
    # on the device: the kept activations but their offloaded share, and that share of the two blocks in transfer
    offload = 0.0 if rt.keeps_op_outputs else w.activation_offload
    out = {"weights": params * p.param_bytes, "grads": params * p.grad_bytes,
           "optimizer": (p.optimizer_bytes + p.master) * (dense / shards_dense + expert / shards_expert),
           "activation_per_microbatch": (1 - offload) * act,
           "activations": (1 - offload) * act * in_flight(lay, st.stage),
           "transient": transient + offload * 2 * largest_act,
           "dense_params": dense, "expert_params": expert, "replicated_params": replicated}
    transient = out["transient"]
    if rt.keeps_op_outputs:  # see cluster.Runtime: nothing is freed or reused inside a step
        graphs = np.where(lay.m > 1, 2.0, 1.0)
        held = rt.activation_outputs * (act_none + transient_none) + rt.recompute_outputs * (act_none - act)
        out["activations"] = graphs * held * in_flight(lay, st.stage)
        out["grads"] = params * p.grad_bytes * (rt.weight_outputs + (lay.m > 1))
        transient = np.zeros(len(lay))
    out["fixed"] = fixed_memory(w, lay)
    out["transient"] = transient = transient + (out["fixed"] if rt.fixed_memory_in_pool else 0.0)
    out["total"] = out["weights"] + out["grads"] + out["optimizer"] + out["activations"] + transient
    return out


def fixed_memory(w: Workload, lay: Layouts) -> np.ndarray:
    """Bytes a device holds whatever the stage (cluster.Runtime): the collective library's buffers of each of its
    communication groups of more than one device, and the runtime's working memory (once per compiled graph where
    the runtime keeps every operator output: two when a step accumulates gradients)."""
    rt = w.cluster.runtime
    groups = sum((np.asarray(g) > 1).astype(np.float64) for g in (lay.dp, lay.tp, lay.pp, lay.ep, lay.etp))
    graphs = np.where(rt.keeps_op_outputs & (lay.m > 1), 2.0, 1.0)
    return groups * rt.communicator_memory + graphs * rt.graph_memory


def gradient_comm(w: Workload, lay: Layouts, mem: dict) -> dict[str, np.ndarray]:
    """Seconds of a stage's gradient collectives of one step, by group: 'dp' / 'edp' the dense and the expert
    weights' (ZeRO-1) gradient reduce-scatter and parameter all-gather, each as (reduce-scatter, all-gather); 'tp'
    the all-reduce of the weights replicated over tp (their partial gradients) and of the gradient norm's tp scalar;
    'ep' the norm's scalar over the EP group. `mem`: stage_memory's dense_params, expert_params, replicated_params."""
    p, c = w.precision, _Costing(w, lay)
    edp, ep = (lay.dp * lay.tp) / (lay.ep * lay.etp), lay.ep * lay.etp
    dense, expert = mem["dense_params"], mem["expert_params"]
    return {"dp": (c.all_gather(dense * p.grad_bytes, c.dp, c.tp), c.all_gather(dense * p.param_bytes, c.dp, c.tp)),
            "edp": (c.all_gather(expert * p.grad_bytes, edp, ep), c.all_gather(expert * p.param_bytes, edp, ep)),
            "tp": c.all_reduce(mem["replicated_params"] * p.grad_bytes, c.tp) + c.all_reduce(FP32, c.tp),
            "ep": c.all_reduce(FP32, c.ep, c.etp)}


def update_time(w: Workload, lay: Layouts, mem: dict, fwd, bwd) -> np.ndarray:
    """Exposed gradient communication plus the optimizer update of one stage, after the pipeline drains, and the
    runtime's separate gradient-accumulation passes; `fwd` / `bwd` are the stage's per-micro-batch times that the
    data-parallel reduce-scatter / all-gather hide behind (the sums over tp and ep run after the backward)."""
    p, c = w.precision, _Costing(w, lay)
    edp = (lay.dp * lay.tp) / (lay.ep * lay.etp)
    dense, expert = mem["dense_params"], mem["expert_params"]
    g = gradient_comm(w, lay, mem)
    rs, ag = g["dp"][0] + g["edp"][0], g["dp"][1] + g["edp"][1]
    exposed = np.maximum(0.0, rs - bwd) + np.maximum(0.0, ag - fwd) if w.overlap_grad_reduce else rs + ag
    exposed = exposed + g["tp"] + g["ep"]
    per_param = p.grad_bytes + 2 * p.optimizer_bytes + 2 * p.master + p.param_bytes
    shards_d = c.dp if w.shard_optimizer else 1.0
    shards_e = edp if w.shard_optimizer else 1.0
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
