"""Measure this machine and write it as a cluster: `python -m parallel.planner.calibrate [--out FILE]`.

Measured: fp32 GEMM FLOP/s (numpy/OpenBLAS, large square GEMMs, best of several), attention-shaped batched GEMM
FLOP/s (their ratio is the attention efficiency), streaming memory bandwidth (array copy), loopback TCP
bandwidth and latency between two processes (the transport of msrun's CPU collectives on one machine), and,
when MindSpore is importable, the per-operator launch overhead of a graph-mode kernel chain and the FLOP/s of
graph-mode MatMuls of a layer's shape, whose ratio to the large numpy GEMM is the matmul efficiency. Memory and
network efficiencies are 1: their peak and sustained rates are the same measurement here.

Then the runtime (cluster.Runtime): real training steps of eight small probe recipes (two-layer variants of
tiny.yaml and small.yaml, none of them a configuration bench/planner_accuracy.py checks) are measured, their
memory and step time each in its own process, the time beside a reference probe that gives the machine's speed
(`probe.measure_steps`; a data-parallel variant under msrun besides, for the communicators' memory), and the
runtime constants are fitted to them by non-negative least squares. The planner is linear in each group of
constants (time: compute, expert-kernel, update and accumulation scales and the cost per step; memory: five), so
their coefficients come from evaluating it at unit constants: the fit and the planner share one formula. The
reference probe's step time is kept with them: the machine's speed they hold for.
"""
from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from oneline import OneLineParser
from parallel.planner.cluster import CLUSTER_DIR, GIB, Runtime, cluster_from_dict


def _best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_flops(n: int = 1536, repeats: int = 5) -> float:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    return 2 * n ** 3 / _best_seconds(lambda: a @ b, repeats)


def attention_gemm_flops(heads: int = 8, seq: int = 512, head_dim: int = 32, repeats: int = 5) -> float:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((heads, seq, head_dim), dtype=np.float32)
    k = rng.standard_normal((heads, head_dim, seq), dtype=np.float32)
    return 2 * heads * seq * seq * head_dim / _best_seconds(lambda: np.matmul(q, k), repeats)


def memory_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    src = np.ones(mib * 2 ** 20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    return 2 * src.nbytes / _best_seconds(lambda: np.copyto(dst, src), repeats)  # read + write


def _sink(port_queue, total: int) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.recv(1)
    conn.sendall(b"p")  # latency ping answered once
    got = 0
    while got < total:
        got += len(conn.recv(1 << 20))
    conn.sendall(b"d")
    conn.close()


def loopback_link(total_mib: int = 256) -> tuple[float, float]:
    """(bandwidth bytes/s, one-way latency s) of a TCP stream between two local processes."""
    total = total_mib * 2 ** 20
    queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_sink, args=(queue, total))
    proc.start()
    client = socket.create_connection(("127.0.0.1", queue.get(timeout=30)))
    t0 = time.perf_counter()
    client.sendall(b"p")
    client.recv(1)
    latency = (time.perf_counter() - t0) / 2
    chunk = b"\0" * (1 << 20)
    t0 = time.perf_counter()
    for _ in range(total_mib):
        client.sendall(chunk)
    client.recv(1)
    bandwidth = total / (time.perf_counter() - t0)
    client.close()
    proc.join(timeout=30)
    return bandwidth, latency


def mindspore_op_overhead(chain: int = 200, repeats: int = 5) -> float | None:
    """Seconds per tiny operator in a MindSpore graph-mode kernel chain on CPU, or None without MindSpore."""
    try:
        import mindspore as ms
    except ImportError:
        return None
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")

    @ms.jit
    def chained(x):
        for _ in range(chain):
            x = x * 1.0001 + 0.0001
        return x

    x = ms.Tensor(np.ones((8, 8), np.float32))
    seconds = _best_seconds(lambda: chained(x).asnumpy(), repeats)
    return seconds / (2 * chain)


