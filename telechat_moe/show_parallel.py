"""`run_train.py --dry-run --show-parallel`: the parallel report of a recipe's rank (parallel_report.py) printed,
per weight how it is split and every collective with its bytes, and beside it the bytes the planner's cost model
prices for the same layout (`planner_volumes`, read off the planner's own blocks) against the model's
(`model_volumes`, read off the report)."""
from __future__ import annotations

from parallel.planner.model_shape import stage_parameters
from telechat_moe.dry_run import static_memory
from telechat_moe.parallel_report import DIRECTIONS, DTYPE_BYTES, PARAM_DTYPE, RESIDUAL, ParallelReport, parallel_report
from telechat_moe.recipe_schema import Recipe


def show_parallel(r: Recipe) -> str:
    """`--dry-run --show-parallel`: per weight how one rank of the layout holds it, the collectives a step issues
    with their bytes (telechat_moe/parallel_report.py), and the planner's communication for the same layout."""
    mem = static_memory(r)
    rep = recipe_report(r, mem["stage"])
    planned = stage_parameters(r.model.to_model_shape(), r.layout)[mem["stage"]]
    planned = planned["dense"] + planned["expert"]
    same = "equal" if planned == rep.parameters else f"differs by {rep.parameters - planned:+,.0f}"
    lines = [format_report(rep),
             f"the dry run's parameters per device (stage {mem['stage']}): {planned:,.0f} ({same})"]
    comparison = format_planner_comparison(rep, r.model, r.recompute_config.mode)
    if comparison:
        lines.append(comparison)
    return "\n".join(lines)


def recipe_report(recipe, stage: int | None = None) -> ParallelReport:
    """The report of a recipe's layout: its micro-batch (global_batch_size / (data_parallel x micro_batch_num)),
    recompute and dispatcher; by default on the stage the dry run reports (the heaviest)."""
    layout = recipe.layout
    if stage is None:
        stage = static_memory(recipe)["stage"]
    batch = recipe.training.global_batch_size // (layout.dp * layout.micro_batch_num)
    return parallel_report(recipe.model, layout, batch, recipe.model.seq_length, stage,
                           recipe.recompute_config.mode, recipe.model.moe_token_dispatcher_type)


