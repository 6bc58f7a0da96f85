"""A recipe as the planner sees it: its model on a device count of a cluster (`recipe_workload`), its own parallel
layout with the planner's choices beside the degrees (`recipe_layout`), and the device memory a plan must respect
(`memory_limit`). The planner CLI (`python -m telechat_moe.plan`) and bench/pipeline.py both start here.
"""
from __future__ import annotations

import dataclasses

from oneline import InputError
from parallel.layout import ParallelLayout
from parallel.planner.cluster import Cluster, ClusterError, load_cluster
from parallel.planner.workload import Precision, Workload

# The recipe's dtype names: the planner's name for GEMMs in it, and its bytes.
DTYPES = {"float32": ("fp32", 4), "bfloat16": ("bf16", 2), "float16": ("fp16", 2)}
# `--precision`'s tensor kinds (the Precision field each sets, and how many elements per parameter or activation:
# Adam keeps two moments) and dtypes; `none` only says there is no master copy.
PRECISION_KINDS = {"weights": ("param_bytes", 1), "master": ("master_bytes", 1), "grads": ("grad_bytes", 1),
                   "moments": ("optimizer_bytes", 2), "activations": ("activation_bytes", 1)}
PRECISION_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "none": 0}


class WorkloadError(InputError):
    """A recipe that cannot be priced on the cluster (unknown cluster, no peak for the GEMM dtype)."""


def parse_precision(text: str) -> dict[str, int]:
    """`weights=bf16,master=fp32,grads=fp32,moments=fp32` as Precision fields; a kind left out keeps its default."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, sep, dtype = (x.strip() for x in item.partition("="))
        if not sep or kind not in PRECISION_KINDS:
            raise WorkloadError(f"--precision: {item!r} is not kind=dtype with kind in {', '.join(PRECISION_KINDS)}")
        if dtype not in PRECISION_DTYPES or (dtype == "none" and kind != "master"):
            allowed = [d for d in PRECISION_DTYPES if d != "none" or kind == "master"]
            raise WorkloadError(f"--precision: {kind} expects one of {', '.join(allowed)}, got {dtype!r}")
        field, count = PRECISION_KINDS[kind]
        out[field] = count * PRECISION_DTYPES[dtype]
    return out


def recipe_precision(recipe, dtype: str) -> Precision:
    """The recipe's bytes per tensor kind, as the dry run counts them (telechat_moe.dry_run.static_memory): weights
    and gradients in model.params_dtype, AdamW's two moments in float32, a float32 master copy where the weights
    are below float32 (Precision's own rule: so it follows weights restated below float32); activations in the
    GEMM dtype (fp32 GEMMs keep fp32 activations)."""
    weights = DTYPES[recipe.model.params_dtype][1]
    return Precision(matmul_dtype=dtype, activation_bytes=4 if dtype == "fp32" else 2, param_bytes=weights,
                     grad_bytes=weights, optimizer_bytes=8)


def recipe_workload(recipe, cluster: str | Cluster, devices: int | None = None, seq: int | None = None,
                    global_batch: int | None = None, dtype: str | None = None,
                    precision: str | None = None) -> Workload:
    """The recipe's model on `devices` of `cluster` (a name, a YAML path or a loaded Cluster). Unset arguments take
    the recipe's own: its layout's device count, model.seq_length, training.global_batch_size, GEMMs in
    model.compute_dtype and the trainer's bytes per tensor kind (`recipe_precision`), of which `precision`
    (`parse_precision`'s text) restates any; the cluster's usable memory is the recipe's
    context.max_device_memory_gb where it sets one (the cap the trainer runs under and the dry run checks). Its expert exchanges move the routed copies, as this project's
    dispatchers do."""
    if not isinstance(cluster, Cluster):
        try:
            cluster = load_cluster(cluster)
        except ClusterError as e:
            raise WorkloadError(str(e)) from None
    dtype = dtype or DTYPES[recipe.model.compute_dtype][0]
    if dtype not in cluster.peak_flops:
        raise WorkloadError(f"--dtype: cluster {cluster.name} has no peak for {dtype} (has "
                            f"{', '.join(sorted(cluster.peak_flops))}); pass --dtype")
    if recipe.context.max_device_memory_gb > 0:   # the recipe's memory pool cap is what a plan must fit in
        cluster = dataclasses.replace(cluster, usable_memory_fraction=recipe.context.max_device_memory_gb
                                      * 2 ** 30 / cluster.memory_bytes)
    bytes_per_kind = dataclasses.replace(recipe_precision(recipe, dtype), **parse_precision(precision or ""))
    seq = seq or recipe.model.seq_length
    shape = dataclasses.replace(recipe.model.to_model_shape(), seq_length=seq)
    return Workload(shape, cluster, devices or recipe.layout.world_size, seq,
                    global_batch or recipe.training.global_batch_size, bytes_per_kind,
                    shard_optimizer=recipe.parallel_config.optimizer_shard)


def recipe_ep_scheme(recipe) -> str:
    """The planner's EP scheme of the recipe's token dispatcher."""
    return "hierarchical" if recipe.model.moe_token_dispatcher_type == "hierarchical" else "flat"


def recipe_layout(recipe, w: Workload) -> ParallelLayout:
    """The recipe's own layout on the workload's cluster with what the planner chooses beside the degrees
    (micro-batch size for the workload's global batch, recompute, EP scheme, EP overlap: token slices), as `python -m telechat_moe.plan --recipe R --cluster C
    --evaluate ...` scores it."""
    lay = recipe.layout
    return dataclasses.replace(lay, devices_per_node=w.cluster.devices_per_node,
                               micro_batch_size=w.global_batch // (lay.dp * lay.micro_batch_num),
                               recompute=recipe.recompute_config.mode, ep_scheme=recipe_ep_scheme(recipe),
                               ep_overlap=recipe.model.moe_comm_chunks > 1)


def memory_limit(recipe, w: Workload) -> float:
    """Bytes per device: the recipe's context.max_device_memory_gb (MindSpore's GB are GiB) or the cluster's usable
    memory."""
    gb = recipe.context.max_device_memory_gb
    return gb * 2 ** 30 if gb > 0 else w.cluster.usable_memory


def device_cluster(recipe) -> str:
    """The cluster that prices the recipe's device: clusters/cpu.yaml on CPU, ascend910b on Ascend."""
    return "ascend910b" if recipe.context.device_target == "Ascend" else "cpu"


def recipe_placement(recipe):
    """The pipeline placement the trainer builds for a recipe with pipeline_stage > 1 (telechat_moe/pipeline_step.py:
    stage_plan) and the dry run counts memory by: the placement MILP (`balance`) over the planner's units of its
    model on the cluster that prices its device (clusters/cpu.yaml on CPU, ascend910b on Ascend), its segments
    laid on the stages as the schedule runs them (DualPipeV's V, else interleaved)."""
    from parallel.pipeline.placement import PlacementOptions, balance, planner_units
    from parallel.pipeline.schedules import ChunkLayout
    w = recipe_workload(recipe, device_cluster(recipe))
    layout = recipe_layout(recipe, w)
    shape = ChunkLayout.V if recipe.parallel_config.pipeline_scheduler == "dualpipev" else ChunkLayout.INTERLEAVED
    return balance(planner_units(w, layout), layout.pp, layout.vpp,
                   PlacementOptions(micro_batches=layout.micro_batch_num, chunk_layout=shape))
