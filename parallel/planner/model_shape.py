"""The planner's description of a TeleChat3 / DeepSeek-V3 style decoder: parameter counts, FLOPs, memory.

A shape is an MoE model (routed experts after `first_k_dense` dense layers) or, with no routed experts, a dense
model (every layer dense, `first_k_dense == num_layers`). Attention is Multi-Latent Attention when `kv_lora_rank`
is given, otherwise grouped-query attention (GQA; MHA when the KV heads equal the query heads) over
`num_key_value_heads` heads of `head_dim`.

Everything here is exact integer arithmetic over the model's shapes, so the parameter count can be compared
one-for-one with a real model's trainable parameters. Sharding follows Megatron-Core / MindFormers:
the MLA down-projections (q_a, kv_a), norms and router are replicated across tensor parallelism; q_b, kv_b, o,
GQA's q and o, the dense FFN, the shared expert and the vocabulary (embedding, head) are split by tp; GQA's k and
v are split by KV head over tp, and where tp exceeds the KV heads each head is held by tp / kv ranks (its
copies' gradients summed over tp, like the replicated weights'); routed experts are split by ep * etp; optimizer
states are sharded over the data-parallel replicas of each parameter (ZeRO-1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parallel.layout import ParallelLayout


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    num_layers: int  # dense + MoE main layers, MTP not included
    first_k_dense: int
    num_heads: int
    q_lora_rank: int  # 0 = plain q projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    dense_intermediate: int
    moe_intermediate: int
    shared_intermediate: int
    num_routed_experts: int
    num_shared_experts: int
    top_k: int
    mtp_depth: int
    seq_length: int
    qk_layernorm: bool = True  # RMSNorm on the q and kv latents (q norm only exists when q_lora_rank > 0)
    tie_embeddings: bool = False
    topk_group: int = 0  # group-limited routing: experts of a token in at most this many groups (0: no limit)
    device_aux_loss: bool = False  # the device-level balance loss is on (its statistics are summed over tp)
    z_loss: bool = False  # the router z-loss is on (likewise)
    expert_capacity_factor: float | None = None  # None: dropless (parallel/ep/capacity.py)
    num_key_value_heads: int = 0  # GQA's KV heads (MHA: num_heads); 0 under MLA
    head_dim: int = 0  # GQA's size of a query, key and value head; 0 under MLA

    def __post_init__(self):
        """The combinations the counts below assume, each refused with the field it names."""
        if self.num_routed_experts == 0:
            if self.first_k_dense != self.num_layers:
                raise ValueError(f"first_k_dense: a dense model (num_routed_experts=0) has all {self.num_layers} "
                                 f"layers dense, got first_k_dense={self.first_k_dense}")
            if self.mtp_depth:  # an MTP depth is an MoE layer here; a dense one is not modelled
                raise ValueError(f"mtp_depth: multi-token prediction of a dense model is not modelled, got "
                                 f"{self.mtp_depth}")
        if self.mla:
            if self.num_key_value_heads or self.head_dim:
                raise ValueError("num_key_value_heads: MLA (kv_lora_rank > 0) has no separate KV heads or head_dim")
            return
        if self.q_lora_rank:
            raise ValueError(f"q_lora_rank: a low-rank q projection is MLA's and needs kv_lora_rank > 0, got "
                             f"q_lora_rank={self.q_lora_rank}")
        kv = self.num_key_value_heads
        if kv < 1 or self.num_heads % kv:
            raise ValueError(f"num_key_value_heads: GQA (kv_lora_rank=0) needs KV heads dividing the "
                             f"{self.num_heads} query heads, got {kv}")
        if self.head_dim < 1:
            raise ValueError(f"head_dim: GQA (kv_lora_rank=0) needs a positive head size, got {self.head_dim}")

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense

    @property
    def qk_head_dim(self) -> int:
        """Per head: the size of a query and a key (their dot product), MLA's or GQA's."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.mla else self.head_dim


