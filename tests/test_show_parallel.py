"""`run_train.py --dry-run --show-parallel` (telechat_moe/parallel_report.py) against the model a rank of the layout
really builds and runs, and against the planner.

For scaled-down copies of recipes (tiny under tensor, sequence, expert and data parallelism; 105b's layout with small
sizes), the model is built for one rank with recording transports (tests/recording_transport.py) and runs one
forward and backward in PyNative mode (the collectives' bprop runs as Python there) and PrepareGradients; then
(a) the report's weights are the model's parameters, name for name and shard shape for shard shape, the split axes
and gradient groups those of the model and the trainer, and the per-rank count the dry run's;
(b) the collectives the model issued (kind, group, group size, shape, dtype) are the report's, forward, backward and
step each as a multiset;
(c) the report's bytes per block against the planner's cost model for the same (sequence-parallel) layout: every
tensor-parallel figure equal (the report and the cost model both list parallel/planner/tp_traffic.py's collectives,
the report's checked call for call in (b)), and so do the step's gradient sums over dp, edp, tp and ep and the
expert-parallel all-to-alls (both size the dispatchers' buffers by parallel/ep/capacity.py, dropless or with a
capacity factor; `test_planner_prices_...` writes the figures out);
(d) the command prints the report's totals, and --show-parallel without --dry-run is a one-line error.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from parallel.comm import ProcessGroups
from parallel.layout import Axis
from parallel.planner.model_shape import stage_parameters
from telechat_moe.parallel_report import INSIDE_REGIONS, parallel_report
from telechat_moe.recipe import load_recipe
from telechat_moe.show_parallel import model_volumes, planner_volumes, recipe_report
from tests.helpers import assert_one_line_error, run_main

SMALL = ["model.seq_length=16", "model.max_position_embeddings=16", "model.original_max_position_embeddings=16",
         "model.hidden_size=32", "model.vocab_size=64", "model.num_attention_heads=4", "model.intermediate_size=64",
         "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4",
         "model.v_head_dim=8", "model.moe_intermediate_size=16", "model.moe_shared_expert_intermediate_size=16",
         "model.num_hidden_layers=2", "training.global_batch_size=2"]
# MindFormers' 105b layout (tp=8 with sequence parallelism, ep=4 folded over the tensor ranks, dp=4, 32
# micro-batches) on one pipeline stage, at small sizes: 8 experts, 2 a rank, fewer than top-4; float32 on CPU, no
# recompute (PyNative)
SMALL_105B = ["model.seq_length=16", "model.max_position_embeddings=16", "model.original_max_position_embeddings=16",
              "model.hidden_size=32", "model.vocab_size=64", "model.num_attention_heads=8",
              "model.intermediate_size=64", "model.q_lora_rank=16", "model.kv_lora_rank=16",
              "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=8", "model.n_routed_experts=8",
              "model.moe_intermediate_size=16", "model.moe_shared_expert_intermediate_size=16",
              "model.num_hidden_layers=2", "model.compute_dtype=float32", "context.device_target=CPU",
              "parallel_config.pipeline_stage=1", "recompute_config.recompute=false",
              "parallel_config.data_parallel=4", "parallel_config.model_parallel=8",
              "parallel_config.pp_interleave_num=1", "parallel_config.expert_parallel=4",
              "parallel_config.micro_batch_num=32", "model.moe_comm_chunks=1"]

CASES = {
    "tiny tp2 ep2 float16": ("tiny", SMALL + ["parallel_config.model_parallel=2", "parallel_config.expert_parallel=2",
                                      "model.compute_dtype=float16"]),
    "tiny tp4 sp ep2 chunks2 float16 device-aux z-loss": ("tiny", SMALL + [
        "parallel_config.model_parallel=4", "parallel_config.use_seq_parallel=true",
        "parallel_config.expert_parallel=2", "model.moe_comm_chunks=2", "model.compute_dtype=float16",
        "model.moe_device_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001"]),
    "tiny tp2 ep2 capacity 1.5": ("tiny", SMALL + ["parallel_config.model_parallel=2",
                                                   "parallel_config.expert_parallel=2",
                                                   "model.moe_expert_capacity_factor=1.5"]),
    "tiny dp4 ep4 hierarchical": ("tiny", SMALL + [
        "parallel_config.data_parallel=4", "parallel_config.expert_parallel=4", "parallel_config.devices_per_node=2",
        "model.moe_token_dispatcher_type=hierarchical", "training.global_batch_size=8",
        "model.num_nextn_predict_layers=0"]),
    "105b layout": ("105b", SMALL_105B),
    "tiny cp2 tp2 sp ep2 z-loss": ("tiny", SMALL + ["parallel_config.context_parallel=2",
                                                   "parallel_config.model_parallel=2",
                                                   "parallel_config.use_seq_parallel=true",
                                                   "parallel_config.expert_parallel=2", "model.moe_z_loss_coeff=0.001"]),
}


@pytest.fixture(scope="module")
def pynative():
    """PyNative mode for the module (restored after): the collectives' Cells run their bprop as Python there, so a
    recording transport sees the backward's collectives too."""
    import mindspore as ms
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=mode)