def mindspore_gemm_flops(rows: int = 1024, k: int = 256, n: int = 768, chain: int = 16,
                         repeats: int = 5) -> float | None:
    """FLOP/s of MindSpore graph-mode fp32 MatMuls of a training layer's shape (tokens x hidden x FFN width)
    on CPU, or None without MindSpore: the framework's kernels at the sizes a layer runs, which the matmul
    efficiency (this over the large numpy GEMM) carries into the planner."""
    try:
        import mindspore as ms
    except ImportError:
        return None
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    matmul = ms.ops.MatMul()

    @ms.jit
    def chained(x, w_up, w_down):
        for _ in range(chain // 2):
            x = matmul(matmul(x, w_up), w_down)
        return x

    rng = np.random.default_rng(2)
    x = ms.Tensor(rng.standard_normal((rows, k), dtype=np.float32))
    w_up = ms.Tensor(rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(k))
    w_down = ms.Tensor(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(n))
    seconds = _best_seconds(lambda: chained(x, w_up, w_down).asnumpy(), repeats)
    return chain * 2 * rows * k * n / seconds


# Two-layer variants of tiny.yaml and small.yaml (1 dense and 1 MoE layer, MTP 1): each varies what some runtime
# constants scale. (name, recipe, overrides)
_TWO_LAYERS = ["model.num_hidden_layers=2", "model.n_routed_experts=8"]
_SEQ = lambda n: [f"model.seq_length={n}", f"model.max_position_embeddings={n}",  # noqa: E731
                  f"model.original_max_position_embeddings={n}"]
PROBES = [("base", "tiny", _TWO_LAYERS),
          ("top1", "tiny", _TWO_LAYERS + ["model.num_experts_per_tok=1"]),
          ("top8", "tiny", _TWO_LAYERS + ["model.num_experts_per_tok=8"]),
          ("experts32", "tiny", _TWO_LAYERS + ["model.n_routed_experts=32"]),
          ("small-2layers", "small", ["model.num_hidden_layers=2"]),
          ("seq384", "tiny", _TWO_LAYERS + _SEQ(384)),
          ("micro2", "tiny", _TWO_LAYERS + ["parallel_config.micro_batch_num=2"]),
          ("recompute", "tiny", _TWO_LAYERS + ["recompute_config.recompute=true"])]
# the base probe again: its step, measured beside every run, says how fast the machine is then
REFERENCE = ("reference", *PROBES[0][1:])
# a data-parallel probe under msrun, for memory only: the timing runs share one process
MEMORY_PROBES = PROBES + [("dp2", "tiny", _TWO_LAYERS + ["parallel_config.data_parallel=2"])]
_TIME = ("compute_scale", "expert_compute_scale", "update_scale", "accumulate_scale", "step_overhead")
_MEMORY = ("activation_outputs", "recompute_outputs", "weight_outputs", "graph_memory", "communicator_memory")


def _coefficients(cluster, recipe: str, overrides: list[str], key: str, names: tuple,
                  base: Runtime) -> tuple[float, list[float]]:
    """(offset, coefficient per constant) of the planner's `key` as a linear function of the runtime constants
    `names` (the others as in `base`)."""
    from parallel.planner.probe import predict_step

    def at(**values):
        rt = dataclasses.replace(base, **{**{n: 0.0 for n in names if n != "compute_scale"}, **values})
        return predict_step(recipe, overrides, dataclasses.replace(cluster, runtime=rt))[key]

    zero = at(compute_scale=1.0) if "compute_scale" in names else at()
    coef = [(at(compute_scale=2.0) - zero) if n == "compute_scale" else at(**{n: 1.0}) - zero for n in names]
    offset = zero - coef[0] if "compute_scale" in names else zero
    return offset, coef


def fit_runtime(cluster, measured: list[dict]) -> tuple[Runtime, list[dict]]:
    """Runtime constants fitted to measured probe steps (dicts with name, recipe, overrides, step_memory and,
    where timed, step_time at one machine speed); also the fit's prediction per probe."""
    from scipy.optimize import nnls

    from parallel.planner.probe import predict_step

    fitted = {}
    for key, names, base in (("step_time", _TIME, Runtime()), ("step_memory", _MEMORY, Runtime(keeps_op_outputs=True))):
        probes = [m for m in measured if key in m]
        rows = [_coefficients(cluster, m["recipe"], m["overrides"], key, names, base) for m in probes]
        y = np.array([m[key] for m in probes])
        a = np.array([c for _, c in rows])
        b = y - np.array([off for off, _ in rows])
        scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns of very different units
        x, _ = nnls(a / scale / y[:, None], b / y)  # relative errors: probes of different sizes
        fitted.update(zip(names, (x / scale).tolist()))
    fitted["compute_scale"] = max(fitted["compute_scale"], 1e-3)
    runtime = Runtime(keeps_op_outputs=True, devices_share_cores=True, **fitted)
    checked = dataclasses.replace(cluster, runtime=runtime)
    report = [{"name": m["name"], **{k: m[k] for k in ("step_time", "step_memory") if k in m},
               "predicted": predict_step(m["recipe"], m["overrides"], checked)} for m in measured]
    return runtime, report


def measure_runtime(cluster_doc: dict, rounds: int = 7) -> tuple[dict, list[dict]]:
    """Measure the probes and fit the runtime section of `cluster_doc` (which has the machine's rates). Each probe
    runs in its own process: its memory over its first steps alone, then its step time in rounds beside the
    reference probe, as bench/planner_accuracy.py measures its cases. The machine's speed drifts between minutes:
    each probe's time is brought to the reference's median speed over all probes by the reference beside it."""
    from parallel.planner.probe import measure_steps

    measured = []
    with tempfile.TemporaryDirectory(prefix="calibrate_") as tmp:
        for i, (name, recipe, overrides) in enumerate(MEMORY_PROBES, 1):
            timed = (name, recipe, overrides) in PROBES
            print(f"  probe {i}/{len(MEMORY_PROBES)}: {name} ({'memory, time' if timed else 'memory'}) ...",
                  file=sys.stderr, flush=True)
            measured.append({"name": name, "recipe": recipe, "overrides": overrides,
                             **measure_steps(recipe, overrides, Path(tmp), name, rounds=rounds if timed else 0,
                                             beside=[REFERENCE] if timed else [])})
    reference = float(np.median([m["beside"][REFERENCE[0]] for m in measured if "beside" in m]))
    for m in measured:
        if "beside" in m:
            m["step_time"] *= reference / m["beside"][REFERENCE[0]]
    runtime, report = fit_runtime(cluster_from_dict(cluster_doc, "calibration"), measured)
    runtime = dataclasses.replace(runtime, reference_step_time=reference)
    section = {f.name: getattr(runtime, f.name) for f in dataclasses.fields(Runtime)}
    section = {k: (v if isinstance(v, bool) else float(f"{v:.4g}")) for k, v in section.items()}
    return section, report


def total_memory_bytes() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024.0
    raise RuntimeError("MemTotal not found in /proc/meminfo")


def measure(use_mindspore: bool = True) -> dict:
    steps = [("fp32 GEMM", gemm_flops), ("attention-shaped GEMM", attention_gemm_flops),
             ("memory bandwidth", memory_bandwidth), ("loopback link", loopback_link)]
    if use_mindspore:
        steps += [("MindSpore op overhead", mindspore_op_overhead), ("MindSpore layer GEMM", mindspore_gemm_flops)]
    results = {}
    for i, (label, fn) in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] measuring {label} ...", file=sys.stderr, flush=True)
        results[label] = fn()
    return results


