"""The vectorised cost model: consistent with itself, with the parameter counter, with the pipeline schedules and
with the event-driven simulator; and its trade-offs point the right way."""
import dataclasses

import numpy as np
import pytest

from parallel.layout import ParallelLayout
from parallel.optim.memory import accumulate_bytes, uses_distributed
from parallel.pipeline.schedules import build, validate
from parallel.planner.blocks import block_costs
from parallel.planner.cluster import load_cluster
from parallel.planner.cost_model import (evaluate, even_stage, gradient_comm, in_flight, p2p_time, stage_memory,
                                         stage_time, step_time, update_time)
from parallel.planner.costing import Costing
from parallel.planner.model_shape import training_memory
from parallel.planner.search import enumerate_layouts
from parallel.planner.simulate import simulate_layout
from parallel.planner.workload import FP32, Layouts, Workload
from tests.test_planner_model_shape import TELECHAT3_105B

W = Workload(TELECHAT3_105B, load_cluster("ascend910b"), devices=256, seq_length=4096, global_batch=512)


@pytest.fixture(scope="module")
def sample():
    lay, _ = enumerate_layouts(W)
    pick = np.random.default_rng(0).choice(len(lay), 40, replace=False)
    return lay.take(pick)


def test_vectorised_equals_one_by_one(sample):
    together = evaluate(W, sample)
    for i in range(len(sample)):
        alone = evaluate(W, Layouts.of(sample.row(i)))
        for key in together:
            assert together[key][i] == pytest.approx(alone[key][0], rel=1e-12), key


def test_representative_stages_give_the_slowest_and_fullest_stage(sample):
    r = evaluate(W, sample)
    b = block_costs(W, sample)
    times, mems, updates, work = [], [], [], 0.0
    for s in range(int(sample.pp.max())):
        st = even_stage(W, sample, np.full(len(sample), s))
        f, bw = stage_time(W, b, st)
        mem = stage_memory(W, sample, b, st)
        live = s < sample.pp  # stages beyond a layout's pp are clipped copies of its last one
        times.append(np.where(live, f + bw, 0.0))
        mems.append(np.where(live, mem["total"], 0.0))
        updates.append(np.where(live, update_time(W, sample, mem, f, bw), 0.0))
        work = work + np.where(live, f + bw, 0.0)
    pipe = step_time(sample.m, sample.vpp, sample.pp, np.max(times, axis=0), work, p2p_time(W, sample))
    np.testing.assert_allclose(r["memory"], np.max(mems, axis=0), rtol=1e-12)
    np.testing.assert_allclose(r["step_time"], pipe + np.max(updates, axis=0), rtol=1e-9)


@pytest.mark.parametrize("tp, pp, ep, etp", [(1, 1, 1, 1), (2, 4, 8, 1), (8, 4, 4, 2), (4, 8, 16, 2)])
def test_weights_grads_optimizer_match_the_parameter_counter(tp, pp, ep, etp):
    dp = W.devices // (tp * pp)
    lay = Layouts.of(ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, micro_batch_num=max(pp, 2)))
    b = block_costs(W, lay)
    layout = ParallelLayout(dp=dp, tp=tp, pp=pp, ep=ep, etp=etp, micro_batch_num=max(pp, 2))
    # the gradients held between micro-batches by the trainer's rule, as the dry run asks it (parallel/optim/memory)
    held = accumulate_bytes(uses_distributed(True, dp, layout.edp, "float32"), layout.micro_batch_num, pp > 1, 4)
    assert held == 4.0      # m >= 2: the distributed optimizer's float32 buckets, or float32 weights' accumulators
    want = training_memory(TELECHAT3_105B, layout, 4, 4, 8, shard_optimizer=True, accumulate_bytes=held)["per_stage"]
    for s in range(pp):
        got = stage_memory(W, lay, b, even_stage(W, lay, np.array([s])))
        for key in ("weights", "grads", "optimizer", "grad_buffers"):
            assert got[key][0] == pytest.approx(want[s][key], rel=1e-12), (s, key)
        assert got["static"][0] == pytest.approx(want[s]["total"], rel=1e-12), s


