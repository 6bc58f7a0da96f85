"""How accurate is the planner on what we can measure? Measure, then predict, training steps on this CPU.

For each configuration (the tiny and small recipes, varying hidden size, sequence, experts, top-k, global batch,
micro-batches, recompute, and data parallelism under msrun) `telechat_moe.calibration.measure_steps` runs the
trainer and measures the step memory and the step time, the latter in rounds with a step of the calibration's
reference probe beside each step (in the same process(es)); the planner predicts both from
parallel/planner/clusters/cpu.yaml (run `python -m scripts.calibrate_cluster` first: it measures the machine and
fits the runtime constants on probe recipes, none of which is a case here), the step time at the machine's speed
then: the predicted time at calibration speed x the reference step now / the reference step at calibration.
Run: python -m bench.planner_accuracy [--rounds 7] [--only NAME ...] [--png accuracy.png] [--json rows.json]
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from oneline import OneLineParser
from parallel.planner.cluster import load_cluster
from telechat_moe.calibration import REFERENCE, measure_steps, predict_step

CONFIGS = [  # name, recipe, overrides (data_parallel > 1 runs under msrun)
    ("tiny", "tiny", []),
    ("tiny-hidden384", "tiny", ["model.hidden_size=384"]),
    ("tiny-seq512", "tiny", ["model.seq_length=512", "model.max_position_embeddings=512",
                             "model.original_max_position_embeddings=512"]),
    ("tiny-experts32", "tiny", ["model.n_routed_experts=32"]),
    ("tiny-top2", "tiny", ["model.num_experts_per_tok=2"]),
    ("tiny-batch16", "tiny", ["training.global_batch_size=16"]),
    ("tiny-micro4", "tiny", ["parallel_config.micro_batch_num=4"]),
    ("tiny-recompute", "tiny", ["recompute_config.recompute=true"]),
    ("tiny-selective", "tiny", ["recompute_config.select_recompute=true"]),
    ("small", "small", []),
    ("small-seq128", "small", ["model.seq_length=128", "model.max_position_embeddings=128",
                               "model.original_max_position_embeddings=128"]),
    ("small-micro2", "small", ["parallel_config.micro_batch_num=2"]),
    ("tiny-dp2", "tiny", ["parallel_config.data_parallel=2"]),
    ("small-dp2", "small", ["parallel_config.data_parallel=2"]),
]


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, key, unit, scale in ((axes[0], "step_time", "s", 1.0), (axes[1], "step_memory", "MiB", 2 ** 20)):
        meas = [r["measured"][key] / scale for r in rows]
        pred = [r["predicted"][key] / scale for r in rows]
        ax.scatter(meas, pred)
        for r, x, y in zip(rows, meas, pred):
            ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        lo, hi = min(meas + pred) * 0.8, max(meas + pred) * 1.2
        ax.plot([lo, hi], [lo, hi], "k--", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {key.replace('_', ' ')} ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
    fig.suptitle("planner vs measured training steps on this CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="rounds of steps; the first two are warm-up, not timed")
    ap.add_argument("--only", nargs="*", help="configuration names to run")
    ap.add_argument("--png", help="write predicted-vs-measured scatter plots")
    ap.add_argument("--json", help="write the per-case results")
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds: at least 3 (two warm-up rounds, then the timed ones)")
    configs = [c for c in CONFIGS if not args.only or c[0] in args.only]
    cpu = load_cluster("cpu")
    if not cpu.runtime.reference_step_time:
        ap.error("parallel/planner/clusters/cpu.yaml: runtime.reference_step_time missing; run "
                 "`python -m scripts.calibrate_cluster` first")
    rows = []
    with tempfile.TemporaryDirectory(prefix="planner_accuracy_") as tmp:
        for i, (name, recipe, overrides) in enumerate(configs, 1):
            print(f"[{i}/{len(configs)}] {name}: measuring ...", file=sys.stderr, flush=True)
            measured = measure_steps(recipe, overrides, Path(tmp), name, rounds=args.rounds, beside=[REFERENCE])
            predicted = predict_step(recipe, overrides, cpu)
            measured["speed"] = measured["beside"][REFERENCE[0]] / cpu.runtime.reference_step_time
            predicted["step_time"] *= measured["speed"]
            err = {k: predicted[k] / measured[k] - 1 for k in ("step_time", "step_memory")}
            rows.append({"name": name, "measured": measured, "predicted": predicted, "error": err})
            print(f"{name:16s} step: measured {measured['step_time']:7.3f} s, predicted {predicted['step_time']:7.3f} s "
                  f"({100 * err['step_time']:+6.1f}%)   step memory: measured {measured['step_memory'] / 2**20:8.1f} "
                  f"MiB, predicted {predicted['step_memory'] / 2**20:8.1f} MiB ({100 * err['step_memory']:+6.1f}%)   "
                  f"reference step {measured['speed']:.2f}x calibration's",
                  flush=True)
    for key in ("step_time", "step_memory"):
        errs = [abs(r["error"][key]) for r in rows]
        print(f"{key}: mean absolute error {100 * sum(errs) / len(errs):.1f}% over {len(errs)} cases, "
              f"worst {100 * max(errs):.1f}%")
    if args.png:
        plot(rows, args.png)
        print(f"wrote {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