def built_and_run(recipe):
    """The model of the layout's last rank with recording transports, after one forward+backward and
    PrepareGradients -> (model, {direction: Counter of (kind, size, shape, dtype, group)}, the trainer's kinds)."""
    import mindspore as ms
    from mindspore import Tensor
    from parallel.cp import ContextParallel
    from parallel.tp.mappings import TensorParallel
    from telechat_moe.model import TeleChatMoE
    from telechat_moe.moe.dispatch import ExpertParallel
    from telechat_moe.batches import position_ids
    from telechat_moe.gradients import GradientGroups, PrepareGradients, gradient_kind
    from tests.recording_transport import transport, transports

    lay, cfg = recipe.layout, recipe.model
    rank = lay.world_size - 1
    log: list = []
    t = transports(lay, rank, log)
    groups = ProcessGroups(lay, rank, create=False)
    coords = lay.coords(rank)
    tp = TensorParallel(lay.tp, coords[Axis.TP], bool(lay.sp), t["tp"]) if lay.tp > 1 else TensorParallel()
    per_node = groups.ep_in_node().size
    if lay.ep == 1:
        ep = ExpertParallel()
    elif cfg.moe_token_dispatcher_type == "hierarchical":
        ep = ExpertParallel(lay.ep, coords[Axis.EP], "hierarchical", per_node, None,
                            transport(groups.ep_in_node(), log, "ep_node"),
                            transport(groups.ep_across_nodes(), log, "ep_inter"))
    else:
        ep = ExpertParallel(lay.ep, coords[Axis.EP], "alltoall", per_node, t["ep"])
    ms.set_seed(0)
    cp = ContextParallel(lay.cp, coords[Axis.CP], t["cp"], cfg.seq_length, t["tp_cp"]) if lay.cp > 1 \
        else ContextParallel()
    model = TeleChatMoE(cfg, "CPU", ep, tp, cp=cp)
    b = recipe.training.global_batch_size // (lay.dp * lay.micro_batch_num)
    s = cfg.seq_length
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, s + 1)).astype(np.int32)
    args = (Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]), Tensor(np.ones((b, s), np.float32)),
            Tensor(np.zeros((b, s), np.int32)), Tensor(position_ids(b, s)))
    weights = model.trainable_params()
    forward_end = []

    def loss(*a):
        total = model(*a)[0]
        forward_end.append(len(log))      # PyNative: the forward has run when the loss is returned
        return total

    _, grads = ms.value_and_grad(loss, None, weights)(*args)
    backward_end = len(log)
    axes = model.tp_split_axes()
    kinds = tuple(gradient_kind(w.name, model, axes) for w in weights)
    prepare = PrepareGradients(weights, kinds, lay.dp, 1.0, GradientGroups(t["dp"], t["edp"], t["ep"], t["tp"],
                                                                            t["ep"], t["etp"]))
    prepare(grads, Tensor(1.0, ms.float32))
    cut = forward_end[0]
    recorded = {"forward": Counter(log[:cut]), "backward": Counter(log[cut:backward_end]),
                "step": Counter(log[backward_end:])}
    return model, recorded, dict(zip((w.name for w in weights), kinds))


