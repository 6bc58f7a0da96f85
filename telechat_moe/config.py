"""Model configuration: one dataclass filled from a recipe's `model:` section.

Field names follow MindFormers' TeleChat3 recipe (`pretrain_telechat3_105b_a4b_4k.yaml`) so that users can carry
their settings over unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields


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
    # dense: [s, s] scores with a per-document causal mask; varlen: only the blocks inside each document (cost
    # follows sum of squared document lengths; FlashAttention's actual_seq_len on Ascend)
    attention_kernel: str = "dense"

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
    moe_z_loss_coeff: float = 0.0
    moe_token_dispatcher_type: str = "local"  # local | alltoall | hierarchical (the last two: planner only)

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

    def to_model_shape(self):
        """The planner's own description of this model (parallel/ knows nothing of telechat_moe)."""
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
            tie_embeddings=self.tie_word_embeddings, topk_group=self.topk_group if self.n_group else 0)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


MODEL_FIELDS = {f.name: f for f in fields(ModelConfig)}
