"""This machine's rates, measured: what a CPU cluster file (clusters/cpu.yaml) is written from.

fp32 GEMM FLOP/s (numpy/OpenBLAS, large square GEMMs, best of several), attention-shaped batched GEMM FLOP/s
(their ratio is the attention efficiency), streaming memory bandwidth (array copy, read plus written: half of it is
the host link that activation offload uses, the device being the host), loopback TCP bandwidth and latency between
two processes (the transport of msrun's CPU collectives on one machine), the memory total, and,
when MindSpore is importable, the per-operator launch overhead of a graph-mode kernel chain and the FLOP/s of
graph-mode MatMuls of a layer's shape, whose ratio to the large numpy GEMM is the matmul efficiency.
`calibrate.cluster_document` turns `measure()`'s results into a cluster.
"""
from __future__ import annotations

import multiprocessing as mp
import socket
import sys
import time

import numpy as np


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


def total_memory_bytes() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024.0
    raise RuntimeError("MemTotal not found in /proc/meminfo")


def measure(use_mindspore: bool = True) -> dict:
    """{label: result} of every measurement above (the MindSpore ones only with `use_mindspore`), with a progress
    line per measurement on stderr."""
    steps = [("fp32 GEMM", gemm_flops), ("attention-shaped GEMM", attention_gemm_flops),
             ("memory bandwidth", memory_bandwidth),
             ("loopback link", loopback_link),
             ("memory total", total_memory_bytes)]
    if use_mindspore:
        steps += [("MindSpore op overhead", mindspore_op_overhead), ("MindSpore layer GEMM", mindspore_gemm_flops)]
    results = {}
    for i, (label, fn) in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] measuring {label} ...", file=sys.stderr, flush=True)
        results[label] = fn()
    return results