# ---- parameters of one block ----------------------------------------------------------------------------
def attention_params(s: ModelShape) -> dict[str, int]:
    """Attention parameters split into what tp replicates (norms included), what it shards by query head and, under
    GQA, the k and v projections ('kv', sharded by KV head); 'norms' is the part of 'replicated' that is norm
    weights (MLA's latent norms; GQA's per-head q and k norms, Qwen3's, when qk_layernorm is on)."""
    h, heads = s.hidden_size, s.num_heads
    if not s.mla:
        norms = 2 * s.head_dim * s.qk_layernorm
        return {"replicated": norms, "sharded": 2 * h * heads * s.head_dim,
                "kv": 2 * h * s.num_key_value_heads * s.head_dim, "norms": norms}
    latent_norms = s.kv_lora_rank * s.qk_layernorm
    if s.q_lora_rank > 0:
        replicated = h * s.q_lora_rank + h * (s.kv_lora_rank + s.qk_rope_head_dim)
        latent_norms += s.q_lora_rank * s.qk_layernorm
        sharded = s.q_lora_rank * heads * s.qk_head_dim
    else:
        replicated = h * (s.kv_lora_rank + s.qk_rope_head_dim)
        sharded = h * heads * s.qk_head_dim
    sharded += s.kv_lora_rank * heads * (s.qk_nope_head_dim + s.v_head_dim) + heads * s.v_head_dim * h
    return {"replicated": replicated + latent_norms, "sharded": sharded, "kv": 0, "norms": latent_norms}


def attention_total(s: ModelShape) -> int:
    a = attention_params(s)
    return a["replicated"] + a["sharded"] + a["kv"]


def kv_per_device(s: ModelShape, tp):
    """(GQA's k and v parameters one device holds, of those the copies of heads replicated over tp ranks)."""
    kv = attention_params(s)["kv"]
    if not kv:
        return 0, 0
    held = kv / np.minimum(tp, s.num_key_value_heads)
    return held, np.where(tp > s.num_key_value_heads, held, 0.0)


def dense_ffn_params(s: ModelShape) -> int:
    return 3 * s.hidden_size * s.dense_intermediate


def expert_params(s: ModelShape) -> int:
    """One routed expert (SwiGLU)."""
    return 3 * s.hidden_size * s.moe_intermediate


def shared_expert_params(s: ModelShape) -> int:
    return s.num_shared_experts * 3 * s.hidden_size * s.shared_intermediate


def router_params(s: ModelShape) -> int:
    return s.num_routed_experts * s.hidden_size  # the expert bias is a buffer, not a parameter


def moe_layer_params(s: ModelShape) -> int:
    """One full MoE decoder layer: attention, MoE FFN and its two RMSNorms."""
    return (attention_total(s) + router_params(s) + s.num_routed_experts * expert_params(s)
            + shared_expert_params(s) + 2 * s.hidden_size)


def mtp_module_params(s: ModelShape) -> int:
    """One MTP depth: enorm, hnorm, eh_proj, an MoE decoder layer and its final norm (embedding/head shared)."""
    h = s.hidden_size
    return 2 * h + 2 * h * h + moe_layer_params(s) + h


def parameter_breakdown(s: ModelShape) -> dict[str, int]:
    """Trainable parameters by part, plus total / active figures with and without MTP."""
    h = s.hidden_size
    head = 0 if s.tie_embeddings else s.vocab_size * h
    parts = {
        "embedding": s.vocab_size * h,
        "attention": s.num_layers * attention_total(s),
        "dense_ffn": s.first_k_dense * dense_ffn_params(s),
        "routed_experts": s.num_moe_layers * s.num_routed_experts * expert_params(s),
        "shared_experts": s.num_moe_layers * shared_expert_params(s),
        "router": s.num_moe_layers * router_params(s),
        "norms": s.num_layers * 2 * h + h,
        "mtp": s.mtp_depth * mtp_module_params(s),
        "head": head,
    }
    total = sum(parts.values())
    inactive_per_moe_layer = (s.num_routed_experts - s.top_k) * expert_params(s)
    parts["total"] = total
    parts["total_without_mtp"] = total - parts["mtp"]
    parts["active"] = total - (s.num_moe_layers + s.mtp_depth) * inactive_per_moe_layer
    parts["active_without_mtp"] = parts["total_without_mtp"] - s.num_moe_layers * inactive_per_moe_layer
    return parts


# ---- FLOPs ----------------------------------------------------------------------------------------------
def attention_projection_flops(s: ModelShape) -> int:
    """Forward matmul FLOPs per token of the attention projections (2 per multiply-add; norms ignored)."""
    return 2 * (attention_total(s) - attention_params(s)["norms"])


