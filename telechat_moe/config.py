"""Model configuration: one dataclass filled from a recipe's `model:` section.

Field names follow MindFormers' TeleChat3 recipe (`pretrain_telechat3_105b_a4b_4k.yaml`) so that users can carry
their settings over unchanged. `ModelConfig.validate()` holds the invariants of the model itself; the recipe adds
the checks that relate it to the parallel layout, the data and the device.

Imports point one way: this module uses the libraries (parallel/, data_sched/, ...), which import nothing from
telechat_moe; the planner describes a model by its own `ModelShape`, which `to_model_shape()` produces.
"""
from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass, fields

from telechat_moe.errors import require

# The planner prices all three schemes; training builds only the local one (telechat_moe/moe/dispatch.py).
DISPATCHERS = ("local", "alltoall", "hierarchical")
DROP_POLICIES = ("probs", "position")       # parallel/ep/capacity.drop_over_capacity


@dataclass
class ModelConfig:
    vocab_size: int = 131072
    seq_length: int = 4096
    hidden_size: int = 2560
    num_hidden_layers: int = 45
    num_attention_heads: int = 32
    intermediate_size: int = 7680            # dense SwiGLU FFN of the first `first_k_dense_replace` layers
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.01
    tie_word_embeddings: bool = False

    # Multi-Latent Attention
    q_lora_rank: int = 1536                  # 0: queries through one plain projection
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_layernorm: bool = True                # RMSNorm on the q and kv latents
    # flash: blockwise attention that never holds [s, s] scores, only the blocks inside each document (cost follows
    # the sum of squared document lengths; FlashAttentionScore with actual_seq_len on Ascend; docs/attention.md);
    # dense: [s, s] scores with a per-document causal mask
    attention_kernel: str = "flash"

    # RoPE with optional YaRN scaling (rotary_scaling_factor > 1)
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rotary_scaling_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    # MoE
    first_k_dense_replace: int = 1
    n_routed_experts: int = 192
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    moe_intermediate_size: int = 1536
    moe_shared_expert_intermediate_size: int = 1536
    routed_scaling_factor: float = 2.8
    scoring_func: str = "sigmoid"             # sigmoid | softmax
    norm_topk_prob: bool = True
    n_group: int = 0                          # group-limited routing (0: off)
    topk_group: int = 0
    moe_router_enable_expert_bias: bool = True
    moe_router_bias_update_rate: float = 1e-3
    moe_aux_loss_coeff: float = 1e-3          # sequence-level auxiliary loss
    moe_device_aux_loss_coeff: float = 0.0    # device-level (EP-group) balance loss, DeepSeek-V2 (0: off)
    moe_z_loss_coeff: float = 0.0
    # how token copies reach experts on other ranks when expert_parallel > 1: alltoall | hierarchical (local: all
    # experts on every rank, expert_parallel=1 only); at expert_parallel=1 every kind is the one-device dispatcher
    moe_token_dispatcher_type: str = "alltoall"
    moe_comm_chunks: int = 1                  # token slices whose exchanges can overlap other slices' experts
    # dropless when unset; c: an expert takes at most ceil(c * T * k / E) of the copies routed from a rank's T tokens
    # (per token slice), the rest dropped by moe_token_drop_policy (probs: lowest weights; position: latest tokens).
    # It bounds the dispatchers' static buffers (parallel/ep/capacity.py); which copies drop depends on the layout.
    moe_expert_capacity_factor: float | None = None
    moe_token_drop_policy: str = "probs"

    # Multi-token prediction
    num_nextn_predict_layers: int = 1
    mtp_loss_factor: float = 0.2

    # dtypes: parameters, compute and attention softmax; the router and RMSNorm always run in float32, as MindFormers'
    # recipe keeps them, so their two keys accept only float32
    params_dtype: str = "float32"
    compute_dtype: str = "float32"
    softmax_compute_dtype: str = "float32"
    layernorm_compute_dtype: str = "float32"
    router_dense_type: str = "float32"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    def is_moe_layer(self, index: int) -> bool:
        """MTP blocks (index >= num_hidden_layers) are MoE layers, as in DeepSeek-V3."""
        return index >= self.first_k_dense_replace

    @property
    def yarn_enabled(self) -> bool:
        return self.rotary_scaling_factor > 1.0

    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.yarn_enabled and self.mscale_all_dim:
            m = yarn_mscale(self.rotary_scaling_factor, self.mscale_all_dim)
            scale *= m * m
        return scale

    def validate(self) -> None:
        """The invariants of the model itself, whatever the layout: raises RecipeError naming `model.<key>`."""
        for key in ("vocab_size", "seq_length", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                    "num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings",
                    "original_max_position_embeddings"):
            require(getattr(self, key) >= 1, f"model.{key}: expected a positive integer, got {getattr(self, key)}")
        for key in ("q_lora_rank", "first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers"):
            require(getattr(self, key) >= 0, f"model.{key}: expected 0 or more, got {getattr(self, key)}")
        require(self.num_experts_per_tok <= self.n_routed_experts,
                 f"model.num_experts_per_tok: top-{self.num_experts_per_tok} needs at least that many experts "
                 f"(n_routed_experts={self.n_routed_experts})")
        require(self.first_k_dense_replace <= self.num_hidden_layers,
                 f"model.first_k_dense_replace: {self.first_k_dense_replace} exceeds "
                 f"num_hidden_layers={self.num_hidden_layers}")
        require(self.qk_rope_head_dim % 2 == 0,
                 f"model.qk_rope_head_dim: RoPE needs an even size, got {self.qk_rope_head_dim}")
        require(self.first_k_dense_replace == 0 or self.intermediate_size >= 1,
                 "model.intermediate_size: dense layers need a positive FFN size")
        require(self.n_shared_experts == 0 or self.moe_shared_expert_intermediate_size >= 1,
                 f"model.moe_shared_expert_intermediate_size: {self.n_shared_experts} shared expert(s) need a "
                 f"positive FFN size, got {self.moe_shared_expert_intermediate_size}")
        require(self.moe_token_dispatcher_type in DISPATCHERS,
                 f"model.moe_token_dispatcher_type: expected one of {', '.join(DISPATCHERS)}, "
                 f"got {self.moe_token_dispatcher_type!r}")
        require(isinstance(self.moe_comm_chunks, int) and self.moe_comm_chunks >= 1
                and self.seq_length % self.moe_comm_chunks == 0,
                f"model.moe_comm_chunks: expected a positive divisor of seq_length={self.seq_length}, "
                f"got {self.moe_comm_chunks!r}")
        require(self.attention_kernel in ("flash", "dense"),
                 f"model.attention_kernel: expected flash or dense, got {self.attention_kernel!r}")
        require(self.scoring_func in ("sigmoid", "softmax"),
                 f"model.scoring_func: expected sigmoid or softmax, got {self.scoring_func!r}")
        for key in ("params_dtype", "compute_dtype", "softmax_compute_dtype"):
            require(getattr(self, key) in ("float32", "float16", "bfloat16"),
                     f"model.{key}: expected float32, float16 or bfloat16, got {getattr(self, key)!r}")
        # Accepted for MindFormers recipes, which set them to float32; the model keeps these parts in float32 always.
        for key, part in (("router_dense_type", "the router's logits"), ("layernorm_compute_dtype", "RMSNorm")):
            require(getattr(self, key) == "float32",
                     f"model.{key}: expected float32 ({part} is always computed in float32), "
                     f"got {getattr(self, key)!r}")
        if self.n_group:
            require(self.n_routed_experts % self.n_group == 0,
                     f"model.n_group: {self.n_group} groups must divide n_routed_experts={self.n_routed_experts}")
            require(1 <= self.topk_group <= self.n_group,
                     f"model.topk_group: expected 1..n_group={self.n_group}, got {self.topk_group}")
            require(self.topk_group * (self.n_routed_experts // self.n_group) >= self.num_experts_per_tok,
                     "model.topk_group: the chosen groups hold fewer experts than num_experts_per_tok")
        require(self.rope_theta > 1, f"model.rope_theta: expected a RoPE base above 1, got {self.rope_theta}")
        require(self.rotary_scaling_factor >= 1,
                 f"model.rotary_scaling_factor: expected 1 (no YaRN) or more, got {self.rotary_scaling_factor}")
        if self.yarn_enabled:
            # YaRN interpolates the dimensions turning fewer than beta_slow times over the original context and
            # keeps those turning more than beta_fast times; the other order inverts the ramp, and log() needs both
            # positive.
            require(self.beta_slow > 0, f"model.beta_slow: expected > 0 for YaRN, got {self.beta_slow}")
            require(self.beta_fast >= self.beta_slow,
                     f"model.beta_fast: expected at least beta_slow={self.beta_slow} for YaRN, got {self.beta_fast}")
        require(self.max_position_embeddings >= self.seq_length or self.yarn_enabled,
                 f"model.seq_length: {self.seq_length} exceeds max_position_embeddings="
                 f"{self.max_position_embeddings} without YaRN (rotary_scaling_factor > 1)")
        require(self.moe_expert_capacity_factor is None or (
            isinstance(self.moe_expert_capacity_factor, (int, float)) and not isinstance(
                self.moe_expert_capacity_factor, bool) and self.moe_expert_capacity_factor > 0),
                f"model.moe_expert_capacity_factor: expected a positive number or null (dropless), "
                f"got {self.moe_expert_capacity_factor!r}")
        require(self.moe_token_drop_policy in DROP_POLICIES,
                f"model.moe_token_drop_policy: expected one of {', '.join(DROP_POLICIES)}, "
                f"got {self.moe_token_drop_policy!r}")
        require(self.mtp_loss_factor >= 0, f"model.mtp_loss_factor: expected >= 0, got {self.mtp_loss_factor}")
        require(self.moe_device_aux_loss_coeff >= 0,
                 f"model.moe_device_aux_loss_coeff: expected >= 0, got {self.moe_device_aux_loss_coeff}")

    def function(self) -> dict:
        """The fields that define the function the model computes: all but how tokens travel to experts, which a
        run may change without changing a result (tensor dumps hash this, so runs of any dispatcher align)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in ("moe_token_dispatcher_type", "moe_comm_chunks")}

    def to_model_shape(self):
        """The planner's own description of this model (a plain dataclass of parallel/, which imports nothing from
        telechat_moe)."""
        from parallel.planner.model_shape import ModelShape
        return ModelShape(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_hidden_layers,
            first_k_dense=self.first_k_dense_replace, num_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            dense_intermediate=self.intermediate_size, moe_intermediate=self.moe_intermediate_size,
            shared_intermediate=self.moe_shared_expert_intermediate_size, num_routed_experts=self.n_routed_experts,
            num_shared_experts=self.n_shared_experts, top_k=self.num_experts_per_tok,
            mtp_depth=self.num_nextn_predict_layers, seq_length=self.seq_length, qk_layernorm=self.qk_layernorm,
            tie_embeddings=self.tie_word_embeddings, topk_group=self.topk_group if self.n_group else 0,
            device_aux_loss=self.moe_device_aux_loss_coeff > 0, z_loss=self.moe_z_loss_coeff > 0,
            expert_capacity_factor=self.moe_expert_capacity_factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


MODEL_FIELDS = {f.name: f for f in fields(ModelConfig)}
