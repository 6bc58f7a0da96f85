"""The model's real trainable parameters equal the planner's count (parameter_breakdown via ModelConfig.to_model_shape),
so the dry run, the planner and the memory model count what the model holds. The expert bias is not trainable and
not counted. Building the Cells compiles nothing, so this is fast."""
import numpy as np
import pytest

from parallel.planner.model_shape import parameter_breakdown
from telechat_moe.config import ModelConfig
from telechat_moe.model import TeleChatMoE

TINY = dict(vocab_size=96, seq_length=16, max_position_embeddings=16, hidden_size=32, num_hidden_layers=3,
            num_attention_heads=2, intermediate_size=40, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=12, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=8,
            moe_shared_expert_intermediate_size=10, first_k_dense_replace=1, num_nextn_predict_layers=1)
VARIANTS = {
    "q_lora_norms_mtp1_dense1": {},
    "q_proj": dict(q_lora_rank=0),
    "no_latent_norms": dict(qk_layernorm=False),
    "q_proj_no_norms_mtp0": dict(q_lora_rank=0, qk_layernorm=False, num_nextn_predict_layers=0),
    "dense2_mtp0": dict(first_k_dense_replace=2, num_nextn_predict_layers=0),
    "two_shared_tied": dict(n_shared_experts=2, tie_word_embeddings=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_trainable_parameters_equal_planner_count(variant):
    cfg = ModelConfig(**{**TINY, **VARIANTS[variant]})
    model = TeleChatMoE(cfg)
    trainable = sum(int(np.prod(p.shape)) for p in model.trainable_params())
    frozen = [p.name for p in model.get_parameters() if not p.requires_grad]
    moe_blocks = cfg.num_moe_layers + cfg.num_nextn_predict_layers
    assert len(frozen) == moe_blocks and all(name.endswith("mlp.gate.expert_bias") for name in frozen)
    assert trainable == parameter_breakdown(cfg.to_model_shape())["total"]