def attention_core_flops(s: ModelShape, seq_length: int) -> float:
    """Forward FLOPs per token of QK^T and PV under a causal mask: on average a token attends to seq/2 keys."""
    per_key = 2 * s.num_heads * (s.qk_head_dim + s.value_head_dim)
    return per_key * seq_length / 2


def moe_ffn_flops(s: ModelShape) -> int:
    """Forward FLOPs per token of the router, top_k routed experts and the shared expert."""
    return 2 * (router_params(s) + s.top_k * expert_params(s) + shared_expert_params(s))


def head_flops(s: ModelShape) -> int:
    return 2 * s.vocab_size * s.hidden_size


def flops_per_token(s: ModelShape, seq_length: int | None = None) -> dict[str, float]:
    """Training FLOPs per token (forward + backward = 3 x forward), with the forward FLOPs of each part.

    Attention scores/values are counted at `seq_length` (default: the shape's) with causal halving. MTP re-applies
    the shared output head, so its figure includes one more head matmul. The embedding lookup costs no FLOPs.
    """
    seq = s.seq_length if seq_length is None else seq_length
    attn_layer = attention_projection_flops(s) + attention_core_flops(s, seq)
    forward = {
        "attention": s.num_layers * attention_projection_flops(s),
        "attention_core": s.num_layers * attention_core_flops(s, seq),
        "dense_ffn": s.first_k_dense * 2 * dense_ffn_params(s),
        "moe": s.num_moe_layers * moe_ffn_flops(s),
        "head": head_flops(s),
        "mtp": s.mtp_depth * (2 * 2 * s.hidden_size ** 2 + attn_layer + moe_ffn_flops(s) + head_flops(s)),
    }
    fwd_total = sum(forward.values())
    return {**{f"forward_{k}": v for k, v in forward.items()},
            "forward": fwd_total, "training": 3 * fwd_total,
            "training_without_mtp": 3 * (fwd_total - forward["mtp"])}


# ---- per-device parameters and training memory ----------------------------------------------------------
def even_layer_split(num_layers: int, pp: int) -> list[int]:
    """Layers per physical stage, remainder to the middle stages (the ends also hold embedding / head / MTP)."""
    base, extra = divmod(num_layers, pp)
    counts = [base] * pp
    start = (pp - extra) // 2
    for i in range(start, start + extra):
        counts[i] += 1
    return counts


def block_parameters(s: ModelShape, tp, experts_split) -> dict:
    """Parameters one device holds per block kind, given tp and ep*etp (scalars or NumPy arrays).

    'moe_dense' is the attention, norms, router and shared expert of an MoE layer; 'moe_expert' its routed experts;
    'vocab' one vocabulary matrix (embedding or head); 'mtp_dense' / 'mtp_expert' one MTP depth without the head;
    '*_replicated': of the dense parameters of a dense layer, an MoE layer and an MTP depth, those replicated over
    tp (MLA's down-projections and latent norms, the norms, the router, GQA's KV heads where tp exceeds them; their
    gradients are summed over tp).
    """
    h = s.hidden_size
    a = attention_params(s)
    kv_held, kv_copies = kv_per_device(s, tp)
    attn = a["replicated"] + a["sharded"] / tp + kv_held + 2 * h
    moe_dense = attn + router_params(s) + shared_expert_params(s) / tp
    moe_expert = s.num_routed_experts * expert_params(s) / experts_split
    replicated = a["replicated"] + kv_copies + 2 * h
    return {"dense_layer": attn + dense_ffn_params(s) / tp, "moe_dense": moe_dense, "moe_expert": moe_expert,
            "vocab": s.vocab_size * h / tp, "final_norm": h,
            "mtp_dense": 3 * h + 2 * h * h / tp + moe_dense, "mtp_expert": moe_expert,
            "dense_replicated": replicated, "moe_replicated": replicated + router_params(s),
            "mtp_replicated": 3 * h + replicated + router_params(s)}


def dense_layers_in(s: ModelShape, first_layer, count):
    """How many of the layers [first_layer, first_layer + count) are dense (works on NumPy arrays)."""
    return np.clip(np.minimum(first_layer + count, s.first_k_dense) - first_layer, 0, None)


@dataclass(frozen=True)
class StageHolding:
    """What one device of a pipeline stage holds: its decoder layers (any set: an interleaved schedule's chunks are
    not contiguous), whether it holds the first chunk (the embedding) and the last (final norm, head and MTP)."""
    layers: frozenset[int]
    first: bool
    last: bool