def cluster_document(results: dict, devices_per_node: int) -> dict:
    gemm = results["fp32 GEMM"]
    bandwidth, latency = results["loopback link"]
    overhead = results.get("MindSpore op overhead") or 0.0
    layer_gemm = results.get("MindSpore layer GEMM") or gemm
    host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    how = f"measured by `python -m parallel.planner.calibrate` on {host}, {stamp}"
    return {
        "name": "cpu",
        "devices_per_node": devices_per_node,
        "device": {"peak_flops": {"fp32": float(f"{gemm:.4g}")},
                   "memory_gib": round(total_memory_bytes() / GIB, 2),
                   "memory_bandwidth": float(f"{results['memory bandwidth']:.4g}")},
        "intra_node": {"bandwidth": float(f"{bandwidth:.4g}"), "latency": float(f"{latency:.3g}")},
        "inter_node": {"bandwidth": float(f"{bandwidth:.4g}"), "latency": float(f"{latency:.3g}")},
        "efficiency": {"matmul": round(min(1.0, layer_gemm / gemm), 3), "memory": 1.0, "network": 1.0,
                       "attention": round(min(1.0, results["attention-shaped GEMM"] / gemm), 3)},
        "flash_attention": False,
        "op_overhead": float(f"{max(overhead, 1e-9):.3g}"),
        "usable_memory_fraction": 0.8,
        "sources": {"device": how + " (numpy fp32 GEMM n=1536; np.copyto of 256 MiB)",
                    "intra_node": how + " (TCP loopback between two processes, 256 MiB stream)",
                    "inter_node": "one machine: same as intra_node",
                    "op_overhead": how + " (MindSpore graph-mode chain of tiny elementwise ops)",
                    "efficiency": how + " (matmul: MindSpore graph-mode MatMuls 1024x256x768 over the numpy GEMM; "
                                        "attention: batched 8x512x32x512 GEMMs over the numpy GEMM)"},
    }


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m parallel.planner.calibrate", description=__doc__)
    parser.add_argument("--out", default=str(CLUSTER_DIR / "cpu.yaml"), help="cluster YAML to write")
    parser.add_argument("--devices-per-node", type=int, default=8,
                        help="processes that msrun places on this machine, at most (default 8)")
    parser.add_argument("--no-mindspore", action="store_true",
                        help="skip what needs MindSpore: the op overhead, layer GEMMs and the training runtime")
    args = parser.parse_args(argv)
    if args.devices_per_node < 1:
        print("calibrate: --devices-per-node: expected a positive integer", file=sys.stderr)
        return 2
    out = Path(args.out)
    if not out.parent.is_dir():
        print(f"calibrate: --out: folder {out.parent} does not exist", file=sys.stderr)
        return 2
    doc = cluster_document(measure(not args.no_mindspore), args.devices_per_node)
    if not args.no_mindspore:
        print("measuring the training runtime on probe recipes ...", file=sys.stderr, flush=True)
        doc["runtime"], report = measure_runtime(doc)
        doc["sources"]["runtime"] = (doc["sources"]["device"].split(" (")[0] + " (fitted to training steps of "
                                     + ", ".join(name for name, _, _ in MEMORY_PROBES)
                                     + ": two-layer variants of tiny.yaml and small.yaml)")
        for r in report:
            step = (f"step {r['step_time']:.3f} s, fit {r['predicted']['step_time']:.3f} s; " if "step_time" in r
                    else "")
            print(f"  {r['name']:10s} {step}memory {r['step_memory'] / 2**20:.0f} MiB, fit "
                  f"{r['predicted']['step_memory'] / 2**20:.0f} MiB", file=sys.stderr)
    out.write_text("# Written by `python -m parallel.planner.calibrate`; rerun it to re-measure.\n"
                   + yaml.safe_dump(doc, sort_keys=False))
    print(f"wrote {out}: fp32 {doc['device']['peak_flops']['fp32'] / 1e9:.1f} GFLOP/s, memory "
          f"{doc['device']['memory_bandwidth'] / 1e9:.1f} GB/s, link {doc['intra_node']['bandwidth'] / 1e9:.2f} GB/s, "
          f"op overhead {doc['op_overhead'] * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