@pytest.mark.parametrize("p, v, m", [(2, 1, 5), (4, 1, 4), (4, 1, 9), (4, 2, 4), (4, 2, 12), (8, 3, 16), (3, 4, 9)])
def test_in_flight_matches_the_schedule(p, v, m):
    peaks = validate(build("interleaved" if v > 1 else "1f1b", p, v, m)).peak_in_flight
    lay = Layouts.of(ParallelLayout(pp=p, vpp=v, micro_batch_num=m))
    assert [in_flight(lay, s)[0] * v for s in range(p)] == pytest.approx(list(peaks))


@pytest.mark.parametrize("layout", [
    ParallelLayout(tp=4, pp=4, vpp=1, dp=16, ep=16, etp=1, micro_batch_size=1, micro_batch_num=32, recompute="none",
                   ep_scheme="flat", ep_overlap=False),
    ParallelLayout(tp=2, pp=8, vpp=1, dp=16, ep=8, etp=2, micro_batch_size=1, micro_batch_num=32,
                   recompute="selective", ep_scheme="flat", ep_overlap=True),
    ParallelLayout(tp=8, pp=4, vpp=3, dp=8, ep=64, etp=1, micro_batch_size=1, micro_batch_num=64, recompute="full",
                   ep_scheme="hierarchical", ep_overlap=True),
    ParallelLayout(tp=4, pp=8, vpp=2, dp=8, ep=32, etp=1, micro_batch_size=2, micro_batch_num=32,
                   recompute="selective", ep_scheme="flat", ep_overlap=False),
])
def test_analytic_step_and_memory_close_to_the_simulator(layout):
    analytic = evaluate(W, Layouts.of(layout))
    sim = simulate_layout(W, layout)
    assert analytic["step_time"][0] == pytest.approx(sim.step_time, rel=0.08)
    assert analytic["memory"][0] == pytest.approx(max(sim.memory_per_stage), rel=0.15)


def test_recompute_trades_memory_for_time():
    rows = [Layouts.of(ParallelLayout(tp=4, pp=4, dp=16, ep=16, micro_batch_num=32, recompute=r))
            for r in ("none", "selective", "full")]
    results = [evaluate(W, lay) for lay in rows]
    mem = [r["memory"][0] for r in results]
    time = [r["step_time"][0] for r in results]
    assert mem[0] > mem[1] > mem[2]
    assert time[0] < time[1] < time[2]


def test_ep_overlap_never_slower_and_hierarchical_pays_off_only_for_wide_routing():
    base = ParallelLayout(tp=1, pp=1, dp=256, ep=32, micro_batch_num=2, micro_batch_size=1)
    for k in (2, 8):
        w = dataclasses.replace(W, shape=dataclasses.replace(TELECHAT3_105B, top_k=k))
        flat, hier, overlap = (block_costs(w, Layouts.of(dataclasses.replace(base, ep_scheme=s, ep_overlap=o))).moe
                               for s, o in (("flat", False), ("hierarchical", False), ("flat", True)))
        assert overlap.fwd_comm[0] <= flat.fwd_comm[0]
        # 32 ranks on 4 nodes: flat sends top_k * 3/4 copies of a token across nodes, hierarchical 3
        assert (hier.fwd_comm[0] < flat.fwd_comm[0]) == (k * 3 / 4 > 3)


