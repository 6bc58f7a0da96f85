"""Parameter counts, FLOPs and memory of the planner's ModelShape against published figures and invariants."""
import pytest

from parallel.layout import ParallelLayout
from parallel.planner.model_shape import (ModelShape, StageHolding, block_parameters, contiguous_stages,
                                          expert_params, flops_per_token, parameter_breakdown, stage_parameters,
                                          training_memory)

TELECHAT3_105B = ModelShape(
    vocab_size=131072, hidden_size=2560, num_layers=45, first_k_dense=1, num_heads=32, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, dense_intermediate=7680,
    moe_intermediate=1536, shared_intermediate=1536, num_routed_experts=192, num_shared_experts=1, top_k=4,
    mtp_depth=1, seq_length=4096)

DEEPSEEK_V3 = ModelShape(
    vocab_size=129280, hidden_size=7168, num_layers=61, first_k_dense=3, num_heads=128, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, dense_intermediate=18432,
    moe_intermediate=2048, shared_intermediate=2048, num_routed_experts=256, num_shared_experts=1, top_k=8,
    mtp_depth=1, seq_length=4096)

TINY = ModelShape(vocab_size=1000, hidden_size=64, num_layers=4, first_k_dense=1, num_heads=4, q_lora_rank=32,
                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, dense_intermediate=96,
                  moe_intermediate=32, shared_intermediate=32, num_routed_experts=8, num_shared_experts=1,
                  top_k=2, mtp_depth=1, seq_length=128)


def test_telechat3_105b_published_totals():
    p = parameter_breakdown(TELECHAT3_105B)
    assert p["total"] == pytest.approx(105e9, rel=0.02)
    assert p["active"] == pytest.approx(4.7e9, rel=0.05)


def test_deepseek_v3_published_totals():
    p = parameter_breakdown(DEEPSEEK_V3)
    assert p["total_without_mtp"] == pytest.approx(671e9, rel=0.02)
    assert p["active_without_mtp"] == pytest.approx(37e9, rel=0.02)
    # DeepSeek's "14B MTP module weights" include the embedding and head it shares with the main model
    assert p["mtp"] + p["embedding"] + p["head"] == pytest.approx(14e9, rel=0.05)


def test_tiny_count_by_hand():
    """Every tensor of the tiny model written out, so a change of convention shows up as a number."""
    h, v, heads = 64, 1000, 4
    attn = h * 32 + 32 + 32 * heads * 12 + h * (16 + 4) + 16 + 16 * heads * (8 + 8) + heads * 8 * h
    moe = 8 * h + 8 * 3 * h * 32 + 3 * h * 32
    layer_dense, layer_moe = attn + 3 * h * 96 + 2 * h, attn + moe + 2 * h
    mtp = 2 * h + 2 * h * h + layer_moe + h
    total = 2 * v * h + h + layer_dense + 3 * layer_moe + mtp
    p = parameter_breakdown(TINY)
    assert p["total"] == total
    assert p["active"] == total - 4 * 6 * 3 * h * 32
    assert sum(p[k] for k in ("embedding", "attention", "dense_ffn", "routed_experts", "shared_experts",
                              "router", "norms", "mtp", "head")) == total


def test_plain_q_projection_and_no_latent_norms():
    s = ModelShape(**{**TINY.__dict__, "q_lora_rank": 0, "qk_layernorm": False, "tie_embeddings": True})
    h, heads = 64, 4
    attn = h * heads * 12 + h * (16 + 4) + 16 * heads * 16 + heads * 8 * h
    assert parameter_breakdown(s)["attention"] == 4 * attn
    assert parameter_breakdown(s)["head"] == 0


def test_training_flops_near_six_times_active_plus_attention():
    f = flops_per_token(DEEPSEEK_V3, seq_length=4096)
    p = parameter_breakdown(DEEPSEEK_V3)
    matmul_params = p["active_without_mtp"] - p["embedding"] - p["norms"]
    attn_core = 3 * f["forward_attention_core"]
    assert f["training_without_mtp"] - attn_core == pytest.approx(6 * matmul_params, rel=1e-3)
    # attention scores grow linearly with the sequence length; the rest does not move
    f2 = flops_per_token(DEEPSEEK_V3, seq_length=8192)
    assert f2["forward_attention_core"] == pytest.approx(2 * f["forward_attention_core"])
    assert f2["forward_moe"] == f["forward_moe"]


