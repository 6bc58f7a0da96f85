"""Dense models and grouped-query attention in the planner: TeleChat3-36B's parameters and FLOPs by formula and
against transformers' own models, GQA's sharding and activations in the cost model, and a search that plans the
dense model at cluster scale."""
import dataclasses

import numpy as np
import pytest

from parallel.layout import ParallelLayout
from parallel.planner import tp_traffic
from parallel.planner.blocks import BlockCosting, block_costs
from parallel.planner.cluster import load_cluster
from parallel.planner.cost_model import evaluate, even_stage, gradient_comm, stage_memory
from parallel.planner.costing import Costing
from parallel.planner.model_shape import (TELECHAT3_36B, ModelShape, block_parameters, flops_per_token,
                                          parameter_breakdown, training_memory)
from parallel.planner.search import search
from parallel.planner.workload import Layouts, Workload

ASCEND = load_cluster("ascend910b")


def dense_gqa(layers=3, hidden=64, heads=8, kv=2, head_dim=16, ffn=96, vocab=1000, qk_norm=False) -> ModelShape:
    """A small dense GQA decoder (Llama's layout; Qwen3's with qk_norm)."""
    return ModelShape(vocab_size=vocab, hidden_size=hidden, num_layers=layers, first_k_dense=layers, num_heads=heads,
                      q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0,
                      dense_intermediate=ffn, moe_intermediate=0, shared_intermediate=0, num_routed_experts=0,
                      num_shared_experts=0, top_k=0, mtp_depth=0, seq_length=128, qk_layernorm=qk_norm,
                      num_key_value_heads=kv, head_dim=head_dim)


def test_telechat3_36b_parameters_by_formula():
    """Every tensor written out: q, k, v, o, SwiGLU's three matrices and two RMSNorms per layer; the embedding, an
    untied head and the final norm."""
    L, h, H, kv, d, F, V = 64, 6144, 48, 8, 128, 24576, 131072
    layer = h * H * d + 2 * h * kv * d + H * d * h + 3 * h * F + 2 * h
    total = L * layer + 2 * V * h + h
    p = parameter_breakdown(TELECHAT3_36B)
    assert p["total"] == p["active"] == total
    assert p["attention"] == L * (2 * h * H * d + 2 * h * kv * d) and p["routed_experts"] == p["router"] == 0
    assert total == pytest.approx(36.2e9, rel=0.01)


@pytest.mark.parametrize("model, kv, qk_norm", [("llama", 2, False), ("llama", 8, False), ("llama", 1, False),
                                                ("qwen3", 2, True)])
def test_dense_gqa_count_equals_transformers(model, kv, qk_norm):
    """transformers' LlamaForCausalLM (MHA at kv = heads, MQA at 1) and Qwen3ForCausalLM (q and k RMSNorms over
    head_dim), built on the meta device, hold exactly the planner's count."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    s = dense_gqa(kv=kv, head_dim=24 if qk_norm else 16, qk_norm=qk_norm)
    config, cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                   "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[model]
    cfg = config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.dense_intermediate,
                 num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=kv,
                 head_dim=s.head_dim, tie_word_embeddings=False)
    with torch.device("meta"):
        net = cls(cfg)
    assert sum(p.numel() for p in net.parameters()) == parameter_breakdown(s)["total"]


def test_telechat3_36b_equals_a_llama_of_its_shape():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    s = TELECHAT3_36B
    cfg = transformers.LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.hidden_size,
                                   intermediate_size=s.dense_intermediate, num_hidden_layers=s.num_layers,
                                   num_attention_heads=s.num_heads, num_key_value_heads=s.num_key_value_heads,
                                   head_dim=s.head_dim, tie_word_embeddings=False)
    with torch.device("meta"):
        net = transformers.LlamaForCausalLM(cfg)
    assert sum(p.numel() for p in net.parameters()) == parameter_breakdown(s)["total"]


def test_flops_per_token_are_six_n_plus_causal_attention():
    """Training FLOPs = 6N (N: the matmul weights, head included, embedding lookup and norms not) plus QK^T and PV
    forward and backward at the causal half of the sequence: 6 L H d S, inside PaLM's 6N + 12 L H d S."""
    L, H, d, S = 64, 48, 128, 8192
    p = parameter_breakdown(TELECHAT3_36B)
    n = p["total"] - p["embedding"] - p["norms"]
    f = flops_per_token(TELECHAT3_36B, S)
    assert f["training"] == pytest.approx(6 * n + 6 * L * H * d * S, rel=1e-12)
    assert 6 * n + 6 * L * H * d * S <= f["training"] <= 6 * n + 12 * L * H * d * S
    assert f["forward_moe"] == f["forward_mtp"] == 0


def test_bad_shapes_name_the_field():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        dense_gqa(kv=3)
    with pytest.raises(ValueError, match="head_dim"):
        dense_gqa(head_dim=0)
    with pytest.raises(ValueError, match="first_k_dense"):
        dataclasses.replace(dense_gqa(), first_k_dense=1)
    with pytest.raises(ValueError, match="mtp_depth"):
        dataclasses.replace(dense_gqa(), mtp_depth=1)