def test_an_uneven_expert_placement_slows_the_moe_layer_by_its_expert_compute():
    lay = Layouts.of(ParallelLayout(tp=1, pp=1, dp=256, ep=32, micro_batch_num=2, micro_batch_size=1))
    even, skewed = (block_costs(dataclasses.replace(W, expert_load=f), lay).moe for f in (1.0, 1.5))
    c = Costing(W, lay)
    # the most loaded rank's grouped GEMMs: 1.5x the rows of each local expert
    rows = c.Tl * W.shape.top_k / (W.shape.num_routed_experts / c.ep)
    e1 = [c.gemm(r, W.shape.hidden_size, 2 * W.shape.moe_intermediate, W.shape.num_routed_experts / c.ep)[0]
          for r in (rows, 1.5 * rows)]
    assert skewed.fwd_compute[0] - even.fwd_compute[0] >= (e1[1] - e1[0])[0] > 0
    assert skewed.bwd_compute[0] > even.bwd_compute[0]
    # the exchange of the routed copies waits for the most loaded receiver
    assert skewed.fwd_comm[0] > even.fwd_comm[0]
    steps = [evaluate(dataclasses.replace(W, expert_load=f), lay)["step_time"][0] for f in (1.0, 1.2, 1.5)]
    assert steps[0] < steps[1] < steps[2]


def test_tensor_and_expert_parallelism_shrink_weights():
    one = evaluate(W, Layouts.of(ParallelLayout(tp=1, pp=4, dp=64, ep=8, micro_batch_num=8)))["memory"][0]
    tp = evaluate(W, Layouts.of(ParallelLayout(tp=4, pp=4, dp=16, ep=8, micro_batch_num=8)))["memory"][0]
    ep = evaluate(W, Layouts.of(ParallelLayout(tp=1, pp=4, dp=64, ep=64, micro_batch_num=8)))["memory"][0]
    assert tp < one and ep < one


def test_tensor_parallel_terms_are_priced_where_the_model_issues_them():
    """tp_traffic's collectives through the cost model's own all_gather / all_reduce: a dense layer's four sequence
    collectives each way as before; the embedding's collectives on the first stage, the head's cross-entropy
    statistics forward only, the router's sums (and the expert exchange's counts) in an MoE layer's forward; the
    weights replicated over tp (those whose count does not shrink with tp) all-reduced after the backward, never
    hidden behind it (the data-parallel reduce-scatter is)."""
    lay = Layouts.of(ParallelLayout(tp=8, pp=1, dp=32, ep=8, micro_batch_num=4, micro_batch_size=1))
    one = Layouts.of(ParallelLayout(tp=1, pp=1, dp=256, ep=8, micro_batch_num=4, micro_batch_size=1))
    c, b, h = Costing(W, lay), block_costs(W, lay), TELECHAT3_105B.hidden_size
    T, E = W.seq_length, TELECHAT3_105B.num_routed_experts
    gather = c.all_gather(T * h * W.precision.activation_bytes, c.tp)
    assert b.dense.fwd_comm[0] == pytest.approx(4 * gather[0], rel=1e-12) == b.dense.bwd_comm[0]
    residual = c.all_gather(T * h * W.precision.residual_bytes, c.tp)[0]
    assert b.embedding.fwd_comm[0] == pytest.approx(residual, rel=1e-12) == b.embedding.bwd_comm[0]
    stats = c.all_gather(8 * T * FP32, c.tp) + 2 * c.all_reduce(T * FP32, c.tp)
    assert b.head.fwd_comm[0] - b.head.bwd_comm[0] == pytest.approx(stats[0], rel=1e-12)
    router = 2 * c.all_reduce(E * FP32, c.tp) + c.all_to_all(E * FP32, c.ep, c.etp)
    assert b.moe.fwd_comm[0] - b.moe.bwd_comm[0] == pytest.approx(router[0], rel=1e-12)
    st = even_stage(W, lay, np.array([0]))
    first = stage_time(W, b, st)[0] - stage_time(W, b, dataclasses.replace(st, embedding=np.zeros(1)))[0]
    assert first[0] == pytest.approx(b.embedding.fwd_compute[0] + residual, rel=1e-12)

    mem, mem1 = (stage_memory(W, x, block_costs(W, x), even_stage(W, x, np.array([0]))) for x in (lay, one))
    replicated = (8 * mem["dense_params"] - mem1["dense_params"]) / 7    # dense = replicated + split / tp
    assert mem["replicated_params"][0] == pytest.approx(replicated[0], rel=1e-12)
    tp_sum = c.all_reduce(mem["replicated_params"] * W.precision.grad_bytes, c.tp) + c.all_reduce(FP32, c.tp)
    assert gradient_comm(W, lay, mem)["tp"][0] == pytest.approx(tp_sum[0], rel=1e-12)
    long = np.full(1, 1e6)      # a backward that hides any data-parallel reduce-scatter
    without = {**mem, "replicated_params": np.zeros(1)}
    exposed = update_time(W, lay, mem, long, long) - update_time(W, lay, without, long, long)
    replicated_sum = c.all_reduce(mem["replicated_params"] * W.precision.grad_bytes, c.tp) - c.all_reduce(0.0, c.tp)
    assert exposed[0] == pytest.approx(replicated_sum[0], rel=1e-9) and exposed[0] > 0
    assert gradient_comm(W, one, mem1)["tp"][0] == 0.0


