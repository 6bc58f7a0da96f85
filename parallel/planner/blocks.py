"""The cost of each block kind of the model (dense layer, MoE layer, embedding, head and loss, MTP depth) for one
micro-batch on one device, over many layouts at once: time forward and backward (compute and exposed
communication), recompute, kept and transient activations, parameters. Built on costing.py's primitives; the
assumptions are cost_model.py's docstring."""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from parallel.planner import tp_traffic
from parallel.planner.costing import Costing
from parallel.planner.model_shape import block_parameters, kv_per_device
from parallel.planner.workload import FP32, Layouts, Workload


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


class BlockCosting(Costing):
    """The block kinds priced on one (workload, layouts) evaluation."""

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
        # under cp the keys and values of the whole sequence are made from the gathered latent on every rank
        # (parallel/cp): its projection and the keys and values it makes cover cp times the rank's tokens
        whole = T * self.cp
        proj = [(whole, s.kv_lora_rank, H * (s.qk_nope_head_dim + vd) / tp), (T, H * vd / tp, h),
                (T, h, s.kv_lora_rank + s.qk_rope_head_dim)]
        proj += ([(T, h, s.q_lora_rank), (T, s.q_lora_rank, H * qk / tp)] if s.q_lora_rank else [(T, h, H * qk / tp)])
        latent = s.q_lora_rank + s.kv_lora_rank
        elementwise = 3 * latent + 4 * heads * qk + 2 * heads * s.qk_rope_head_dim
        kept = (2 * (s.kv_lora_rank + s.qk_rope_head_dim) * self.cp + s.q_lora_rank + heads * (qk + vd)
                + heads * (qk + vd) * self.cp)
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

    def dense_layer(self) -> BlockCost:
        s = self.s
        af, ab_, a_rsel, a_full, a_sel, a_elem = self.attention()
        ff, fb, f_elem, f_full, f_sel = self.swiglu_ffn(self.T, s.dense_intermediate / self.tp)
        norm = self.stream(self.ab * self.Tl * 4 * s.hidden_size)
        comm_f, comm_b = (t + c for t, c in zip(self.tp_comm(tp_traffic.dense_layer(*self.sp_args())),
                                                 self.cp_comm()))
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
        # around attention and around the shared expert, the router's sums over tp (x cp), the context gather
        tp_f, tp_b = (t + r + c for t, r, c in zip(self.tp_comm(tp_traffic.moe_layer(*self.sp_args())),
                                                   self.router_comm(), self.cp_comm()))
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
        comm_f = comm_f + self.context_loss_sums(1)     # the head's loss summed over cp
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
    c = BlockCosting(w, lay)
    head = c.head()
    if w.shape.tie_embeddings:  # one shared matrix; on a separate last stage a synchronised copy
        head.dense_params = np.where(lay.pp > 1, head.dense_params, head.dense_params - block_parameters(
            w.shape, c.tp, 1)["vocab"])
    moe = w.shape.num_routed_experts > 0  # a dense model has neither MoE layers nor MTP depths (ModelShape)
    return BlockCosts(dense=c.dense_layer(), moe=c.moe_layer() if moe else c.absent(), embedding=c.embedding(),
                      head=head, mtp=c.mtp() if moe else c.absent())