def test_kv_heads_split_over_tp_or_replicated_beyond_them():
    """k and v split by KV head up to tp = kv; beyond, each device holds one whole head, a copy on tp / kv ranks
    whose gradient is summed over tp like the other replicated weights; q, o and the FFN always split by tp."""
    s = dense_gqa(kv=2)
    h, H, d, F = 64, 8, 16, 96
    for tp in (1, 2, 4, 8):
        b = block_parameters(s, tp, 1)
        kv_heads = 2 / min(tp, 2)
        assert b["dense_layer"] == pytest.approx(2 * h * H * d / tp + 2 * h * kv_heads * d + 3 * h * F / tp + 2 * h)
        assert b["dense_replicated"] == pytest.approx(2 * h + (2 * h * d if tp > 2 else 0))
    w = Workload(s, ASCEND, devices=64, seq_length=128, global_batch=64)
    lay = Layouts.of(ParallelLayout(tp=8, dp=8, micro_batch_num=1, micro_batch_size=1))
    mem = stage_memory(w, lay, block_costs(w, lay), even_stage(w, lay, np.array([0])))
    c = Costing(w, lay)
    # the copies' partial gradients: with the norms, all-reduced over tp after the backward
    assert mem["replicated_params"][0] == pytest.approx(3 * (2 * h + 2 * h * d) + h)
    assert gradient_comm(w, lay, mem)["tp"][0] == pytest.approx(
        (c.all_reduce(mem["replicated_params"] * 4, c.tp) + c.all_reduce(4, c.tp))[0])


def test_gqa_tp_collectives_are_a_dense_layers_and_kv_gemms_follow_the_heads():
    """GQA issues the same sequence-parallel collectives as any dense layer (its k and v are column-parallel from
    the gathered input); a device computes k and v for the KV heads it holds, whole heads past tp = kv."""
    s = dense_gqa(kv=2)
    w = Workload(s, ASCEND, devices=64, seq_length=128, global_batch=64)
    for tp in (2, 8):
        lay = Layouts.of(ParallelLayout(tp=tp, dp=64 // tp, micro_batch_num=1, micro_batch_size=1))
        c = BlockCosting(w, lay)
        want = sum(c.all_gather(x.payload(c.tp, 2), c.tp) for x in tp_traffic.dense_layer(*c.sp_args())
                   if x.direction == "forward")
        assert block_costs(w, lay).dense.fwd_comm[0] == pytest.approx(want[0])
        proj = c.attention_shapes()[0]
        assert [float(np.ravel(n)[0]) for _, _, n in proj] == [8 / tp * 16, 2 * 2 / min(tp, 2) * 16, 64]


def test_gqa_keeps_fewer_activations_than_mha_by_its_missing_k_and_v():
    """Without recompute and under selective recompute a layer keeps k and v per KV head: MHA's 8 heads against
    GQA's 2 differ by 2 x 6 heads x head_dim per token (bf16); full recompute keeps the layer input alone."""
    lay = Layouts.of(ParallelLayout(tp=1, dp=8, micro_batch_num=1, micro_batch_size=1))
    acts = [block_costs(Workload(dense_gqa(kv=kv), ASCEND, devices=8, seq_length=128, global_batch=8), lay).dense.act
            for kv in (8, 2)]
    for mode in (0, 1):
        assert acts[0][mode][0] - acts[1][mode][0] == pytest.approx(2 * 128 * 2 * 6 * 16)
    assert acts[0][2][0] == acts[1][2][0]


def test_dense_model_evaluates_and_its_parameters_match_the_counter():
    w = Workload(TELECHAT3_36B, ASCEND, devices=2048, seq_length=8192, global_batch=1024)
    layout = ParallelLayout(tp=8, pp=8, vpp=2, dp=32, micro_batch_num=32, micro_batch_size=1, recompute="selective")
    lay = Layouts.of(layout)
    r = evaluate(w, lay)
    assert all(np.isfinite(v).all() for v in r.values())
    b = block_costs(w, lay)
    assert not b.moe.fwd_compute.any() and not b.mtp.act.any()  # no MoE block, no MTP
    want = training_memory(TELECHAT3_36B, layout, 4, 4, 8, shard_optimizer=True)["per_stage"]
    for s in range(layout.pp):
        got = stage_memory(w, lay, b, even_stage(w, lay, np.array([s])))
        for key in ("weights", "grads", "optimizer"):
            assert got[key][0] == pytest.approx(want[s][key], rel=1e-12), (s, key)


def test_search_plans_telechat3_36b_on_2048_ascend910b_at_seq_8192():
    w = Workload(TELECHAT3_36B, ASCEND, devices=2048, seq_length=8192, global_batch=1024)
    r = search(w)
    order = r.ranked()
    assert len(order) > 0
    assert set(r.layouts.ep) == {1} and set(r.layouts.etp) == {1}  # no experts: expert parallelism means nothing
    assert all(np.isfinite(v).all() for v in r.scores.values())
    best = int(order[0])
    assert r.scores["memory"][best] <= ASCEND.usable_memory
    # a dense 36B model at 8k tokens on Ascend: the best layout uses the GEMMs well, and no layout beats peak
    assert 0.2 < r.scores["mfu"][best] < 1 and (r.scores["mfu"] < 1).all()


def test_the_stage_ilp_places_the_dense_layers_over_every_chunk():
    """No MoE layers to hold the chunks apart: the placement MILP spreads the 64 dense layers over the pipeline, and
    the simulator runs the plan within the memory."""
    from parallel.planner.simulate import simulate_layout
    from parallel.planner.stage_ilp import solve_ilp

    w = Workload(TELECHAT3_36B, ASCEND, devices=2048, seq_length=8192, global_batch=1024)
    layout = ParallelLayout(tp=4, pp=4, vpp=2, dp=128, sp=True, micro_batch_num=8, micro_batch_size=1,
                            recompute="selective", devices_per_node=8)
    a = solve_ilp(w, layout)
    assert a is not None and sum(a.layers_per_stage) == 64 and min(min(c) for c in a.layers_per_chunk) >= 1
    sim = simulate_layout(w, layout, a)
    assert max(sim.memory_per_stage) <= ASCEND.usable_memory and sim.step_time > 0