# ---- the planner's figures for the same layout ---------------------------------------------------------------
def planner_volumes(cfg, layout, batch: int, seq: int | None = None, stage: int = 0,
                    recompute: str = "none") -> dict:
    """The bytes per rank the planner's cost model (parallel/planner/cost_model.py) prices for one micro-batch of
    this layout, read off its own blocks on a cluster of unit bandwidth and no latency in one node (so a
    collective's seconds are its ring wire bytes): {(block, group, direction): bytes}. Blocks: dense_layer,
    moe_layer (tp: the block's communication less its EP all-to-alls, with the router's sums over tp x cp; ep:
    those), attention (cp: the context gather and its reduce-scatter), embedding, head (cp: its loss summed over
    cp), mtp_extra (an MTP depth less its MoE layer and the head: the embedding lookup and eh_proj), and step (`gradient_comm` of the
    stage: dp the dense gradients' reduce-scatter plus the weights' all-gather, edp the experts', tp the replicated
    weights' partial gradients and the norm's scalar, ep the norm's scalar). The planner assumes sequence
    parallelism whenever tp > 1. Every group is priced inside one node (so that the seconds are ring bytes): a
    hierarchical EP scheme is priced flat. The tensor-parallel and step figures equal model_volumes' for a
    sequence-parallel layout (both come from parallel/planner/tp_traffic.py), and so do the EP all-to-alls (the
    routed copies and pad rows of parallel/ep/capacity.py, and the copies per expert)."""
    import dataclasses
    import numpy as np
    from parallel.layout import RECOMPUTE
    from parallel.planner.cluster import Cluster
    from parallel.planner.blocks import block_costs
    from parallel.planner.cost_model import even_stage, gradient_comm, stage_memory
    from parallel.planner.costing import Costing
    from parallel.planner.workload import Layouts, Precision, Workload
    from telechat_moe.workload import DTYPES
    seq = seq or cfg.seq_length
    inf = float("inf")
    cluster = Cluster(name="unit-bandwidth", devices_per_node=max(8, layout.world_size), peak_flops={
        "fp32": inf, "bf16": inf, "fp16": inf}, memory_bytes=inf, memory_bandwidth=inf, intra_bandwidth=1.0,
        intra_latency=0.0, inter_bandwidth=1.0, inter_latency=0.0, matmul_efficiency=1.0, memory_efficiency=1.0,
        network_efficiency=1.0, attention_efficiency=1.0, flash_attention=True, op_overhead=0.0,
        usable_memory_fraction=1.0)
    dtype = DTYPES[cfg.compute_dtype][0]
    precision = Precision(matmul_dtype=dtype, activation_bytes=4 if dtype == "fp32" else 2, param_bytes=4,
                          grad_bytes=4, residual_bytes=DTYPE_BYTES[RESIDUAL])
    shape = dataclasses.replace(cfg.to_model_shape(), seq_length=seq)
    global_batch = batch * layout.dp * layout.micro_batch_num
    w = Workload(shape, cluster, layout.world_size, seq, global_batch, precision, overlap_grad_reduce=False)
    scheme = "hierarchical" if cfg.moe_token_dispatcher_type == "hierarchical" else "flat"
    lay = Layouts.of(dataclasses.replace(layout, micro_batch_size=batch, recompute=recompute,
                                         ep_overlap=cfg.moe_comm_chunks > 1,
                                         ep_scheme=scheme, devices_per_node=cluster.devices_per_node))
    b = block_costs(w, lay)
    mode = RECOMPUTE.index(recompute)
    ep_moe = {direction: float(t[0]) for direction, t in zip(("forward", "backward"), Costing(w, lay).ep_all_to_all())}
    # each attention's context-parallel gather (forward) and its reduce-scatter (backward), priced inside the blocks
    cp = {direction: float(t[0]) for direction, t in zip(("forward", "backward"), Costing(w, lay).cp_comm())}
    # the head's loss summed over cp (forward), priced inside the head's block (and again in MTP's, which cancels)
    loss_cp = {"forward": float(Costing(w, lay).context_loss_sums(1)[0]), "backward": 0.0}
    redo = 2 if recompute == "full" else 1      # full recompute runs each layer's forward again in its backward

    def comm(block, direction):
        if direction == "forward":
            return float(block.fwd_comm[0])
        return float((block.bwd_comm + block.recompute_comm[mode])[0])

    out = {}
    for direction in ("forward", "backward"):
        times = redo if direction == "backward" else 1
        cp_dir = cp[direction] + (times - 1) * cp["forward"]
        out[("dense_layer", "tp", direction)] = comm(b.dense, direction) - cp_dir
        if layout.cp > 1:
            out[("attention", "cp", direction)] = cp_dir
        # full recompute: the backward repeats the forward's exchanges
        ep_moe_dir = ep_moe[direction] + (times - 1) * ep_moe["forward"]
        out[("moe_layer", "tp", direction)] = comm(b.moe, direction) - ep_moe_dir - cp_dir
        out[("moe_layer", "ep", direction)] = ep_moe_dir
        out[("embedding", "tp", direction)] = comm(b.embedding, direction)
        out[("head", "tp", direction)] = comm(b.head, direction) - loss_cp[direction]
        if layout.cp > 1:
            out[("head", "cp", direction)] = loss_cp[direction]
        out[("mtp_extra", "tp", direction)] = comm(b.mtp, direction) - comm(b.moe, direction) - comm(b.head,
                                                                                                     direction)
    mem = stage_memory(w, lay, b, even_stage(w, lay, np.array([stage])))
    step = gradient_comm(w, lay, mem)
    for group in ("dp", "edp"):
        out[("step", group, "step")] = float((step[group][0] + step[group][1])[0])
    for group in ("tp", "ep"):
        out[("step", group, "step")] = float(step[group][0])
    return out


def model_volumes(report: ParallelReport) -> dict:
    """The report's wire bytes per rank in planner_volumes' blocks: the stage's first dense and first MoE layer,
    the embedding and the head (the main ones), mtp.0's eh_proj and embedding lookup, the step's dp / edp / tp / ep
    sums."""
    first, end = report.layers
    moe_layers = [i for i in range(first, end) if _is_moe(report, i)]
    dense_layers = [i for i in range(first, end) if i not in moe_layers]
    out = {}
    for direction in ("forward", "backward"):
        def wire(where, groups=("tp",)):
            return sum(report.wire_bytes(direction=direction, group=g, where=where) for g in groups)
        if dense_layers:
            out[("dense_layer", "tp", direction)] = wire(f"layers.{dense_layers[0]}")
        if report.layout.cp > 1 and (dense_layers or moe_layers):
            out[("attention", "cp", direction)] = wire(f"layers.{(dense_layers + moe_layers)[0]}", ("cp",))
        if moe_layers:
            out[("moe_layer", "tp", direction)] = wire(f"layers.{moe_layers[0]}", ("tp", "tp_cp"))
            out[("moe_layer", "ep", direction)] = wire(f"layers.{moe_layers[0]}", ("ep", "ep_node", "ep_inter", "etp"))
        if report.has_embedding:
            out[("embedding", "tp", direction)] = wire(lambda w: w == "embed_tokens")
        if report.has_head:
            out[("head", "tp", direction)] = wire(lambda w: w in ("lm_head", "cross_entropy"))
            if report.layout.cp > 1:
                out[("head", "cp", direction)] = wire(lambda w: w == "cross_entropy", ("cp",))
            if any(w.name.startswith("mtp.0.") for w in report.weights):
                out[("mtp_extra", "tp", direction)] = wire(lambda w: w in ("mtp.0.eh_proj", "embed_tokens@mtp.0"))
    for group in ("dp", "edp", "tp", "ep"):
        out[("step", group, "step")] = report.wire_bytes(direction="step", group=group)
    return out