def _with_runtime(**runtime) -> Workload:
    c = load_cluster("ascend910b")
    return dataclasses.replace(W, cluster=dataclasses.replace(c, runtime=dataclasses.replace(c.runtime, **runtime)))


def test_runtime_scales_compute_and_adds_costs_per_step():
    lay = Layouts.of(ParallelLayout(tp=1, pp=1, dp=8, ep=8, micro_batch_num=4, micro_batch_size=1))
    base = evaluate(W, lay)["step_time"][0]
    assert evaluate(_with_runtime(step_overhead=0.01), lay)["step_time"][0] == pytest.approx(base + 0.01)
    assert evaluate(_with_runtime(update_scale=2.0), lay)["step_time"][0] > base
    # separate accumulation passes: m + 1 of them with micro-batches, none without
    acc = _with_runtime(accumulate_scale=1.0)
    one = Layouts.of(ParallelLayout(tp=1, pp=1, dp=8, ep=8, micro_batch_num=1, micro_batch_size=4))
    assert evaluate(acc, one)["step_time"][0] == evaluate(W, one)["step_time"][0]
    extra = evaluate(acc, lay)["step_time"][0] - base
    assert extra > 0 and evaluate(_with_runtime(accumulate_scale=2.0), lay)["step_time"][0] == pytest.approx(
        base + 2 * extra)
    assert evaluate(_with_runtime(compute_scale=0.5), lay)["step_time"][0] < base
    # the grouped expert kernel alone: more expensive, but less than everything twice as expensive
    slower_experts = evaluate(_with_runtime(expert_compute_scale=2.0), lay)["step_time"][0]
    assert base < slower_experts < evaluate(_with_runtime(compute_scale=2.0, expert_compute_scale=2.0), lay)[
        "step_time"][0]


def test_processes_sharing_a_hosts_cores_share_its_compute():
    lay = Layouts.of(ParallelLayout(tp=1, pp=1, dp=8, ep=8, micro_batch_num=4, micro_batch_size=1))
    alone = Costing(W, lay).flops
    assert Costing(_with_runtime(devices_share_cores=True), lay).flops == pytest.approx(
        alone / min(W.devices, W.cluster.devices_per_node))
    assert evaluate(_with_runtime(devices_share_cores=True), lay)["step_time"][0] > evaluate(W, lay)["step_time"][0]


