"""What a recipe costs before anything is allocated: parameters, FLOPs per token, memory per device."""
from __future__ import annotations

from parallel.ep.capacity import routed_copies, sent_rows
from parallel.optim.memory import accumulate_bytes, uses_distributed
from parallel.planner.model_shape import StageHolding, flops_per_token, parameter_breakdown, training_memory
from telechat_moe.parallel_report import group_sizes
from telechat_moe.recipe_schema import Recipe
from telechat_moe.workload import recipe_placement

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
GIB = 2 ** 30


def distributed_optimizer(r: Recipe) -> bool:
    """Whether the trainer steps this recipe with the distributed optimizer (parallel/optim/memory.py)."""
    lay = r.layout
    return uses_distributed(r.parallel_config.optimizer_shard, lay.dp * lay.cp, lay.edp, r.model.params_dtype)


def stage_holdings(r: Recipe) -> list[StageHolding] | None:
    """What each pipeline stage holds under the placement the trainer builds (telechat_moe/workload.py:
    recipe_placement): segment k's layers on its stage, the first segment's embedding, the last's tail; None
    without pipeline parallelism."""
    if r.layout.pp == 1:
        return None
    placement = recipe_placement(r)
    layers: list[set[int]] = [set() for _ in range(placement.stages)]
    first, last = placement.chunk_layout.stage_and_chunk(placement.stages, 0)[0], None
    for k, seg in enumerate(placement.segments):
        stage = placement.chunk_layout.stage_and_chunk(placement.stages, k)[0]
        layers[stage].update(u.layer for u in seg if u.kind in ("dense", "moe"))
        last = stage
    return [StageHolding(frozenset(held), s == first, s == last) for s, held in enumerate(layers)]


def static_memory(r: Recipe) -> dict:
    """Weights, gradients and AdamW states per device on the heaviest pipeline stage (each stage's in
    'per_stage', with its 'dense' and 'expert' parameters), in the recipe's dtypes, as the trainer holds them
    (model_shape.rank_static_bytes): each stage's layers as the trainer's pipeline placement puts them, the spare
    expert slots of dynamic placement counted.

    The step's gradients come in the parameter dtype; Adam's two moments are float32 (8 bytes per parameter), plus
    a float32 master copy where parameters are stored below float32, divided over the data-parallel ranks when
    the distributed optimizer steps (parallel/optim/memory.py); gradients held between micro-batches as
    `accumulate_bytes` says.
    """
    m, lay = r.model, r.layout
    param_bytes = DTYPE_BYTES[m.params_dtype]
    distributed = distributed_optimizer(r)
    return training_memory(m.to_model_shape(), lay, param_bytes, param_bytes, 8, distributed, stage_holdings(r),
                           accumulate_bytes=accumulate_bytes(distributed, lay.micro_batch_num, lay.pp > 1,
                                                             param_bytes),
                           spare_slots=r.expert_placement.spare_slots)