def _is_moe(report: ParallelReport, layer: int) -> bool:
    return any(w.name == f"layers.{layer}.mlp.gate.weight" for w in report.weights)


# ---- printing ----------------------------------------------------------------------------------------------------
def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _layer_runs(report: ParallelReport) -> list[tuple[int, int]]:
    """Consecutive decoder layers of one kind on the stage: [(first, last)], each run printed once."""
    first, end = report.layers
    kinds = {i: _is_moe(report, i) for i in range(first, end)}
    runs = []
    for i in range(first, end):
        if runs and kinds[runs[-1][1]] == kinds[i]:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _layer_of(name: str) -> int | None:
    if name.startswith("layers."):
        return int(name.split(".")[1])
    return None


def _step_where(name: str) -> str:
    layer = _layer_of(name)
    if layer is not None:
        return f"layers.{layer}.*"
    return "mtp.*" if name.startswith("mtp.") else name


def _collective_rows(report: ParallelReport, direction: str, shown: set, alike: dict) -> list[tuple]:
    """Rows of one direction: identical collectives of a module counted once (xN), the step's gradient sums of a
    layer in one row; layers alike to a shown one are left out, a line saying so after it."""
    groups: dict[tuple, list] = {}
    for c in report.select(direction=direction, host=True):
        layer = _layer_of(c.where)
        if layer is not None and layer not in shown:
            continue
        where = _step_where(c.where) if direction == "step" else c.where
        shape = "" if direction == "step" else _shape(c.shape)
        key = (where, c.what, c.kind, f"{c.group}={c.group_size}", shape, c.dtype)
        entry = groups.setdefault(key, [0, 0, 0.0, c.shape])
        entry[0] += 1
        entry[1] += c.payload_bytes
        entry[2] += c.wire_bytes
    rows, keys = [], list(groups)
    for i, key in enumerate(keys):
        n, payload, wire, one_shape = groups[key]
        where, what, kind, group, shape, dtype = key
        if direction == "step":
            shape = f"{n} tensors" if n > 1 else _shape(one_shape)
        elif n > 1:
            what = f"{what} (x{n})"
        rows.append((where, what, kind, group, shape, dtype, _bytes(payload), _bytes(wire)))
        layer = _layer_of(where)
        following = _layer_of(keys[i + 1][0]) if i + 1 < len(keys) else None
        if layer in alike and following != layer:
            rows.append((f"  layers {layer + 1}..{alike[layer]} alike", "", "", "", "", "", "", ""))
    return rows


