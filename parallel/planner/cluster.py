"""Cluster descriptions: one YAML per machine type in parallel/planner/clusters/, each figure with its source."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from oneline import InputError

CLUSTER_DIR = Path(__file__).resolve().parent / "clusters"
GIB = 2 ** 30


class ClusterError(InputError):
    """A cluster file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Runtime:
    """How a machine's training runtime departs from the analytic model, fitted on real training steps by
    `parallel.planner.calibrate.fit_runtime` (the `runtime:` section of a cluster file; absent: an accelerator
    runtime that sinks its graph, hides launches and reuses activation memory, i.e. these defaults).

    Step time = compute_scale x the modelled compute, but expert_compute_scale x the modelled time of the routed
    experts' grouped kernel (its own implementation: on CPU a host kernel over per-expert GEMMs) and update_scale x
    the modelled optimizer update (a stream over the weights; on CPU a chain of elementwise kernels per weight, each
    writing its own output), plus accumulate_scale x a stream over the gradients and an accumulation buffer per
    micro-batch (and one more) when a step accumulates (0: accumulation fused into the weight-gradient GEMMs, as
    on accelerators), and step_overhead per step (the host's work around the graphs: batch, loss and load
    readback, expert-bias update). With devices_share_cores the devices of a node are processes on one host's
    cores (msrun on a CPU): k of them running share its compute and memory bandwidth, each 1/k; their host-side
    costs run on a core each.

    With keeps_op_outputs the runtime holds every operator output of a compiled graph until the step ends
    (MindSpore on CPU): a step holds activation_outputs
    bytes per byte of the activations a micro-batch keeps without recompute (plus its largest transient),
    recompute_outputs bytes per byte of recomputed activations (recompute adds outputs instead of freeing
    them), once per compiled graph (a step that accumulates gradients runs two: accumulate, and accumulate and
    update, and holds an accumulation buffer besides), weight_outputs bytes per byte of gradients (the gradients
    and the optimizer's weight-sized temporaries), and graph_memory bytes of fixed working memory per graph.

    communicator_memory is the bytes a device holds per communication group of more than one device it belongs
    to (data, tensor, pipeline, expert, expert-tensor parallel): the collective library's own buffers (0: not
    modelled). Where the runtime does not keep every operator output, graph_memory is the runtime's fixed working
    memory once (an accelerator's context and loaded kernels). With fixed_memory_in_pool these two count against the
    usable memory; without it the usable memory is the framework's memory pool (MindSpore's max_device_memory) and
    they are allocated beside it, by the collective library and the driver, in the rest of the device memory.

    With rendezvous_transfers a pipeline transfer holds both of its ends until both have reached it (the CPU
    transport: an all-reduce on the pair's group), so the planner's simulation runs each stage's executor program
    (parallel.pipeline.timeline.simulate_programs); without it a send is eager (parallel.pipeline.simulator).

    reference_step_time is the seconds of one step of the calibration's reference probe
    (telechat_moe.calibration.REFERENCE) when these constants were fitted: the machine speed they hold for (0: not
    fitted on training steps). A shared machine's speed drifts; that probe's step measured beside another run says
    how fast the machine was then."""
    compute_scale: float = 1.0
    expert_compute_scale: float = 1.0
    update_scale: float = 1.0
    accumulate_scale: float = 0.0
    step_overhead: float = 0.0
    devices_share_cores: bool = False
    keeps_op_outputs: bool = False
    activation_outputs: float = 1.0
    recompute_outputs: float = 0.0
    weight_outputs: float = 1.0
    graph_memory: float = 0.0
    communicator_memory: float = 0.0
    fixed_memory_in_pool: bool = True
    rendezvous_transfers: bool = False
    reference_step_time: float = 0.0


@dataclass(frozen=True)
class Cluster:
    name: str
    devices_per_node: int
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s of one device
    memory_bytes: float
    memory_bandwidth: float  # bytes/s
    intra_bandwidth: float  # bytes/s per device and direction inside a node
    intra_latency: float
    inter_bandwidth: float  # bytes/s per device and direction between nodes
    inter_latency: float
    matmul_efficiency: float  # sustained fraction of peak FLOP/s on large GEMMs
    memory_efficiency: float  # sustained fraction of memory bandwidth on streaming kernels
    network_efficiency: float  # sustained fraction of link bandwidth in collectives
    attention_efficiency: float  # sustained fraction of peak in the attention kernel
    flash_attention: bool  # scores never materialised (and recomputed in backward)
    op_overhead: float  # seconds per operator launch not hidden behind the previous one
    usable_memory_fraction: float
    host_link_bandwidth: float = 0.0  # bytes/s per device and direction to host memory (0: none stated)
    runtime: Runtime = Runtime()
    sources: dict = field(default_factory=dict, compare=False)

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ClusterError(f"cluster {self.name}: no peak_flops for dtype {dtype!r} "
                               f"(has {sorted(self.peak_flops)})")
        return self.peak_flops[dtype]