def test_stage_parameters_add_up_without_sharding():
    """Every parameter once, and the last stage's copy of the embedding that MTP looks the next tokens up in."""
    layout = ParallelLayout(pp=4, micro_batch_num=4)
    stages = stage_parameters(TELECHAT3_105B, layout)
    p = parameter_breakdown(TELECHAT3_105B)
    assert sum(st["dense"] + st["expert"] for st in stages) == p["total"] + p["embedding"]
    one = stage_parameters(TELECHAT3_105B, ParallelLayout())
    assert one[0]["dense"] + one[0]["expert"] == p["total"]


def test_stages_of_an_interleaved_placement_and_spare_expert_slots():
    """A stage holding any set of layers (an interleaved schedule's chunks) counts what it holds: stage 0 the
    embedding and MoE layers 1 and 3, stage 1 the dense layer 0, MoE layer 2, the tail and the embedding's copy;
    a spare expert slot adds one expert per MoE layer, MTP's included."""
    layout = ParallelLayout(pp=2, micro_batch_num=2)
    held = [StageHolding(frozenset({1, 3}), True, False), StageHolding(frozenset({0, 2}), False, True)]
    b = block_parameters(TINY, 1, 1)
    for spare in (0, 1):
        s0, s1 = stage_parameters(TINY, layout, held, spare)
        expert = b["moe_expert"] + spare * expert_params(TINY)
        assert s0 == {"dense": b["vocab"] + 2 * b["moe_dense"], "expert": 2 * expert}
        assert s1 == {"dense": b["dense_layer"] + b["moe_dense"] + b["final_norm"] + 2 * b["vocab"]
                      + b["mtp_dense"], "expert": 2 * expert}
    assert stage_parameters(TINY, layout, [3, 1]) == stage_parameters(TINY, layout, contiguous_stages([3, 1]))
    with pytest.raises(ValueError, match="layers_per_stage"):
        stage_parameters(TINY, layout, [StageHolding(frozenset({0, 1, 2}), True, True),
                                        StageHolding(frozenset({3}), True, False)])


def test_experts_split_by_ep_times_etp_and_optimizer_by_data_parallel_groups():
    base = ParallelLayout(dp=16, tp=2, pp=4, ep=8, micro_batch_num=4)
    wide = ParallelLayout(dp=16, tp=2, pp=4, ep=8, etp=2, micro_batch_num=4)
    a, b = stage_parameters(TELECHAT3_105B, base), stage_parameters(TELECHAT3_105B, wide)
    for x, y in zip(a, b):
        assert y["expert"] == pytest.approx(x["expert"] / 2)
        assert y["dense"] == x["dense"]
    m = training_memory(TELECHAT3_105B, base, param_bytes=2, grad_bytes=4, optimizer_bytes_per_param=8,
                        shard_optimizer=True)
    st = a[m["stage"]]
    assert m["weights"] == pytest.approx(2 * (st["dense"] + st["expert"]))
    assert m["grads"] == pytest.approx(4 * (st["dense"] + st["expert"]))
    # bf16 weights get a 4-byte master copy beside Adam's m and v; dense states over dp, experts over edp=4
    assert m["optimizer"] == pytest.approx(12 * (st["dense"] / 16 + st["expert"] / 4))
    unsharded = training_memory(TELECHAT3_105B, base, 4, 4, 8, shard_optimizer=False)
    assert unsharded["optimizer"] == pytest.approx(8 * (unsharded["params"]))


def test_bad_layers_per_stage_named():
    with pytest.raises(ValueError, match="layers_per_stage"):
        stage_parameters(TINY, ParallelLayout(pp=2, micro_batch_num=2), [1, 1])