def report_of(recipe, **kw):
    lay = recipe.layout
    return parallel_report(recipe.model, lay, recipe.training.global_batch_size // (lay.dp * lay.micro_batch_num),
                           recipe.model.seq_length, **kw)


def as_recorded(report, direction):
    return Counter(c.key + (c.group,) for c in report.select(direction=direction))


@pytest.mark.parametrize("case", sorted(CASES))
def test_report_is_what_a_rank_builds_and_issues(case, pynative):
    from telechat_moe.model import INSIDE_REGIONS as MODEL_INSIDE_REGIONS
    from telechat_moe.gradients import EXPERT, PARTIAL
    name, sets = CASES[case]
    recipe = load_recipe(name, sets)
    lay = recipe.layout
    report = report_of(recipe)
    model, recorded, kinds = built_and_run(recipe)

    # (a) every parameter, its shard shape and whether it trains; the split axes; the count the dry run prints
    built = {p.name: (tuple(p.shape), bool(p.requires_grad)) for p in model.get_parameters()}
    assert {w.name: (w.shard_shape, w.trainable) for w in report.weights} == built
    assert {w.name: w.split_axis for w in report.weights if w.group == "tp"} == model.tp_split_axes()
    assert all(w.split_axis == 0 for w in report.weights if w.group == "ep") and \
        {w.name for w in report.weights if w.group == "ep"} == \
        ({n for n in built if ".experts." in n} if lay.ep > 1 else set())
    assert MODEL_INSIDE_REGIONS == INSIDE_REGIONS
    sizes = report.group_sizes
    for w in report.weights:
        if w.trainable:
            kind = kinds[w.name]
            groups = ("edp",) if kind == EXPERT else ("dp", "tp") if kind == PARTIAL else ("dp",)
            assert w.reduced_over == tuple(g for g in groups if sizes[g] > 1), w.name
    n_built = sum(int(np.prod(p.shape)) for p in model.trainable_params())
    planned = stage_parameters(recipe.model.to_model_shape(), lay)[0]
    assert report.parameters == n_built == planned["dense"] + planned["expert"]
    assert report.parameter_bytes == sum(p.nbytes for p in model.trainable_params())
    assert report.expert_parameters == planned["expert"]

    # (b) the collectives, call for call
    for direction in ("forward", "backward", "step"):
        assert recorded[direction] == as_recorded(report, direction), (
            direction, recorded[direction] - as_recorded(report, direction),
            as_recorded(report, direction) - recorded[direction])
    assert sum(recorded["forward"].values()) > 0
    print(f"{case}: {report.parameters:,} parameters per rank, {sum(recorded['forward'].values())} forward, "
          f"{sum(recorded['backward'].values())} backward and {sum(recorded['step'].values())} step collectives, "
          f"{report.step_wire_bytes(host=False):,.0f} wire bytes per step, all as reported")


def ring(g, nbytes, all_reduce=False):
    return (2 if all_reduce else 1) * (g - 1) / g * nbytes