def format_report(report: ParallelReport) -> str:
    """The sharding table and the collectives table of one rank, with their totals."""
    lay = report.layout
    first, end = report.layers
    sizes = report.group_sizes
    groups = ", ".join(f"{g}={sizes[g]}" for g in ("tp", "ep", "etp", "dp", "edp", "ep_node", "ep_inter", "world")
                       if sizes.get(g, 1) > 1 or g == "world")
    stage = (f"pipeline stage {report.stage} of {lay.pp} (the dry run's; pipeline parallelism is planned, not "
             f"trained), " if lay.pp > 1 else "")
    lines = [f"parallel plan of one rank: {stage}decoder layers {first}..{end - 1}"
             f"{', embedding' if report.has_embedding else ''}{', norm, head and MTP' if report.has_head else ''}",
             f"  groups: {groups}; sequence parallel: {bool(lay.sp) and lay.tp > 1}; micro-batch: {report.batch} "
             f"sequence(s) x {report.seq} tokens, {report.micro_batches} per step"]
    if lay.pp > 1:
        lines.append("  pipeline: the stage's layers as the dry run splits them (contiguous"
                     + ("; an interleaved schedule's chunks hold others" if lay.vpp > 1 else "") + "); the stage "
                     "transfers (point-to-point) and the norm's sum over stages are not listed")
        if report.has_head and not report.has_embedding and any(w.name.startswith("mtp.") for w in report.weights):
            lines.append("  MTP looks the next tokens up in the embedding on this stage: its collectives are listed, "
                         "but no copy of the embedding table is counted here (nor by the dry run)")
    runs = _layer_runs(report)
    shown = {a for a, _ in runs}
    alike = {a: b for a, b in runs if b > a}

    lines.append("weights (shard: what this rank holds):")
    rows = []
    for i, w in enumerate(report.weights):
        layer = _layer_of(w.name)
        if layer is not None and layer not in shown:
            continue
        split = f"dim {w.split_axis} over {w.group}={w.group_size}" if w.split_axis is not None else "replicated"
        if w.etp_axis is not None:
            split += f", dim {w.etp_axis} over etp={w.etp}"
        grad = "+".join(w.reduced_over) if w.reduced_over else "-"
        rows.append((w.name, _shape(w.full_shape), split, _shape(w.shard_shape),
                     f"{w.numel:,}" if w.trainable else f"{w.numel:,} (not trainable)", grad if w.trainable else ""))
        following = _layer_of(report.weights[i + 1].name) if i + 1 < len(report.weights) else None
        if layer in alike and following != layer:
            per = sum(x.numel for x in report.weights if _layer_of(x.name) == layer and x.trainable)
            rows.append((f"  layers {layer + 1}..{alike[layer]} alike ({per:,} trainable parameters each)",
                         "", "", "", "", ""))
    lines += _table(rows, ("name", "full shape", "split", "shard", "parameters", "gradient summed over"))
    lines.append(f"parameters per rank (stage {report.stage}): {report.parameters:,} = "
                 f"{_bytes(report.parameter_bytes)} in {PARAM_DTYPE} ({report.parameter_bytes:,} B), of them "
                 f"{report.expert_parameters:,} in routed experts")

    lines.append("collectives (shape: the tensor entering it; payload: the full buffer; wire: bytes this rank "
                 "sends under ring):")
    if not report.collectives:
        lines.append("  none: every group of this layout has one rank")
    for direction in DIRECTIONS:
        rows = _collective_rows(report, direction, shown, alike)
        if rows:
            lines.append(f"  {direction}" + (" (once a step)" if direction == "step" else " (each micro-batch)") + ":")
            lines += _table(rows, ("where", "what", "kind", "group", "shape", "dtype", "payload", "wire"))

    fwd, bwd = report.wire_bytes(direction="forward"), report.wire_bytes(direction="backward")
    step, host = report.wire_bytes(direction="step"), report.wire_bytes(direction="step", host=True)
    lines.append(f"collective wire bytes per rank: forward {_bytes(fwd)} + backward {_bytes(bwd)} per micro-batch; "
                 f"gradient reduction {_bytes(step)} (+ {_bytes(host - step)} on the host) per step")
    per_group: dict[str, float] = {}
    for c in report.collectives:
        per_group[c.group] = per_group.get(c.group, 0.0) + c.wire_bytes * (
            1 if c.direction == "step" else report.micro_batches)
    by_group = ", ".join(f"{g} {_bytes(v)}" for g, v in sorted(per_group.items()))
    total = report.step_wire_bytes()
    lines.append(f"collective wire bytes per rank and step ({report.micro_batches} micro-batch(es)): "
                 f"{_bytes(total)} ({total:,.0f} B; payload {report.step_payload_bytes():,} B)"
                 + (f"; by group: {by_group}" if by_group else ""))
    return "\n".join(lines)


def _table(rows, header) -> list[str]:
    if not rows:
        return []
    sized = [r for r in rows if any(r[1:])] + [header]
    widths = [max(len(str(r[i])) for r in sized) for i in range(len(header))]
    out = ["    " + "  ".join(str(h).ljust(widths[i]) for i, h in enumerate(header)).rstrip()]
    for r in rows:
        if not any(r[1:]):
            out.append("    " + r[0].strip())
            continue
        out.append("    " + "  ".join(str(v).ljust(widths[i]) for i, v in enumerate(r)).rstrip())
    return out


def format_planner_comparison(report: ParallelReport, cfg, recompute: str = "none") -> str:
    """The planner's bytes for the same layout beside the model's (planner_volumes, model_volumes)."""
    lay = report.layout
    if lay.tp == 1 and lay.ep == 1 and lay.dp == 1:
        return ""
    planner = planner_volumes(cfg, lay, report.batch, report.seq, report.stage, recompute)
    model = model_volumes(report)
    lines = ["planner's communication for this layout (cost_model.py, ring wire bytes per rank) beside the model's:"]
    if lay.tp > 1 and not lay.sp:
        lines.append("  (the planner prices sequence parallelism whenever tp > 1; this layout has it off)")
    rows = []
    for key in sorted(model, key=lambda k: (k[0], k[1], DIRECTIONS.index(k[2]))):
        block, group, direction = key
        m, p = model[key], planner.get(key, 0.0)
        if m == 0 and p == 0:
            continue
        rows.append((block, group, direction, f"{m:,.0f}", f"{p:,.0f}", f"{m / p:.3f}" if p else "-"))
    return "\n".join(lines + _table(rows, ("block", "group", "direction", "model", "planner", "model/planner")))