def report(r: Recipe) -> str:
    shape = r.model.to_model_shape()
    params = parameter_breakdown(shape)
    flops = flops_per_token(shape)
    mem = static_memory(r)
    per_device = mem["per_stage"][mem["stage"]]
    lines = [f"recipe {r.name}: layout {r.layout.describe()}", "parameters:"]
    for key in ("embedding", "attention", "dense_ffn", "routed_experts", "shared_experts", "router", "norms", "mtp",
                "head"):
        lines.append(f"  {key:<16}{params[key] / 1e9:>12.3f} B")
    lines += [f"  {'total':<16}{params['total'] / 1e9:>12.3f} B   (without MTP {params['total_without_mtp'] / 1e9:.3f} B)",
              f"  {'active':<16}{params['active'] / 1e9:>12.3f} B   (without MTP {params['active_without_mtp'] / 1e9:.3f} B)",
              f"training FLOPs per token at seq {r.model.seq_length}: {flops['training'] / 1e9:.2f} GFLOP "
              f"(without MTP {flops['training_without_mtp'] / 1e9:.2f})",
              f"parameters per device (stage {mem['stage']}): {per_device['dense'] + per_device['expert']:,.0f}, of "
              f"them {per_device['expert']:,.0f} in routed experts (1/{r.layout.ep * r.layout.etp} of each layer's)",
              f"memory per device (heaviest stage {mem['stage']}, params {r.model.params_dtype}, "
              f"optimizer {'distributed: states sharded over dp' if distributed_optimizer(r) else 'replicated'}):",
              f"  weights    {mem['weights'] / GIB:10.2f} GiB",
              f"  gradients  {mem['grads'] / GIB:10.2f} GiB",
              f"  optimizer  {mem['optimizer'] / GIB:10.2f} GiB",
              f"  grad bufs  {mem['grad_buffers'] / GIB:10.2f} GiB (held between micro-batches)",
              f"  total      {mem['total'] / GIB:10.2f} GiB (activations come on top; held between steps "
              f"{mem['held'] / GIB:.2f})"]
    if r.layout.ep > 1:
        lines.append(exchange_line(r))
    if r.context.device_target == "Ascend":
        from telechat_moe.layout_rating import rating_line
        lines.append(rating_line(r))
    return "\n".join(lines)


def slice_tokens(r: Recipe) -> int:
    """The tokens one rank routes per MoE layer, micro-batch and token slice (sequence and context parallelism split
    a micro-batch's sequence over tp and cp)."""
    m, lay = r.model, r.layout
    return r.training.global_batch_size // (lay.dp * lay.micro_batch_num) * m.seq_length // (lay.tp * lay.cp) \
        // m.moe_comm_chunks


def exchange_line(r: Recipe) -> str:
    """The rows the expert exchange sends against the routed copies they carry (parallel/ep/capacity.py)."""
    m, lay = r.model, r.layout
    k, E, cf = m.num_experts_per_tok, m.n_routed_experts, m.moe_expert_capacity_factor
    tokens = slice_tokens(r)
    sizes = group_sizes(lay, m.moe_token_dispatcher_type)
    hierarchical = m.moe_token_dispatcher_type == "hierarchical"
    copies = int(routed_copies(tokens, k, E, cf))
    rows = int(sent_rows(copies, sizes["ep_node"] if hierarchical else sizes["ep"]))
    how = "dropless" if cf is None else f"capacity factor {cf}"
    where = " (in-node exchange; each token crosses once to each node holding its experts)" if hierarchical else ""
    return (f"expert exchange ({m.moe_token_dispatcher_type}, {how}){where}: {rows:,} rows sent per rank, MoE layer "
            f"and token slice for {copies:,} routed copies ({rows / copies:.1f}x)")


def fit_problem(r: Recipe, machine_bytes: float, has_ascend: bool) -> str | None:
    """A one-line reason why the recipe cannot train on this machine, or None."""
    per_device = static_memory(r)["total"]
    if r.context.device_target == "Ascend":
        if not has_ascend:
            return (f"recipe {r.name} targets Ascend ({r.layout.world_size} devices, {per_device / GIB:.1f} GiB each "
                    f"for weights, gradients and optimizer states) but this machine has no Ascend device; run with "
                    f"--dry-run to see the plan")
        limit = r.context.max_device_memory_gb * GIB
        if limit and per_device > limit:
            return (f"recipe {r.name} needs at least {per_device / GIB:.1f} GiB per device for weights, gradients "
                    f"and optimizer states, above context.max_device_memory_gb={r.context.max_device_memory_gb}; "
                    f"run with --dry-run to see the plan")
        return None
    # On CPU every rank of the layout runs on this one machine.
    need = per_device * r.layout.world_size
    if need > machine_bytes:
        return (f"recipe {r.name} needs at least {need / GIB:.1f} GiB for weights, gradients and optimizer states "
                f"over {r.layout.world_size} CPU process(es), but this machine has {machine_bytes / GIB:.1f} GiB; "
                f"run with --dry-run to see the plan")
    return None
