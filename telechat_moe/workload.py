"""A recipe as the planner sees it: its model on a device count of a cluster (`recipe_workload`), its own parallel
layout with the planner's choices beside the degrees (`recipe_layout`), and the device memory a plan must respect
(`memory_limit`). The planner CLI (`python -m telechat_moe.plan`) and bench/pipeline.py both start here.
"""
from __future__ import annotations

import dataclasses

from oneline import InputError
from parallel.layout import ParallelLayout
from parallel.planner.cluster import Cluster, ClusterError, load_cluster
from parallel.planner.cost_model import Precision, Workload

# The recipe's dtype names: the planner's name for GEMMs in it, and its bytes.
DTYPES = {"float32": ("fp32", 4), "bfloat16": ("bf16", 2), "float16": ("fp16", 2)}


class WorkloadError(InputError):
    """A recipe that cannot be priced on the cluster (unknown cluster, no peak for the GEMM dtype)."""


def recipe_workload(recipe, cluster: str | Cluster, devices: int | None = None, seq: int | None = None,
                    global_batch: int | None = None, dtype: str | None = None) -> Workload:
    """The recipe's model on `devices` of `cluster` (a name, a YAML path or a loaded Cluster). Unset arguments take
    the recipe's own: its layout's device count, model.seq_length, training.global_batch_size, and GEMMs in
    model.compute_dtype. Its expert exchanges are this project's dispatchers' padded buffers."""
    if not isinstance(cluster, Cluster):
        try:
            cluster = load_cluster(cluster)
        except ClusterError as e:
            raise WorkloadError(str(e)) from None
    dtype = dtype or DTYPES[recipe.model.compute_dtype][0]
    if dtype not in cluster.peak_flops:
        raise WorkloadError(f"--dtype: cluster {cluster.name} has no peak for {dtype} (has "
                            f"{', '.join(sorted(cluster.peak_flops))}); pass --dtype")
    param_bytes = DTYPES[recipe.model.params_dtype][1]
    precision = Precision(matmul_dtype=dtype, activation_bytes=4 if dtype == "fp32" else 2, param_bytes=param_bytes,
                          grad_bytes=param_bytes, optimizer_bytes=8)
    seq = seq or recipe.model.seq_length
    shape = dataclasses.replace(recipe.model.to_model_shape(), seq_length=seq)
    return Workload(shape, cluster, devices or recipe.layout.world_size, seq,
                    global_batch or recipe.training.global_batch_size, precision,
                    shard_optimizer=recipe.parallel_config.optimizer_shard, padded_exchange=True)


def recipe_ep_scheme(recipe) -> str:
    """The planner's EP scheme of the recipe's token dispatcher."""
    return "hierarchical" if recipe.model.moe_token_dispatcher_type == "hierarchical" else "flat"


def recipe_layout(recipe, w: Workload) -> ParallelLayout:
    """The recipe's own layout on the workload's cluster with what the planner chooses beside the degrees
    (micro-batch size for the workload's global batch, recompute, EP scheme), as `python -m telechat_moe.plan --recipe R --cluster C
    --evaluate ...` scores it."""
    lay = recipe.layout
    return dataclasses.replace(lay, devices_per_node=w.cluster.devices_per_node,
                               micro_batch_size=w.global_batch // (lay.dp * lay.micro_batch_num),
                               recompute=recipe.recompute_config.mode, ep_scheme=recipe_ep_scheme(recipe))


def memory_limit(recipe, w: Workload) -> float:
    """Bytes per device: the recipe's context.max_device_memory_gb (MindSpore's GB are GiB) or the cluster's usable
    memory."""
    gb = recipe.context.max_device_memory_gb
    return gb * 2 ** 30 if gb > 0 else w.cluster.usable_memory
