"""Attention-aware balancing of global batches: slot cost spread before/after, bounds, and time per batch.

    python -m bench.attention_balance                      # all cases, writes output/bench/attention_balance.*
    python -m bench.attention_balance --seq 32768 --dp 8 --batches 2

For each document-length source (the shared sample corpus tokenized, resampled with replacement to fill the
batches; a synthetic log-normal long tail) x sequence length (32K, 128K) x DP (8, 64, 512), global batches of 1024
packed samples are cut by the sequential packer and laid out over (DP rank, micro-batch) slots by four methods:
  sequential  - samples in packing order (what a plain loader does)
  tokens      - balance token counts per slot (LPT on tokens); with fully packed samples every slot already holds
                the same tokens, so this is the sequential spread again: equal tokens are not equal work
  reorder     - data_sched.attention_balance, sample permutation
  repack      - data_sched.attention_balance, document pieces moved between slots
Slot cost is the analytic training-FLOP model of TeleChat3-105B (recipes/105b.yaml; attention from the planner's
FLOP counter), or --cost FILE (a calibration from scripts/fit_attention_cost.py). Reported: max/mean slot cost
(per method, mean of the batches), the lower bound on max/mean (the most expensive indivisible sample for reorder;
the document pieces for repack, `repack_bound`), max/mean over DP ranks, CPU milliseconds per global batch to
plan it and gather one rank's share (what each rank does; time.process_time of this single-threaded process,
median and minimum of the timed runs, mean and worst over the batches: CPU time leaves out the time other
processes of a shared machine hold the core; BLAS/OpenMP threads are pinned to 1 before NumPy loads), and how many
document pieces repack cuts (extra pieces per sample).
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


from oneline import OneLineParser  # noqa: E402
from data_sched.attention_balance import (DocLengths, balance_global_batch, balanced_partition,  # noqa: E402
                                         lower_bounds)
from data_sched.attention_cost import CostModel  # noqa: E402
from data_sched.errors import DataError  # noqa: E402
from data_sched.packing import pack_lengths  # noqa: E402

SHARED_CORPUS = REPO.parent / "shared" / "data" / "corpus" / "corpus.jsonl"
GLOBAL_BATCH = 1024
MICRO_BATCHES = 8   # per rank, fewer when a rank holds fewer samples


def flops_cost_model() -> CostModel:
    from parallel.planner.model_shape import flops_per_token
    from telechat_moe.recipe import load_recipe

    shape = load_recipe(str(REPO / "recipes" / "105b.yaml")).model.to_model_shape()
    return CostModel.from_flops_per_token(lambda length: flops_per_token(shape, length)["training"], 4096,
                                          source="TeleChat3-105B training FLOPs (recipes/105b.yaml)")


def corpus_lengths(limit_docs: int | None = None) -> np.ndarray | None:
    """Token counts of the shared sample corpus (a tokenizer trained on it, 8192 pieces); None when absent."""
    if not SHARED_CORPUS.is_file():
        print(f"skipping the corpus source: {SHARED_CORPUS} is absent")
        return None
    import tempfile

    from data_sched.sources import load_texts
    from data_sched.tokenizer import Tokenizer, train_tokenizer

    texts = load_texts([str(SHARED_CORPUS)])[:limit_docs]
    with tempfile.TemporaryDirectory() as tmp:
        tok = Tokenizer.load(train_tokenizer(texts, 8192, f"{tmp}/spm"))
        return np.array([len(d) for d in tok.encode_documents(texts)], dtype=np.int64)


def synthetic_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """Log-normal long tail: median 2K tokens, about 1% above 128K."""
    return np.maximum(1, rng.lognormal(np.log(2048), 1.8, n)).astype(np.int64)


def batches_of(lengths_source, seq: int, batches: int, rng: np.random.Generator) -> list[list[np.ndarray]]:
    """`batches` global batches of document lengths from the sequential packer over resampled documents."""
    need = (batches * GLOBAL_BATCH + 1) * seq + 1
    draws = []
    total = 0
    while total < need:
        chunk = lengths_source(rng, 100_000) + 1      # + EOD
        draws.append(chunk)
        total += int(chunk.sum())
    seg = np.concatenate(draws)
    seg = seg[:int(np.searchsorted(np.cumsum(seg), need)) + 1]
    offsets, lens = pack_lengths(seg, seq)
    samples = [lens[offsets[i]:offsets[i + 1]] for i in range(batches * GLOBAL_BATCH)]
    return [samples[b * GLOBAL_BATCH:(b + 1) * GLOBAL_BATCH] for b in range(batches)]


def spread(costs: np.ndarray) -> float:
    return float(costs.max() / costs.mean())


def run_case(batches, dp: int, cost: CostModel, repeats: int) -> dict:
    per_rank = GLOBAL_BATCH // dp
    mb = min(MICRO_BATCHES, per_rank)
    slots = dp * mb
    rows = {k: [] for k in ("sequential", "tokens", "reorder", "repack", "bound_reorder", "bound_repack",
                            "rank_sequential", "rank_reorder", "rank_repack", "ms_reorder", "ms_repack",
                            "ms_min_reorder", "ms_min_repack", "cuts_per_sample")}
    for doc_lens in batches:
        off = balance_global_batch(doc_lens, "off", dp, mb, cost, seed=0)
        mean = off.slot_costs_before.mean()
        rows["sequential"].append(spread(off.slot_costs_before))
        rows["rank_sequential"].append(spread(off.rank_costs(off.slot_costs_before)))
        tokens = np.array([float(np.sum(x)) for x in doc_lens])
        members = balanced_partition(tokens, slots)
        sample_cost = cost.sample_costs(doc_lens)
        rows["tokens"].append(spread(sample_cost[members].sum(axis=1)))
        bounds = lower_bounds(doc_lens, dp, mb, cost)
        rows["bound_reorder"].append(bounds["reorder"] / mean)
        rows["bound_repack"].append(bounds["repack"] / mean)
        flat = DocLengths.of(doc_lens)  # the loader's form: the packed dataset's lengths of the batch's rows
        for mode in ("reorder", "repack"):
            times = []
            for _ in range(repeats):
                t0 = time.process_time()
                plan = balance_global_batch(flat, mode, dp, mb, cost, seed=0)
                plan.pieces(0, per_rank)      # what each rank then does: gather its own share
                times.append(time.process_time() - t0)
            # Against the mean before: repacking cuts a few pieces, which lowers the total a little.
            rows[mode].append(float(plan.slot_costs_after.max() / mean))
            rows[f"rank_{mode}"].append(float(plan.rank_costs(plan.slot_costs_after).max() / (mean * mb)))
            rows[f"ms_{mode}"].append(1e3 * float(np.median(times)))
            rows[f"ms_min_{mode}"].append(1e3 * float(np.min(times)))
        # `plan` is the repack plan here: its extra pieces are the cuts it made.
        rows["cuts_per_sample"].append((len(plan.segments) - sum(map(len, doc_lens))) / GLOBAL_BATCH)
    out = {k: float(np.mean(v)) for k, v in rows.items()}
    out.update({f"ms_worst_{mode}": float(np.max(rows[f"ms_{mode}"])) for mode in ("reorder", "repack")})
    out.update(dp=dp, micro_batch_num=mb, micro_batch_size=per_rank // mb)
    # The targets: max/mean <= 1.02, or within 2% of the bound where the bound is above 1.
    for mode in ("reorder", "repack"):
        out[f"{mode}_meets_target"] = bool(out[mode] <= 1.02 * max(1.0, out[f"bound_{mode}"]))
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['source']}\n{r['seq'] // 1024}K dp{r['dp']}" for r in results]
    x = np.arange(len(results))
    fig, ax = plt.subplots(figsize=(max(8, len(results) * 0.9), 4.5))
    for i, (key, colour) in enumerate((("sequential", "#999999"), ("tokens", "#cccc66"),
                                       ("reorder", "#3377cc"), ("repack", "#33aa55"))):
        ax.bar(x + (i - 1.5) * 0.2, [r[key] for r in results], 0.2, label=key, color=colour)
    ax.scatter(x + 0.1, [r["bound_reorder"] for r in results], marker="_", s=300, color="k", label="bound (reorder)")
    ax.scatter(x + 0.3, [r["bound_repack"] for r in results], marker="_", s=300, color="g", label="bound (repack)")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("max / mean slot cost")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.legend(fontsize=8)
    ax.set_title("Attention-aware balancing of 1024-sample global batches")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = OneLineParser(description="attention-aware balancing benchmark")
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--dp", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--batches", type=int, default=3, help="global batches per case")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per batch (median)")
    p.add_argument("--cost", default="", help="calibration JSON; default: analytic 105B FLOPs")
    p.add_argument("--out", default=str(REPO / "output" / "bench"))
    args = p.parse_args(argv)
    try:
        cost = CostModel.load(args.cost) if args.cost else flops_cost_model()
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"cost model: a={cost.a:.4g} b={cost.b:.4g} c={cost.c:.4g} ({cost.source})")
    sources = {"synthetic": synthetic_lengths}
    corpus = corpus_lengths()
    if corpus is not None:
        sources["corpus"] = lambda rng, n: rng.choice(corpus, n)
        print(f"corpus: {len(corpus)} documents, median {int(np.median(corpus))} tokens, max {corpus.max()}")
    results = []
    header = (f"{'source':9} {'seq':>6} {'dp':>4} {'mb':>3} {'mbs':>3} | {'sequential':>10} {'tokens':>7} "
              f"{'reorder':>8} {'bound':>6} {'repack':>7} {'bound':>6} | {'rank seq':>8} {'reorder':>7} "
              f"{'repack':>7} | ms reorder (min)  ms repack (min, worst batch) | cuts/sample | targets")
    print(header)
    for name, source in sources.items():
        for seq in args.seq:
            batches = batches_of(source, seq, args.batches, np.random.default_rng([seq, len(name)]))
            for dp in args.dp:
                r = run_case(batches, dp, cost, args.repeats)
                r.update(source=name, seq=seq)
                results.append(r)
                print(f"{name:9} {seq:>6} {dp:>4} {r['micro_batch_num']:>3} {r['micro_batch_size']:>3} | "
                      f"{r['sequential']:>10.3f} {r['tokens']:>7.3f} {r['reorder']:>8.3f} {r['bound_reorder']:>6.3f} "
                      f"{r['repack']:>7.3f} {r['bound_repack']:>6.3f} | {r['rank_sequential']:>8.3f} "
                      f"{r['rank_reorder']:>7.3f} {r['rank_repack']:>7.3f} | {r['ms_reorder']:>7.2f} "
                      f"({r['ms_min_reorder']:5.2f}) {r['ms_repack']:>8.2f} ({r['ms_min_repack']:5.2f}, "
                      f"{r['ms_worst_repack']:5.2f}) | "
                      f"{r['cuts_per_sample']:.2f} | "
                      f"{'ok' if r['reorder_meets_target'] else 'MISS'}/{'ok' if r['repack_meets_target'] else 'MISS'}",
                      flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_balance.json").write_text(json.dumps({"cost_model": cost.__dict__, "results": results},
                                                           indent=1))
    plot(results, out / "attention_balance.png")
    print(f"wrote {out / 'attention_balance.json'} and {out / 'attention_balance.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