@pytest.mark.parametrize("name,sets", [
    ("tiny", ["parallel_config.model_parallel=2", "parallel_config.use_seq_parallel=true",
              "parallel_config.expert_parallel=2"]),
    ("105b", []),                                        # the recipe itself: pp=4 x vpp=6, bfloat16, 2 token slices
    ("105b", ["parallel_config.pipeline_stage=1", "parallel_config.pp_interleave_num=1",
              "recompute_config.recompute=false", "training.global_batch_size=256",
              "model.moe_device_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001"]),
    ("105b", ["model.moe_expert_capacity_factor=1.25"]),
    ("1t", ["model.moe_token_dispatcher_type=alltoall"]),     # (the recipe's hierarchical form is priced flat)
    ("1t", ["model.moe_token_dispatcher_type=alltoall", "model.moe_expert_capacity_factor=1.0"]),
    ("tiny", ["parallel_config.context_parallel=2", "parallel_config.model_parallel=2",       # router sums over tp x cp
              "parallel_config.use_seq_parallel=true", "parallel_config.expert_parallel=2",
              "model.moe_z_loss_coeff=0.001"]),
])
def test_planner_prices_the_collectives_the_model_issues(name, sets):
    """Per block and direction, the model's wire bytes (the report, which the test above checks against the model)
    and the planner's (cost_model.py's own blocks on a unit-bandwidth cluster): equal for tensor parallelism and
    the step. T = b*s tokens of a micro-batch, h hidden, f_g(x) = (g-1)/g x, ab the compute dtype's bytes, float32
    residual stream and head (4); the figures are also written out here, so that a change to both sides shows.

    - a dense layer, and an MoE layer's TP part: 2 all-gathers and 2 reduce-scatters of T x h at ab each way (the
      region entries, cast to the compute dtype, and the row-parallel exits); an MoE layer adds the router's sums
      over tp in the forward (2 x [b, E], + device aux 2 x [E], + z-loss 1 scalar; float32 all-reduces).
    - embedding (and again MTP's lookup of the next tokens): reduce-scatter forward, all-gather backward of T x h
      float32.
    - head: all-gather of its T x h float32 input forward, reduce-scatter backward; the cross-entropy's statistics
      forward only: all-gather of tp x T float32 maxima and 2 all-reduces of [T].
    - an MTP depth beyond its MoE layer and the head: the lookup, and eh_proj's all-gathers of the [T, 2h] input and
      of the [T, h] output columns (compute dtype) forward, reduce-scatters of both backward.
    - recompute full: each layer's forward collectives again in its backward.
    - the step: the dense gradients' all-reduce over dp equals the planner's reduce-scatter + all-gather, the
      experts' over edp likewise; over tp the all-reduce of every replicated weight's partial gradient (under
      sequence parallelism: norms, q_a / kv_a and their norms, routers, MTP's norms) and the norm's scalar; over
      ep the norm's scalar.
    - EP: per direction a dispatch and a combine uneven all-to-all of the routed copies and one pad row per member
      (rows of h at ab): T/tp x k copies dropless, or with a capacity factor at most every expert's capacity; forward
      also the copies per expert, a float32 [E]; each of model.moe_comm_chunks token slices its own.
    """
    recipe = load_recipe(name, sets)
    rep = recipe_report(recipe)
    lay, cfg = recipe.layout, recipe.model
    model = model_volumes(rep)
    planner = planner_volumes(cfg, lay, rep.batch, rep.seq, rep.stage, recipe.recompute_config.mode)
    t, ep, cp = lay.tp, lay.ep, lay.cp
    b, s, h, E, k = rep.batch, rep.seq // cp, cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    T, ab, f32 = b * s, {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.compute_dtype], 4
    assert lay.sp and t > 1                      # the planner's assumption
    redo = 2 if recipe.recompute_config.mode == "full" else 1
    layer = 4 * ring(t, T * h * ab)
    g = t * cp                                   # the ranks that route a sequence's positions
    router = 2 * ring(g, b * E * 4, True) + (cfg.moe_device_aux_loss_coeff > 0) * 2 * ring(g, E * 4, True) \
        + (cfg.moe_z_loss_coeff > 0) * ring(g, 4, True)
    lookup = ring(t, T * h * f32)
    cf, c = cfg.moe_expert_capacity_factor, cfg.moe_comm_chunks
    copies = T // t // c * k                     # each token slice exchanges its own copies, pads and counts
    rows = c * (ep + (copies if cf is None else min(copies, E * int(np.ceil(cf * (T // t // c) * k / E)))))
    ep_fwd = 2 * ring(ep, rows * h * ab) + c * ring(ep, E * 4)
    ep_bwd = 2 * ring(ep, rows * h * ab)
    partial = sum(w.numel for w in rep.weights if "tp" in w.reduced_over)
    expect = {  # the model's figure; the planner's is equal
        ("moe_layer", "tp", "forward"): layer + router,
        ("moe_layer", "tp", "backward"): redo * layer + (redo - 1) * router,
        ("moe_layer", "ep", "forward"): ep_fwd,
        ("moe_layer", "ep", "backward"): ep_bwd + (redo - 1) * ep_fwd,
        ("step", "dp", "step"): None,
        ("step", "edp", "step"): None,
        ("step", "tp", "step"): ring(t, partial * 4, True) + ring(t, 4, True),
        ("step", "ep", "step"): ring(ep, 4, True),
    }
    if cp > 1:      # MLA's latent and rotated key gathered over cp (backward: reduce-scatter); the loss's parts
        gather = ring(cp, b * s * cp * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * ab)
        expect[("attention", "cp", "forward")], expect[("attention", "cp", "backward")] = gather, redo * gather
        expect[("head", "cp", "forward")], expect[("head", "cp", "backward")] = ring(cp, 4, True), 0
    if rep.layers[0] < cfg.first_k_dense_replace:
        expect[("dense_layer", "tp", "forward")] = layer
        expect[("dense_layer", "tp", "backward")] = redo * layer
    if rep.has_embedding:
        expect[("embedding", "tp", "forward")] = expect[("embedding", "tp", "backward")] = lookup
    if rep.has_head:
        expect[("head", "tp", "forward")] = ring(t, T * h * f32) + ring(t, t * T * 4) + 2 * ring(t, T * 4, True)
        expect[("head", "tp", "backward")] = ring(t, T * h * f32)
        mtp = lookup + ring(t, T * 2 * h * ab) + ring(t, T * h * ab)
        expect[("mtp_extra", "tp", "forward")] = expect[("mtp_extra", "tp", "backward")] = mtp
    assert set(model) == set(expect) and set(expect) <= set(planner)
    for key, figure in expect.items():
        if figure is not None:
            assert model[key] == pytest.approx(figure, rel=1e-12), key
        assert planner[key] == pytest.approx(model[key], rel=1e-12), key
    assert rep.wire_bytes(direction="step", group="tp") == model[("step", "tp", "step")]
    print(f"{name} {' '.join(sets)}: " + ", ".join(f"{'/'.join(key)} {model[key]:,.0f}" for key in sorted(expect)))


def test_show_parallel_prints_the_reports_totals(capfd):
    sets = ["--set", "parallel_config.model_parallel=2"]
    proc = run_main(capfd, "--recipe", "tiny", "--dry-run", "--show-parallel", *sets)
    assert proc.returncode == 0, proc.stderr
    rep = recipe_report(load_recipe("tiny", ["parallel_config.model_parallel=2"]))
    out = proc.stdout
    assert f"parameters per device (stage 0): {rep.parameters:,}," in out          # the dry run's own line
    assert f"parameters per rank (stage 0): {rep.parameters:,} = " in out
    assert f"({rep.parameter_bytes:,} B)" in out
    assert f"the dry run's parameters per device (stage 0): {rep.parameters:,} (equal)" in out
    assert f"({rep.step_wire_bytes():,.0f} B; payload {rep.step_payload_bytes():,} B)" in out
    for part in ("layers.1.self_attn.q_b_proj.weight", "layers.1.mlp.experts.w1", "mtp.0.block.mlp.gate.weight",
                 "layers 2..3 alike", "RowParallelLinear: all-reduce of the partial sums", "VocabParallelCrossEntropy"):
        assert part in out, part
    assert_one_line_error(run_main(capfd, "--recipe", "tiny", "--show-parallel", *sets), "--show-parallel",
                          "--dry-run")


@pytest.mark.parametrize("name", ["105b", "1t"])
def test_show_parallel_on_the_big_recipes(capfd, name):
    proc = run_main(capfd, "--recipe", name, "--dry-run", "--show-parallel")
    assert proc.returncode == 0, proc.stderr
    rep = recipe_report(load_recipe(name))
    assert f"the dry run's parameters per device (stage {rep.stage}): {rep.parameters:,} (equal)" in proc.stdout
    assert f"({rep.step_wire_bytes():,.0f} B;" in proc.stdout
    assert len(proc.stdout.splitlines()) < 300
