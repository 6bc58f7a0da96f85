"""The planner's CPU runtime model fitted to measured training steps, and the cluster file of a measured machine.

`fit_runtime` fits the runtime constants (cluster.Runtime) to measured steps by non-negative least squares. Each
measured step comes with the planner's description of its run (a Workload and its layout as Layouts of one); the planner
is linear in each group of constants (time: compute, expert-kernel, update and accumulation scales and the cost
per step; memory: five), so their coefficients come from evaluating it at unit constants: the fit and the planner
share one formula (`step_prediction`). `cluster_document` writes the rates of `machine.measure()` as a cluster
YAML document; memory and network efficiencies are 1: their peak and sustained rates are the same measurement
here. The measuring (machine rates, real training steps of probe recipes) and the command that writes
clusters/cpu.yaml are `python -m scripts.calibrate_cluster`, with the probes in telechat_moe/calibration.py.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import platform

import numpy as np

from parallel.planner.blocks import block_costs
from parallel.planner.cluster import GIB, Cluster, Runtime
from parallel.planner.cost_model import evaluate, even_stage, stage_memory
from parallel.planner.workload import Layouts, Workload

TIME_CONSTANTS = ("compute_scale", "expert_compute_scale", "update_scale", "accumulate_scale", "step_overhead")
MEMORY_CONSTANTS = ("activation_outputs", "recompute_outputs", "weight_outputs", "graph_memory",
                    "communicator_memory")


def step_prediction(w: Workload, lay: Layouts) -> dict:
    """The planner's step time and step memory (activations, transients and gradients: what a step adds to the
    resident weights and optimizer states) of the single layout `lay`: what a measured step is compared with."""
    mem = stage_memory(w, lay, block_costs(w, lay), even_stage(w, lay, np.array([0])))
    return {"step_time": float(evaluate(w, lay)["step_time"][0]),
            "step_memory": float(mem["activations"][0] + mem["transient"][0] + mem["grads"][0])}


def _on(w: Workload, cluster: Cluster, runtime: Runtime) -> Workload:
    return dataclasses.replace(w, cluster=dataclasses.replace(cluster, runtime=runtime))


def _coefficients(cluster: Cluster, w: Workload, lay: Layouts, key: str, names: tuple,
                  base: Runtime) -> tuple[float, list[float]]:
    """(offset, coefficient per constant) of the planner's `key` as a linear function of the runtime constants
    `names` (the others as in `base`)."""
    def at(**values):
        rt = dataclasses.replace(base, **{**{n: 0.0 for n in names if n != "compute_scale"}, **values})
        return step_prediction(_on(w, cluster, rt), lay)[key]

    zero = at(compute_scale=1.0) if "compute_scale" in names else at()
    coef = [(at(compute_scale=2.0) - zero) if n == "compute_scale" else at(**{n: 1.0}) - zero for n in names]
    offset = zero - coef[0] if "compute_scale" in names else zero
    return offset, coef


def fit_runtime(cluster: Cluster, measured: list[dict]) -> tuple[Runtime, list[dict]]:
    """Runtime constants of `cluster` fitted to measured steps: dicts with name, workload (a Workload, evaluated
    on `cluster`), layouts (its layout, as Layouts of one), step_memory and, where timed, step_time at one machine
    speed; also the fit's prediction per step ({name, step_time, step_memory, predicted})."""
    from scipy.optimize import nnls

    fitted = {}
    for key, names, base in (("step_time", TIME_CONSTANTS, Runtime()),
                             ("step_memory", MEMORY_CONSTANTS, Runtime(keeps_op_outputs=True))):
        steps = [m for m in measured if key in m]
        rows = [_coefficients(cluster, m["workload"], m["layouts"], key, names, base) for m in steps]
        y = np.array([m[key] for m in steps])
        a = np.array([c for _, c in rows])
        b = y - np.array([off for off, _ in rows])
        scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns of very different units
        x, _ = nnls(a / scale / y[:, None], b / y)  # relative errors: steps of different sizes
        fitted.update(zip(names, (x / scale).tolist()))
    fitted["compute_scale"] = max(fitted["compute_scale"], 1e-3)
    runtime = Runtime(keeps_op_outputs=True, devices_share_cores=True, rendezvous_transfers=True, **fitted)
    report = [{"name": m["name"], **{k: m[k] for k in ("step_time", "step_memory") if k in m},
               "predicted": step_prediction(_on(m["workload"], cluster, runtime), m["layouts"])} for m in measured]
    return runtime, report


def runtime_section(runtime: Runtime) -> dict:
    """The `runtime:` section of a cluster file, figures to 4 significant digits."""
    section = {f.name: getattr(runtime, f.name) for f in dataclasses.fields(Runtime)}
    return {k: (v if isinstance(v, bool) else float(f"{v:.4g}")) for k, v in section.items()}


def cluster_document(results: dict, devices_per_node: int, measured_by: str) -> dict:
    """The cluster YAML document (without its runtime section) of `machine.measure()`'s results on this host;
    its sources name the command `measured_by`."""
    gemm = results["fp32 GEMM"]
    bandwidth, latency = results["loopback link"]
    overhead = results.get("MindSpore op overhead") or 0.0
    layer_gemm = results.get("MindSpore layer GEMM") or gemm
    host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    how = f"measured by `{measured_by}` on {host}, {stamp}"
    return {
        "name": "cpu",
        "devices_per_node": devices_per_node,
        "device": {"peak_flops": {"fp32": float(f"{gemm:.4g}")},
                   "memory_gib": round(results["memory total"] / GIB, 2),
                   "memory_bandwidth": float(f"{results['memory bandwidth']:.4g}")},
        "intra_node": {"bandwidth": float(f"{bandwidth:.4g}"), "latency": float(f"{latency:.3g}")},
        "inter_node": {"bandwidth": float(f"{bandwidth:.4g}"), "latency": float(f"{latency:.3g}")},
        # the device is the host: its link to host memory is a memcpy, whose bytes moved are half of what the
        # memory bandwidth counts (read plus written)
        "host_link": {"bandwidth": float(f"{results['memory bandwidth'] / 2:.4g}")},
        "efficiency": {"matmul": round(min(1.0, layer_gemm / gemm), 3), "memory": 1.0, "network": 1.0,
                       "attention": round(min(1.0, results["attention-shaped GEMM"] / gemm), 3)},
        # the CPU attention is dvm_fusion's blockwise kernel: no [s, s] scores kept, recomputed in the backward
        "flash_attention": True,
        "op_overhead": float(f"{max(overhead, 1e-9):.3g}"),
        "usable_memory_fraction": 0.8,
        "sources": {"device": how + " (numpy fp32 GEMM n=1536; np.copyto of 256 MiB)",
                    "intra_node": how + " (TCP loopback between two processes, 256 MiB stream)",
                    "inter_node": "one machine: same as intra_node",
                    "host_link": how + " (the device is the host: the memory bandwidth's np.copyto of 256 MiB, as "
                                       "bytes copied per second; offloading there frees no memory)",
                    "op_overhead": how + " (MindSpore graph-mode chain of tiny elementwise ops)",
                    "efficiency": how + " (matmul: MindSpore graph-mode MatMuls 1024x256x768 over the numpy GEMM; "
                                        "attention: batched 8x512x32x512 GEMMs over the numpy GEMM)"},
    }