def test_a_runtime_that_keeps_every_output_holds_each_graphs_activations():
    """keeps_op_outputs at unit constants: the activations and transient of recompute `none`, once per compiled
    graph (two when gradients accumulate, which also hold an accumulation buffer); recompute holds more."""
    keep = _with_runtime(keeps_op_outputs=True, activation_outputs=1.0, recompute_outputs=1.0, weight_outputs=1.0)
    for m in (1, 2):
        lay = Layouts.of(ParallelLayout(tp=2, pp=1, dp=8, ep=8, micro_batch_num=m, micro_batch_size=1))
        st = even_stage(W, lay, np.array([0]))
        plain = stage_memory(W, lay, block_costs(W, lay), st)
        held = stage_memory(keep, lay, block_costs(keep, lay), st)
        assert held["activations"][0] == pytest.approx(m * (plain["activations"][0] + plain["transient"][0]))
        assert held["grads"][0] == pytest.approx(m * plain["grads"][0])
        assert held["transient"][0] == 0.0
        one_graph = held["activations"][0] if m == 1 else one_graph
    lay = Layouts.of(ParallelLayout(tp=2, pp=1, dp=8, ep=8, micro_batch_num=1, micro_batch_size=1, recompute="full"))
    full = stage_memory(keep, lay, block_costs(keep, lay), even_stage(W, lay, np.array([0])))
    assert full["activations"][0] > 1.5 * one_graph  # the recomputed forward's outputs come on top