def available_clusters() -> list[str]:
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))


def _get(doc: dict, path: str, where: str, kind=float, default=None, zero_ok: bool = False):
    node = doc
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            if default is not None:
                return default
            raise ClusterError(f"{where}: missing field {path}")
        node = node[key]
    if kind is bool:
        if not isinstance(node, bool):
            raise ClusterError(f"{where}: field {path} must be true or false, got {node!r}")
        return node
    try:
        value = kind(node)
    except (TypeError, ValueError):
        raise ClusterError(f"{where}: field {path} must be a {kind.__name__}, got {node!r}") from None
    if kind in (int, float) and not (value >= 0 if zero_ok else value > 0):
        raise ClusterError(f"{where}: field {path} must be {'non-negative' if zero_ok else 'positive'}, got {node!r}")
    return value


def _runtime(doc: dict, where: str) -> Runtime:
    section = doc.get("runtime")
    if section is None:
        return Runtime()
    if not isinstance(section, dict):
        raise ClusterError(f"{where}: field runtime must be a mapping")
    names = {f.name: f for f in fields(Runtime)}
    unknown = sorted(set(section) - set(names))
    if unknown:
        raise ClusterError(f"{where}: unknown field runtime.{unknown[0]} (expected one of {', '.join(names)})")
    return Runtime(**{k: _get(section, k, where + " runtime", bool if names[k].type in (bool, "bool") else float,
                              zero_ok=k != "compute_scale") for k in section})


def cluster_from_dict(doc: dict, where: str) -> Cluster:
    if not isinstance(doc, dict):
        raise ClusterError(f"{where}: expected a mapping at the top level")
    peaks = doc.get("device", {}).get("peak_flops") if isinstance(doc.get("device"), dict) else None
    if not isinstance(peaks, dict) or not peaks:
        raise ClusterError(f"{where}: field device.peak_flops must map dtype names to FLOP/s")
    peak_flops = {str(k): _get(peaks, str(k), where + " device.peak_flops") for k in peaks}
    eff = {k: _get(doc, f"efficiency.{k}", where) for k in ("matmul", "memory", "network", "attention")}
    for k, v in eff.items():
        if v > 1:
            raise ClusterError(f"{where}: field efficiency.{k} is a fraction of peak, got {v}")
    usable = _get(doc, "usable_memory_fraction", where)
    if usable > 1:
        raise ClusterError(f"{where}: field usable_memory_fraction must be at most 1, got {usable}")
    # optional, so that a calibration's file without it loads: only activation offload needs it
    host_link = _get(doc, "host_link.bandwidth", where) if "host_link" in doc else 0.0
    return Cluster(
        name=str(doc.get("name", where)), devices_per_node=_get(doc, "devices_per_node", where, int),
        peak_flops=peak_flops, memory_bytes=_get(doc, "device.memory_gib", where) * GIB,
        memory_bandwidth=_get(doc, "device.memory_bandwidth", where),
        intra_bandwidth=_get(doc, "intra_node.bandwidth", where), intra_latency=_get(doc, "intra_node.latency", where),
        inter_bandwidth=_get(doc, "inter_node.bandwidth", where), inter_latency=_get(doc, "inter_node.latency", where),
        matmul_efficiency=eff["matmul"], memory_efficiency=eff["memory"], network_efficiency=eff["network"],
        attention_efficiency=eff["attention"], flash_attention=_get(doc, "flash_attention", where, bool),
        op_overhead=_get(doc, "op_overhead", where), usable_memory_fraction=usable, host_link_bandwidth=host_link,
        runtime=_runtime(doc, where),
        sources=dict(doc.get("sources") or {}))


def load_cluster(name_or_path: str) -> Cluster:
    """A cluster by name (a file in clusters/) or by path to a YAML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = CLUSTER_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ClusterError(f"--cluster: unknown cluster {name_or_path!r}; available: {', '.join(available_clusters())}")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ClusterError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return cluster_from_dict(doc, str(path))
