"""The priced primitives of the planner's cost model (cost_model.py's docstring says what each assumes): a GEMM by
roofline, a memory stream, per-operator overhead, the collectives over a group that may span nodes (all-gather,
reduce-scatter, all-reduce, all-to-all), tensor parallelism's collectives and the expert-parallel exchange, as
arrays over many layouts at once."""
from __future__ import annotations

import numpy as np

from parallel.ep.capacity import exchange_rows
from parallel.planner import tp_traffic
from parallel.planner.workload import FP32, Layouts, Workload


class Costing:
    """Shared arrays of one (workload, layouts) evaluation and the primitives built on them: GEMMs by roofline,
    memory streams, the collectives, the expert-parallel exchange."""

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