def contiguous_stages(counts: list[int]) -> list[StageHolding]:
    """Stages of `counts` consecutive layers each, the embedding on the first, the tail on the last."""
    out, first = [], 0
    for stage, n in enumerate(counts):
        out.append(StageHolding(frozenset(range(first, first + n)), stage == 0, stage == len(counts) - 1))
        first += n
    return out


def _check_stages(s: ModelShape, pp: int, stages: list[StageHolding]) -> None:
    layers = [i for h in stages for i in h.layers]
    if (len(stages) != pp or sorted(layers) != list(range(s.num_layers)) or sum(h.first for h in stages) != 1
            or sum(h.last for h in stages) != 1):
        raise ValueError(f"layers_per_stage: expected {pp} stages holding layers 0..{s.num_layers - 1} once, one "
                         f"first and one last, got {stages}")


def stage_parameters(s: ModelShape, layout: ParallelLayout, layers_per_stage=None,
                     spare_slots: int = 0) -> list[dict[str, float]]:
    """Parameters held by one device of each pipeline stage, split into 'dense' and 'expert' (they shard the
    optimizer over different groups). `layers_per_stage`: layer counts of consecutive stages (default the even
    split), or a StageHolding per stage (the pipeline placement the trainer builds). The first chunk's stage holds
    the embedding, the last chunk's the final norm, head and MTP, and a copy of the embedding for MTP's lookup of
    the next tokens (or as the tied head) where it does not hold the first chunk. `spare_slots`: expert slots per
    rank and MoE layer (MTP's included) beyond its share, for replicas of hot experts (each one expert's weights
    and optimizer state)."""
    if layers_per_stage is None or all(isinstance(n, int) for n in layers_per_stage):
        counts = layers_per_stage or even_layer_split(s.num_layers, layout.pp)
        if len(counts) != layout.pp or sum(counts) != s.num_layers:
            raise ValueError(f"layers_per_stage: expected {layout.pp} stages summing to {s.num_layers}, got {counts}")
        layers_per_stage = contiguous_stages(counts)
    _check_stages(s, layout.pp, layers_per_stage)
    b = block_parameters(s, layout.tp, layout.ep * layout.etp)
    moe_expert = b["moe_expert"] + spare_slots * expert_params(s) / layout.etp
    out = []
    for h in layers_per_stage:
        n_dense = sum(i < s.first_k_dense for i in h.layers)
        n_moe = len(h.layers) - n_dense
        dense = n_dense * b["dense_layer"] + n_moe * b["moe_dense"]
        expert = n_moe * moe_expert
        if h.first or (h.last and (s.mtp_depth > 0 or s.tie_embeddings)):
            dense += b["vocab"]
        if h.last:
            dense += b["final_norm"] + (0 if s.tie_embeddings else b["vocab"]) + s.mtp_depth * b["mtp_dense"]
            expert += s.mtp_depth * moe_expert
        out.append({"dense": dense, "expert": expert})
    return out


def master_copy_bytes(param_bytes: float, master_bytes: float | None = None) -> float:
    """Bytes per parameter of the optimizer's master copy: as given, or by the mixed-precision convention an fp32
    copy where the weights are stored below fp32 (weights in fp32 are their own master)."""
    if master_bytes is not None:
        return master_bytes
    return 4 if param_bytes < 4 else 0


def rank_static_bytes(dense, expert, dense_shards, expert_shards, param_bytes: float, grad_bytes: float,
                      optimizer_bytes_per_param: float, master_bytes: float, accumulate_bytes: float = 0.0) -> dict:
    """THE per-rank static memory: what a rank holding `dense` + `expert` parameters keeps for them, the optimizer
    state divided over `dense_shards` (dp x cp) and `expert_shards` (edp) ranks. Scalars or NumPy arrays (the
    planner's layouts); the dry run, its fit check and the planner's cost model all call this.

    'weights' in their dtype; 'optimizer' Adam's moments plus the master copy, each rank its share; 'grad_buffers'
    the gradients held across micro-batches (`accumulate_bytes` per parameter: the distributed optimizer's float32
    bucket buffers, or the replicated path's accumulators in the weights' dtype; 0 with one micro-batch); 'held'
    what stays allocated between steps (what the trainer measures); 'grads' the step's gradients, alive from the
    backward to the update; 'total' both."""
    params = dense + expert
    row = {"params": params, "weights": params * param_bytes, "grads": params * grad_bytes,
           "optimizer": (optimizer_bytes_per_param + master_bytes) * (dense / dense_shards + expert / expert_shards),
           "grad_buffers": params * accumulate_bytes}
    row["held"] = row["weights"] + row["optimizer"] + row["grad_buffers"]
    row["total"] = row["held"] + row["grads"]
    return row