def test_precision_states_each_tensor_kind():
    """BF16 weights, FP32 gradients, an FP32 master copy and FP32 moments, each where the memory model puts it: the
    master copy and the moments are optimizer states (sharded over data parallelism); a master copy can be
    absent, and by default there is one exactly where the weights are below fp32."""
    from parallel.planner.workload import Precision

    lay = Layouts.of(ParallelLayout(tp=2, pp=2, dp=64, ep=8, micro_batch_num=4))
    st = even_stage(W, lay, np.array([0]))

    def memory(**kinds):
        w = dataclasses.replace(W, precision=Precision(**kinds))
        return stage_memory(w, lay, block_costs(w, lay), st)

    mixed = memory(param_bytes=2, grad_bytes=4, master_bytes=4, optimizer_bytes=8)
    params = mixed["dense_params"][0] + mixed["expert_params"][0]
    assert mixed["weights"][0] == pytest.approx(2 * params) and mixed["grads"][0] == pytest.approx(4 * params)
    sharded = mixed["dense_params"][0] / 64 + mixed["expert_params"][0] / (64 * 2 // 8)
    assert mixed["optimizer"][0] == pytest.approx(12 * sharded)
    assert memory(param_bytes=2, grad_bytes=4, master_bytes=0, optimizer_bytes=4)["optimizer"][0] == pytest.approx(
        4 * sharded)
    assert memory(param_bytes=2)["optimizer"][0] == mixed["optimizer"][0]  # the fp32 master by default
    assert memory(param_bytes=4)["optimizer"][0] == pytest.approx(8 * sharded)  # fp32 weights are the master
    # the update streams the master copy twice (read, write)
    t = [update_time(dataclasses.replace(W, precision=Precision(param_bytes=2, master_bytes=m)), lay, mixed,
                     np.ones(1), np.ones(1))[0] for m in (0, 4)]
    assert t[1] > t[0]


def test_precision_on_the_command_line(capsys):
    from telechat_moe.plan import main
    from telechat_moe.recipe import load_recipe
    from telechat_moe.workload import WorkloadError, parse_precision, recipe_workload

    assert parse_precision("weights=bf16, master=fp32,grads=fp32,moments=fp32,activations=fp8") == {
        "param_bytes": 2, "master_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8, "activation_bytes": 1}
    assert parse_precision("master=none") == {"master_bytes": 0}
    w = recipe_workload(load_recipe("105b"), "ascend910b", 256, precision="weights=bf16,grads=fp32")
    p = w.precision
    assert (p.param_bytes, p.grad_bytes, p.master, p.optimizer_bytes, p.activation_bytes) == (2, 4, 4, 8, 2)
    for bad, field in (("weight=bf16", "'weight=bf16'"), ("grads=int4", "grads expects"), ("moments=none", "moments"),
                       ("grads", "'grads'")):
        with pytest.raises(WorkloadError, match=field):
            parse_precision(bad)
    assert main(["--recipe", "105b", "--devices", "256", "--precision", "grads=int4", "--evaluate", "tp=8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("telechat_moe.plan: --precision: grads expects") and err.count("\n") == 1


def test_all_to_all_latency_grows_with_the_group():
    """One message per peer: in-node peers at the intra-node latency, the others at the inter-node one."""
    c = Costing(W, Layouts.of(ParallelLayout(dp=256, micro_batch_num=2)))
    lat = {size: c.all_to_all(0.0, np.array([float(size)]))[0] for size in (2, 8, 16, 64, 256)}
    intra, inter = W.cluster.intra_latency, W.cluster.inter_latency
    assert lat[2] == pytest.approx(intra) and lat[8] == pytest.approx(7 * intra)
    assert lat[64] == pytest.approx(7 * intra + 56 * inter)
    assert list(lat.values()) == sorted(lat.values())
    # between two nodes alone (stride 8: one member per node) only the inter-node message
    assert c.all_to_all(0.0, np.array([2.0]), 8.0)[0] == pytest.approx(inter)


def test_activation_offload_trades_memory_for_host_link_time():
    lay = Layouts.of(ParallelLayout(tp=4, pp=4, dp=16, ep=16, micro_batch_num=32, recompute="none"))
    base = evaluate(W, lay)
    half = evaluate(dataclasses.replace(W, activation_offload=0.5), lay)
    assert half["memory"][0] < base["memory"][0]
    st = even_stage(W, lay, np.array([1]))
    m0, m1 = (stage_memory(w, lay, block_costs(w, lay), st)
              for w in (W, dataclasses.replace(W, activation_offload=0.5)))
    assert m1["activations"][0] == pytest.approx(0.5 * m0["activations"][0])
    # a copy hides behind compute up to its length: over a link this slow it shows, over a fast one it does not
    slow, fast = (dataclasses.replace(W, cluster=dataclasses.replace(W.cluster, host_link_bandwidth=bw),
                                      activation_offload=0.5) for bw in (1e9, 1e15))
    assert evaluate(slow, lay)["step_time"][0] > base["step_time"][0]
    assert evaluate(fast, lay)["step_time"][0] == pytest.approx(base["step_time"][0], rel=1e-12)
    with pytest.raises(ValueError, match="activation_offload"):
        dataclasses.replace(W, activation_offload=1.5)
    with pytest.raises(ValueError, match="host_link"):
        dataclasses.replace(W, cluster=dataclasses.replace(W.cluster, host_link_bandwidth=0.0), activation_offload=0.1)


def test_fixed_memory_beside_the_pool_or_inside_it():
    """Communicator buffers per group of more than one device and the runtime's working memory: on ascend910b
    beside MindSpore's pool (they must fit what the pool leaves of the device), inside it when the runtime says
    so."""
    from parallel.planner.cost_model import fixed_memory

    lay = Layouts.of(ParallelLayout(tp=4, pp=4, dp=16, ep=16, etp=1, micro_batch_num=32))
    rt = W.cluster.runtime
    assert fixed_memory(W, lay)[0] == pytest.approx(4 * rt.communicator_memory + rt.graph_memory)  # dp, tp, pp, ep
    st = even_stage(W, lay, np.array([0]))
    beside = stage_memory(W, lay, block_costs(W, lay), st)
    inside_w = _with_runtime(fixed_memory_in_pool=True)
    inside = stage_memory(inside_w, lay, block_costs(inside_w, lay), st)
    assert inside["total"][0] - beside["total"][0] == pytest.approx(fixed_memory(W, lay)[0])
    crowded = _with_runtime(communicator_memory=2 * 2 ** 30)  # four groups: 8 GiB beside a 57.6 GiB pool of 64
    assert not evaluate(crowded, lay)["fits"][0]
    assert evaluate(crowded, lay)["memory"][0] == evaluate(W, lay)["memory"][0]
