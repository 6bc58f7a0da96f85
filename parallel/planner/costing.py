"""The priced primitives of the planner's cost model (cost_model.py's docstring says what each assumes): a GEMM by
roofline, a memory stream, per-operator overhead, the collectives over a group that may span nodes (all-gather,
reduce-scatter, all-reduce, all-to-all), tensor parallelism's collectives and the expert-parallel exchange, as
arrays over many layouts at once."""
from __future__ import annotations

import numpy as np

from parallel.ep.capacity import routed_copies, sent_rows
from parallel.planner import tp_traffic
from parallel.planner.model_shape import kv_per_device
from parallel.planner.workload import FP32, Layouts, Workload


# A blocking device-to-host copy of a few int64 counts before each uneven all-to-all (MoveTo, then AlltoAllV reads
# them on the host), in operator launch gaps (the cluster's op_overhead): assumed, not measured (no Ascend here).
HOST_SYNC_OPS = 10


class Costing:
    """Shared arrays of one (workload, layouts) evaluation and the primitives built on them: GEMMs by roofline,
    memory streams, the collectives, the expert-parallel exchange."""

    def __init__(self, w: Workload, lay: Layouts):
        self.w, self.s, self.c, self.lay = w, w.shape, w.cluster, lay
        c, p = w.cluster, w.precision
        f = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731 - local shorthand
        self.tp, self.ep, self.etp, self.dp = f(lay.tp), f(lay.ep), f(lay.etp), f(lay.dp)
        self.mbs = f(lay.mbs)  # sequences of one micro-batch
        self.cp = f(lay.cp)
        # tokens of one micro-batch a device's tp group computes (one data-parallel replica's, 1/cp of each sequence)
        self.T = self.mbs * w.seq_length / self.cp
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
        """(nodes spanned, members per node) of a group of `size` ranks `stride` apart: a node holds dpn / stride of
        them, or one where the stride reaches past a node (the expert-data-parallel group, ep * etp apart)."""
        per_node = np.clip(np.floor(self.dpn / stride), 1.0, np.maximum(size, 1.0))
        nodes = np.ceil(size / per_node)
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

    def tp_time(self, collectives, direction: str, group=None):
        """Seconds of a piece's tensor-parallel collectives (tp_traffic's) in one direction of the pass, over the tp
        group or over `group` ranks next to each other (tp x cp: the router's sums under context parallelism)."""
        size = self.tp if group is None else group
        t = np.zeros(len(self.lay))
        for c in collectives:
            if c.direction == direction:
                nbytes = c.payload(size, self.role_bytes[c.dtype])
                t = t + (self.all_reduce(nbytes, size) if c.kind == "all_reduce" else
                         self.all_gather(nbytes, size))
        return t

    def tp_comm(self, collectives):
        """(forward, backward) seconds of tp_traffic's collectives of a block (sequence parallel over tp)."""
        return self.tp_time(collectives, "forward"), self.tp_time(collectives, "backward")

    def sp_args(self):
        """tp_traffic's (s, b, t, h) of these layouts (s: the positions a context-parallel rank holds)."""
        return self.w.seq_length / self.cp, self.mbs, self.tp, self.s.hidden_size

    def cp_comm(self):
        """(forward, backward) seconds of one attention block's context-parallel collectives (parallel/cp): the
        all-gather of the keys' and values' source over the cp group (MLA: the normed latent and the rotated shared
        key; GQA: the rank's key and value heads), the reduce-scatter of its gradient in the backward."""
        s = self.s
        width = (s.kv_lora_rank + s.qk_rope_head_dim if s.mla
                 else 2 * kv_per_device(s, self.tp)[0] / (2 * s.hidden_size))
        t = self.all_gather(self.mbs * self.w.seq_length * width * self.ab, self.cp, self.tp)
        return t, t

    def router_comm(self):
        """(forward, backward) seconds of an MoE layer's router statistics summed over the ranks that route a
        sequence's positions: tp, times cp under context parallelism (parallel.cp.ContextParallel.tokens)."""
        group = self.tp * self.cp
        sums = tp_traffic.router_sums(self.mbs, group, self.s.num_routed_experts, self.s.device_aux_loss,
                                      self.s.z_loss)
        return self.tp_time(sums, "forward", group), self.tp_time(sums, "backward", group)

    def context_loss_sums(self, losses: int):
        """Forward seconds of `losses` scalar losses summed over cp (parallel.cp.SumOverContext), 0 at cp = 1."""
        return losses * self.all_reduce(FP32, self.cp)

    def ops(self, n):
        return n * self.c.op_overhead

    def ep_copies(self):
        """(rows one flat EP exchange sends, rows the hierarchical in-node exchange sends) per device and
        micro-batch: the exact exchange's routed copies T/tp x k (after any capacity drop; the most loaded rank
        receives expert_load x the mean) and one pad row per member of the group and token slice
        (parallel/ep/capacity.py)."""
        s, k = self.s, self.s.top_k
        nodes, local = self.group_span(self.ep, self.etp)
        copies = routed_copies(self.Tl, k, s.num_routed_experts, s.expert_capacity_factor) * self.w.expert_load
        return sent_rows(copies, self.ep * self.slices), sent_rows(copies, local * self.slices)

    @property
    def slices(self):
        """Token slices of an MoE layer, each its own exchange: two under EP overlap (model.moe_comm_chunks)."""
        return np.where(self.lay.ep_overlap == 1, 2, 1)

    def ep_all_to_all(self):
        """(forward, backward) seconds of one EP dispatch (token rows in `dispatch_bytes`) plus one combine (in
        activation bytes), including the gather / reduce-scatter over expert tensor parallelism, as the exact
        exchange runs (telechat_moe/moe/dispatch.py): the forward first exchanges the per-expert counts (a
        fixed-shape all-to-all); every uneven all-to-all moves its counts to the host first (HOST_SYNC_OPS, as
        MindFormers' AlltoAllV dispatcher), then the rows. Hierarchical: each token crosses once to each distinct
        node holding any of its experts (with its experts and weights in the residual dtype there, the sums back
        in activation bytes), then the in-node exchange of the copies; node_dedup prices the two legs overlapped."""
        s, h, k, E = self.s, self.s.hidden_size, self.s.top_k, self.s.num_routed_experts
        nodes, local = self.group_span(self.ep, self.etp)
        flat_rows, inner_rows = self.ep_copies()
        rb = float(self.w.precision.residual_bytes)
        # each token crosses to each distinct destination node once (and one pad row goes to every node)
        distinct = nodes * (1 - (1 - 1 / nodes) ** k)
        if s.topk_group:
            distinct = np.minimum(distinct, s.topk_group)
        scheme = self.lay.ep_scheme
        hierarchical = (nodes > 1) & (scheme == 1)
        exchanges = np.where(hierarchical, 4, 2) * self.slices     # uneven all-to-alls: dispatch + combine
        directions = []
        for forward in (True, False):
            total = self.ops((self.ep > 1) * exchanges * 2 * HOST_SYNC_OPS)   # each one's counts, to the host
            if forward:
                total = total + self.slices * np.where(hierarchical, self.all_to_all(nodes * FP32, nodes, self.dpn)
                                                       + self.all_to_all(E / nodes * FP32, local, self.etp),
                                                       self.all_to_all(E * FP32, self.ep, self.etp))
            for leg, nbytes in (("dispatch", self.w.precision.dispatch_bytes or self.ab), ("combine", self.ab)):
                flat = self.all_to_all(flat_rows * h * nbytes, self.ep, self.etp)
                inner = self.all_to_all(inner_rows * h * nbytes, local, self.etp)
                row = (h + 2 * k) * rb if leg == "dispatch" else h * self.ab
                hier = self.all_to_all((self.Tl * distinct + self.slices) * row, nodes, self.dpn) + inner
                crossing = self.Tl * h * nbytes * distinct * (nodes - 1) / nodes
                dedup = (np.maximum(crossing / self.inter_bw, self.Tl * k * h * nbytes * (local - 1) / local
                                    / self.intra_bw) + self.peer_latency(local - 1, nodes - 1))
                total = total + np.where(nodes > 1, np.select([scheme == 1, scheme == 2], [hier, dedup], flat), flat)
                total = total + self.all_gather(self.Tl * k * self.etp * h * nbytes, self.etp)
            directions.append(total)
        return tuple(directions)