def training_memory(s: ModelShape, layout: ParallelLayout, param_bytes: float, grad_bytes: float,
                    optimizer_bytes_per_param: float, shard_optimizer: bool, layers_per_stage=None,
                    master_bytes: float | None = None, accumulate_bytes: float = 0.0, spare_slots: int = 0) -> dict:
    """Bytes per device for weights, gradients and optimizer states (`rank_static_bytes`), for the heaviest
    pipeline stage.

    `optimizer_bytes_per_param` is Adam's m and v (8 for fp32 states). The master copy (`master_copy_bytes`) is
    an optimizer state. With `shard_optimizer`, optimizer states are
    split over the dense data-parallel group (dp * cp) and the expert data-parallel group (edp); weights and
    gradients stay whole on every replica (ZeRO-1 / MindFormers' parallel optimizer without gradient sharding).
    """
    master = master_copy_bytes(param_bytes, master_bytes)
    dense_shards = layout.dp * layout.cp if shard_optimizer else 1
    expert_shards = layout.edp if shard_optimizer else 1
    per_stage = [{**p, **rank_static_bytes(p["dense"], p["expert"], dense_shards, expert_shards, param_bytes,
                                           grad_bytes, optimizer_bytes_per_param, master, accumulate_bytes)}
                 for p in stage_parameters(s, layout, layers_per_stage, spare_slots)]
    worst = max(range(len(per_stage)), key=lambda i: per_stage[i]["total"])
    return {**per_stage[worst], "stage": worst, "per_stage": per_stage}


# ---- named shapes --------------------------------------------------------------------------------------------
# TeleChat3-36B, the family's dense model. Given: 64 layers, hidden 6144, 48 query heads over 8 KV heads (GQA) of
# head_dim 128, SwiGLU FFN 24576, vocabulary 131072, untied embedding and head. Assumed, as in Llama-style dense
# decoders: no biases, no q/k norms, two RMSNorms per layer and a final one, no MTP; seq_length 8192 is only the
# default a workload overrides.
TELECHAT3_36B = ModelShape(
    vocab_size=131072, hidden_size=6144, num_layers=64, first_k_dense=64, num_heads=48, q_lora_rank=0,
    kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0, dense_intermediate=24576,
    moe_intermediate=0, shared_intermediate=0, num_routed_experts=0, num_shared_experts=0, top_k=0, mtp_depth=0,
    seq_length=8192, qk_layernorm=False, num_key_value_heads=8, head_dim=128)

# DeepSeek-V3 (arXiv:2412.19437; the config of deepseek-ai/DeepSeek-V3): 61 layers, the first 3 dense, MLA, 256
# routed experts top-8 in at most 4 groups, one shared expert, one MTP depth; seq_length 4096 as pre-trained.
DEEPSEEK_V3 = ModelShape(
    vocab_size=129280, hidden_size=7168, num_layers=61, first_k_dense=3, num_heads=128, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, dense_intermediate=18432,
    moe_intermediate=2048, shared_intermediate=2048, num_routed_experts=256, num_shared_experts=1, top_k=8,
    mtp_depth=1, seq_length=4096, topk_group=4)

# Llama 3 405B (arXiv:2407.21783): 126 dense layers, hidden 16384, 128 query heads over 8 KV heads of 128, FFN
# 53248, vocabulary 128256; seq_length 8192 as pre-trained.
LLAMA3_405B = ModelShape(
    vocab_size=128256, hidden_size=16384, num_layers=126, first_k_dense=126, num_heads=128, q_lora_rank=0,
    kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0, dense_intermediate=53248,
    moe_intermediate=0, shared_intermediate=0, num_routed_experts=0, num_shared_experts=0, top_k=0, mtp_depth=0,
    seq_length=8192, qk_layernorm=False, num_key_value_heads=8, head_dim=128)

# The shapes the planner CLI's --model names.
NAMED_SHAPES = {"telechat3-36b": TELECHAT3_36B, "deepseek-v3": DEEPSEEK_V3, "llama3-405b": LLAMA3_405B}
