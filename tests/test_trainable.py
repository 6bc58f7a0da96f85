"""One predicate of what the trainer runs (parallel/planner/trainable.py): check_trainable asks it, the planner's search
and refinement filter with it, so every layout the planner proposes and writes passes the trainer's checks (one
process with that layout stops only at the process count). And the planner terms issue #39 found off: the
expert-data-parallel group's span, the MTP block's embedding copy on the last stage."""
import numpy as np
import pytest

from parallel.layout import ParallelLayout
from parallel.planner import trainable
from parallel.planner.blocks import block_costs
from parallel.planner.cluster import load_cluster
from parallel.planner.cost_model import even_stage, gradient_comm, stage_memory
from parallel.planner.costing import Costing
from parallel.planner.model_shape import stage_parameters
from parallel.planner.refine import refine
from parallel.planner.report import recipe_overrides, write_recipe
from parallel.planner.search import SearchSpace, enumerate_layouts, search
from parallel.planner.workload import Layouts, Workload
from telechat_moe.dry_run import fit_problem
from telechat_moe.errors import RecipeError
from telechat_moe.recipe import find_recipe, load_recipe
from telechat_moe.recipe_checks import check_trainable
from telechat_moe.workload import recipe_workload

PROCESS_COUNT = r"^parallel_config: data_parallel\*model_parallel\*context_parallel\*pipeline_stage = .* but 1 " \
                r"process was launched"


def assert_stops_only_at_the_process_count(recipe) -> None:
    """What `python run_train.py --recipe R` does with one process, on the devices the recipe targets: the fit check
    passes (as on its Ascend devices) and check_trainable refuses only the process count."""
    assert fit_problem(recipe, 0.0, has_ascend=True) is None
    with pytest.raises(RecipeError, match=PROCESS_COUNT):
        check_trainable(recipe, processes=1)


def as_recipe(tmp_path, name: str, candidate, w) -> object:
    path = tmp_path / f"{name}.yaml"
    write_recipe(str(path), find_recipe("1t" if w.shape.num_layers == 76 else "105b"), candidate, w, "test")
    return load_recipe(str(path))


