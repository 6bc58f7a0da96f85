"""Measure this machine and write it as a cluster: `python -m scripts.calibrate_cluster [--no-mindspore] [--out FILE]`.

Measured (parallel.planner.machine): fp32 GEMM FLOP/s (numpy/OpenBLAS, large square GEMMs, best of several),
attention-shaped batched GEMM FLOP/s (their ratio is the attention efficiency), streaming memory bandwidth (array
copy), the host link that activation offload uses (a memcpy rate: the device is the host), loopback TCP bandwidth
and latency between two processes (the transport of msrun's CPU collectives on one machine), and, when MindSpore
is importable, the per-operator launch overhead of a graph-mode kernel chain and the FLOP/s of graph-mode MatMuls
of a layer's shape, whose ratio to the large numpy GEMM is the matmul efficiency.
Memory and network efficiencies are 1: their peak and sustained rates are the same measurement here.

Then, with MindSpore, the runtime (cluster.Runtime): real training steps of eight small probe recipes (two-layer
variants of tiny.yaml and small.yaml, none of them a configuration bench/planner_accuracy.py checks) are measured,
their memory and step time each in its own process, the time beside a reference probe that gives the machine's
speed (telechat_moe/calibration.py; a data-parallel variant under msrun besides, for the communicators' memory),
and the runtime constants are fitted to them by non-negative least squares (parallel.planner.calibrate: the fit
and the planner share one formula). The reference probe's step time is kept with them: the machine's speed they
hold for. That part takes about 30 minutes on 2 cores.
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

from oneline import OneLineParser
from parallel.planner.calibrate import cluster_document
from parallel.planner.cluster import CLUSTER_DIR
from parallel.planner.machine import measure
from telechat_moe.calibration import MEMORY_PROBES, measure_runtime

COMMAND = "python -m scripts.calibrate_cluster"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog=COMMAND, description=__doc__)
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
    doc = cluster_document(measure(not args.no_mindspore), args.devices_per_node, COMMAND)
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
    out.write_text(f"# Written by `{COMMAND}`; rerun it to re-measure.\n" + yaml.safe_dump(doc, sort_keys=False))
    print(f"wrote {out}: fp32 {doc['device']['peak_flops']['fp32'] / 1e9:.1f} GFLOP/s, memory "
          f"{doc['device']['memory_bandwidth'] / 1e9:.1f} GB/s, host link {doc['host_link']['bandwidth'] / 1e9:.1f} "
          f"GB/s, link {doc['intra_node']['bandwidth'] / 1e9:.2f} GB/s, "
          f"op overhead {doc['op_overhead'] * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