def test_every_searched_layout_of_1t_on_4096_devices_trains(tmp_path):
    """The whole vectorised space (before ILP balancing) is filtered: each of a spread of its layouts (expert tensor
    parallelism among them), written as a recipe, stops only at the process count."""
    recipe = load_recipe("1t")
    w = recipe_workload(recipe, "ascend910b", 4096)
    lay, _ = enumerate_layouts(w)
    assert len(lay) > 1000 and set(lay.etp) == {1, 2, 4, 8}
    wide = np.flatnonzero(lay.etp > 1)
    for i in [*np.linspace(0, len(lay) - 1, 8).astype(int), *wide[::len(wide) // 4][:4]]:
        row = lay.row(int(i))
        body = {"model": {"moe_token_dispatcher_type": "hierarchical" if row.ep_scheme == "hierarchical" else
                          "alltoall", "moe_comm_chunks": 2 if row.ep_overlap else 1},
                "parallel_config": {"data_parallel": row.dp, "model_parallel": row.tp, "pipeline_stage": row.pp,
                                    "pp_interleave_num": row.vpp, "expert_parallel": row.ep,
                                    "expert_model_parallel": row.etp, "context_parallel": row.cp,
                                    "micro_batch_num": row.micro_batch_num,
                                    "use_seq_parallel": row.tp > 1}}
        sets = [f"{section}.{k}={v}" for section, keys in body.items() for k, v in keys.items()]
        r = load_recipe("1t", sets + ["context.max_device_memory_gb=0"])
        with pytest.raises(RecipeError, match=PROCESS_COUNT):
            check_trainable(r, processes=1)


def test_each_switch_is_one_line(monkeypatch):
    """Expert tensor parallelism, context parallelism (and it under a pipeline) and DualPipeV are trainable by their
    switch alone (all on)."""
    s = load_recipe("1t").model.to_model_shape()
    w = Workload(s, load_cluster("ascend910b"), devices=4096, seq_length=8192, global_batch=2048)
    etp = dict(tp=4, pp=16, ep=4, etp=4)
    assert trainable.refusal(s, 8192, **etp) is None
    assert trainable.refusal(s, 8192, 4, 1, 4, 1, cp=2) is None
    assert trainable.refusal(s, 8192, 4, 16, 4, 1, cp=2) is None
    assert trainable.refusal(s, 8192, 4, 16, 4, 1, schedule="dualpipev") is None
    assert set(enumerate_layouts(w)[0].etp) == {1, 2, 4, 8}
    monkeypatch.setattr(trainable, "EXPERT_TENSOR_PARALLEL_TRAINS", False)
    monkeypatch.setattr(trainable, "CONTEXT_PARALLEL_TRAINS", False)
    monkeypatch.setattr(trainable, "TRAINED_SCHEDULES", tuple(x for x in trainable.TRAINED_SCHEDULES
                                                              if x != "dualpipev"))
    assert "expert_model_parallel: 4 is not trained yet" in trainable.refusal(s, 8192, **etp)
    assert "context_parallel: 2 is not trained yet" in trainable.refusal(s, 8192, 4, 1, 4, 1, cp=2)
    assert "dualpipev is not trained yet" in trainable.refusal(s, 8192, 4, 16, 4, 1, schedule="dualpipev")
    assert set(enumerate_layouts(w)[0].etp) == {1}
    monkeypatch.setattr(trainable, "CONTEXT_PARALLEL_TRAINS", True)
    monkeypatch.setattr(trainable, "CONTEXT_PARALLEL_WITH_PIPELINE", False)
    assert "context_parallel: 2 with pipeline_stage=16 is not trained yet" in trainable.refusal(s, 8192, 4, 16, 4, 1,
                                                                                                cp=2)


def test_vectorised_and_one_layout_agree():
    """trainable() over arrays is refusal() of each layout."""
    s = load_recipe("tiny", ["model.num_attention_heads=6", "model.intermediate_size=774"]).model.to_model_shape()
    tp, ep, etp = np.array([1, 2, 3, 4, 2, 1]), np.array([1, 2, 1, 4, 2, 2]), np.array([1, 1, 1, 1, 5, 1])
    scheme = np.array(["flat", "hierarchical", "flat", "flat", "flat", "node_dedup"])
    many = trainable.trainable(s, 96, tp, 1, ep, etp, sp=tp > 1, ep_scheme=scheme)
    one = [trainable.refusal(s, 96, int(a), 1, int(b), int(c), sp=a > 1, ep_scheme=str(d)) is None
           for a, b, c, d in zip(tp, ep, etp, scheme)]
    assert list(many) == one == [True, True, False, False, False, False]


def test_the_planners_top_layouts_and_its_written_recipe_train(tmp_path):
    """refine's ILP-balanced short list (105B on 256 devices, a narrowed space to stay fast): each candidate, written
    as --write writes it, stops only at the process count, and carries every knob it was priced with."""
    recipe = load_recipe("105b")
    w = recipe_workload(recipe, "ascend910b", 256)
    candidates = refine(w, search(w, SearchSpace(tp=(2, 4, 8), pp=(4, 8), vpp=(1, 2))), top=4)
    assert candidates
    for i, c in enumerate(candidates):
        r = as_recipe(tmp_path, f"pick{i}", c, w)
        assert_stops_only_at_the_process_count(r)
        lay = r.layout
        assert (lay.tp, lay.pp, lay.vpp, lay.ep, lay.etp, lay.dp, lay.micro_batch_num) == (
            c.layout.tp, c.layout.pp, c.layout.vpp, c.layout.ep, c.layout.etp, c.layout.dp, c.layout.micro_batch_num)
        assert r.model.moe_comm_chunks == (2 if c.layout.ep_overlap else 1)
        assert r.model.moe_token_dispatcher_type == ("hierarchical" if c.layout.ep_scheme == "hierarchical"
                                                     else "alltoall")
        assert c.schedule in trainable.TRAINED_SCHEDULES
        assert r.parallel_config.pipeline_scheduler == ("1f1b" if c.schedule == "interleaved" else c.schedule)
        priced = [sum(c.assignment.recompute_per_stage(m)) for m in range(3)]
        written = {"none": 0, "selective": 1, "full": 2}[r.recompute_config.mode]
        assert written == max(m for m, n in enumerate(priced) if n or m == 0)
        assert recipe_overrides(c, w)["training"]["global_batch_size"] == r.training.global_batch_size


# ---- planner terms ---------------------------------------------------------------------------------------------
def test_the_expert_data_parallel_group_spans_its_own_ranks_nodes():
    """edp = 2 ranks ep*etp = 128 apart: two nodes, one member each (it was priced as 32 nodes, half a member each),
    so its gradient reduction costs what a two-rank inter-node ring costs."""
    s = load_recipe("1t").model.to_model_shape()
    w = Workload(s, load_cluster("ascend910b"), devices=4096, seq_length=8192, global_batch=2048)
    lay = Layouts.of(ParallelLayout(dp=64, tp=4, pp=16, vpp=4, ep=32, etp=4, sp=True, micro_batch_num=32))
    c = Costing(w, lay)
    assert [float(x[0]) for x in c.group_span(np.array([2.0]), np.array([128.0]))] == [2.0, 1.0]
    assert [float(x[0]) for x in c.group_span(c.ep, c.etp)] == [16.0, 2.0]       # 32 ranks 4 apart: 2 per node
    assert [float(x[0]) for x in c.group_span(c.tp, 1.0)] == [1.0, 4.0]
    mem = {"dense_params": np.array([0.0]), "expert_params": np.array([1e9]), "replicated_params": np.array([0.0]),
           "pair_params": np.array([0.0])}
    reduce_scatter = gradient_comm(w, lay, mem)["edp"][0][0]
    ring = 1e9 * w.precision.grad_bytes / 2 / c.inter_bw + w.cluster.inter_latency
    assert reduce_scatter == pytest.approx(ring, rel=1e-12)


def test_the_last_stage_holds_mtps_embedding_copy():
    """Under pipeline parallelism the last stage builds a copy of the embedding for MTP (model.StageParts): the
    planner's last stage holds what the trainer's model holds there, the dry run's formula and the cost model's
    alike; one process holds the one table."""
    from telechat_moe.model import StageParts, TeleChatMoE
    r = load_recipe("tiny")
    s = r.model.to_model_shape()
    layout = ParallelLayout(pp=2, micro_batch_num=2)
    planned = stage_parameters(s, layout, [2, 2])
    model = TeleChatMoE(r.model, parts=StageParts(frozenset({2, 3}), embedding=True, tail=True))
    held = sum(int(np.prod(p.shape)) for p in model.trainable_params())
    assert planned[1]["dense"] + planned[1]["expert"] == held
    w = Workload(s, load_cluster("ascend910b"), devices=2, seq_length=s.seq_length, global_batch=2)
    lay = Layouts.of(layout)
    last = stage_memory(w, lay, block_costs(w, lay), even_stage(w, lay, np.array([1])))
    assert last["dense_params"][0] == planned[1]["dense"]
    whole = stage_parameters(s, ParallelLayout())[0]
    assert whole["dense"] == planned[0]["dense"] + planned[1]["dense"] - s.vocab_size * s.hidden_size
