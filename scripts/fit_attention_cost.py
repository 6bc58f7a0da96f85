"""Fit the per-sample cost model t = a*sum(l^2) + b*sum(l) + c from measured forward+backward times, and check
that balancing by it shrinks the measured spread of per-slot times.

    python -m scripts.fit_attention_cost --seq 1024 --bucket 256 --set model.num_attention_heads=16 --skip-batch \
        --out output/attention_cost.json                                   # calibrate (step 1)
    python -m scripts.fit_attention_cost --seq 1024 --set model.num_attention_heads=16 \
        --cost output/attention_cost.json --global-batch 16 --dp 2 --micro-batch-num 2 --batch-seed 5 \
        --out output/attention_slots.json                                  # step 2
    python -m scripts.fit_attention_cost --from-measurements times.json --out cost.json   # e.g. measured on Ascend

Measuring (the real TeleChat3-MoE model of the recipe with model.attention_kernel=flash, graph mode, the trainer's
ForwardBackward cell; CPU seconds of the process, all threads, which a shared machine's other load disturbs far
less than wall time; the median of --repeats runs after two warm-up runs per compiled shape):
1. Calibration: one document of length L per sample, L = bucket, 2*bucket, ..., seq; and full samples of seq
   tokens holding 1, 2, 4, ... equal documents. The coefficients are fitted by non-negative least squares on all
   of them; R^2 is reported, and the measured time of every mix beside its prediction.
2. A real global batch (the shared sample corpus if present, else the embedded default corpus) laid out by
   data.attention_balance off / reorder / repack over --dp x --micro-batch-num slots; every slot runs as one
   micro-batch [micro_batch_size, seq] with its document boundaries, --repeats times. The measured max/mean of
   the per-slot medians, and its mean over rounds taken within each round (free of the machine's drift), are
   printed beside the model's prediction, with the run-to-run noise.
The calibration file (JSON) is what the recipe's `data.attention_cost` names; a PNG shows the fit and the spreads.
--cost runs step 2 with an earlier calibration: MindSpore keeps one compiled graph (and its memory) per input shape,
so at long sequences the two steps are better run as two processes. --from-measurements takes a JSON list of
{"doc_lens": [...], "seconds": t} and only fits.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# NumPy's BLAS threads (the CPU attention kernel) would spin on a shared machine and count as CPU time.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from data_sched.attention_cost import CostModel, fit_attention_cost, length_moments  # noqa: E402
from data_sched.errors import DataError  # noqa: E402
from oneline import OneLineParser  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

SHARED_CORPUS = REPO.parent / "shared" / "data" / "corpus" / "corpus.jsonl"


def load_measurements(path: str) -> tuple[list[np.ndarray], np.ndarray]:
    try:
        rows = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: measurements file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"{path}: expected JSON, a list of {{\"doc_lens\": [...], \"seconds\": t}}") from None
    if not isinstance(rows, list) or len(rows) < 3:
        raise DataError(f"{path}: expected a JSON list of at least 3 measurements")
    lens, times = [], []
    for i, row in enumerate(rows):
        ok = isinstance(row, dict) and isinstance(row.get("doc_lens"), list) and row["doc_lens"] \
            and all(isinstance(x, int) and x > 0 for x in row["doc_lens"]) \
            and isinstance(row.get("seconds"), (int, float)) and row["seconds"] > 0
        if not ok:
            raise DataError(f"{path}: entry {i}: expected {{\"doc_lens\": [positive ints], \"seconds\": > 0}}")
        lens.append(np.array(row["doc_lens"]))
        times.append(float(row["seconds"]))
    return lens, np.array(times)


class Stepper:
    """Forward+backward of the recipe's model on [rows, L] packed inputs; one compiled graph per shape."""

    def __init__(self, recipe):
        import mindspore as ms
        from mindspore import ParameterTuple

        from telechat_moe.model import TeleChatMoE
        from telechat_moe.train_step import ForwardBackward
        from telechat_moe.trainer import configure_mindspore

        configure_mindspore(recipe)
        ms.set_seed(recipe.seed)
        self.ms = ms
        self.vocab = recipe.model.vocab_size
        model = TeleChatMoE(recipe.model, recipe.context.device_target)
        self.fb = ForwardBackward(model, ParameterTuple(model.trainable_params()))
        self.rng = np.random.default_rng(0)
        self.warm: set = set()

    def once(self, rows_doc_lens) -> float:
        """CPU seconds of one forward+backward of samples with these document lengths (each row one sample)."""
        from mindspore import Tensor

        ms = self.ms
        length = int(np.sum(rows_doc_lens[0]))
        shape = (len(rows_doc_lens), length)
        ids = self.rng.integers(4, self.vocab, shape).astype(np.int32)
        seg = np.stack([np.repeat(np.arange(len(x), dtype=np.int32), x) for x in rows_doc_lens])
        pos = np.broadcast_to(np.arange(length, dtype=np.int32), shape).copy()
        args = (Tensor(ids), Tensor(ids), Tensor(np.ones(shape, np.float32)), Tensor(seg), Tensor(pos),
                Tensor(1.0, ms.float32))
        start = time.process_time()
        out = self.fb(*args)
        out[0].asnumpy()
        for g in out[-1]:
            g.asnumpy()
        return time.process_time() - start

    def seconds(self, rows_doc_lens, repeats: int) -> np.ndarray:
        """`repeats` timed runs, after two warm-up runs the first time a shape is seen (compile, thread pools)."""
        shape = (len(rows_doc_lens), int(np.sum(rows_doc_lens[0])))
        if shape not in self.warm:
            for _ in range(2):
                self.once(rows_doc_lens)
            self.warm.add(shape)
        return np.array([self.once(rows_doc_lens) for _ in range(repeats)])


def noise(runs: list[np.ndarray]) -> float:
    """Median over measurements of (max - min) / median of their repeats: how far one run can be off."""
    return float(np.median([(r.max() - r.min()) / np.median(r) for r in runs]))


def calibrate(stepper: Stepper, seq: int, bucket: int, repeats: int) -> dict:
    """Single documents of every bucket length, and full samples of 1, 2, 4, ... equal documents."""
    singles = [[length] for length in range(bucket, seq + 1, bucket)]
    mixes = [[seq // n] * n for n in (2 ** k for k in range(1, 12)) if seq % n == 0 and seq // n >= 16]
    points, runs = [], []
    for lens in singles + mixes:
        t = stepper.seconds([lens], repeats)
        points.append(np.array(lens))
        runs.append(t)
        print(f"  {len(lens):4d} x {lens[0]:6d} tokens: {np.median(t) * 1e3:8.1f} ms (runs {np.round(t, 2).tolist()})",
              flush=True)
    return {"doc_lens": points, "runs": runs, "singles": len(singles)}


def real_batch(recipe, seq: int, global_batch: int, seed: int) -> list[np.ndarray]:
    """Document lengths of `global_batch` packed samples of a real corpus (tokenized with a fresh tokenizer)."""
    import tempfile

    from data_sched.default_corpus import default_corpus
    from data_sched.packing import pack_lengths
    from data_sched.sources import load_texts
    from data_sched.tokenizer import Tokenizer, train_tokenizer

    texts = load_texts([str(SHARED_CORPUS)]) if SHARED_CORPUS.is_file() else default_corpus()
    with tempfile.TemporaryDirectory() as tmp:
        tok = Tokenizer.load(train_tokenizer(texts, recipe.model.vocab_size, f"{tmp}/spm"))
        lengths = np.array([len(d) + 1 for d in tok.encode_documents(texts)])
    lengths = np.random.default_rng(seed).permutation(lengths)
    offsets, lens = pack_lengths(lengths, seq)
    if len(offsets) - 1 < global_batch:
        raise DataError(f"corpus too small for a global batch of {global_batch} samples of {seq} tokens")
    return [lens[offsets[i]:offsets[i + 1]] for i in range(global_batch)]


def measure_slots(stepper: Stepper, doc_lens, dp: int, mb: int, cost: CostModel, repeats: int) -> dict:
    """Every slot of every layout as one micro-batch; measured and predicted max/mean of the slot times.

    After an untimed warm-up round, the repeats go round all slots of all layouts in turn (the layouts in a
    rotating order), so a drift of the machine's speed over the run touches every layout alike."""
    from data_sched.attention_balance import balance_global_batch

    plans = {mode: balance_global_batch(doc_lens, mode, dp, mb, cost, seed=0) for mode in ("off", "reorder", "repack")}
    mbs = plans["off"].micro_batch_size
    micro_batches = {mode: [[plan.doc_lens(j) for j in range(s * mbs, (s + 1) * mbs)] for s in range(dp * mb)]
                     for mode, plan in plans.items()}
    modes = list(plans)
    runs = {mode: [[] for _ in range(dp * mb)] for mode in modes}
    for r in range(-1, repeats):                          # round -1: compile and warm up, not kept
        for mode in modes[r % 3:] + modes[:r % 3]:        # each layout in every position of the order
            for s, rows in enumerate(micro_batches[mode]):
                t = stepper.once(rows)
                if r >= 0:
                    runs[mode][s].append(t)
        print(f"  round {r + 1}/{repeats} done" if r >= 0 else "  warm-up round done", flush=True)
    out = {}
    for mode, plan in plans.items():
        slot_runs = np.array(runs[mode])                                      # [slots, repeats]
        measured = np.median(slot_runs, axis=1)
        # Within one round every layout ran at nearly the same time: its spread is free of the machine's drift.
        per_round = slot_runs.max(axis=0) / slot_runs.mean(axis=0)
        predicted = plan.slot_costs_after
        out[mode] = {"measured_s": measured.tolist(), "runs_s": slot_runs.tolist(),
                     "predicted_s": predicted.tolist(),
                     "measured_max_over_mean": float(measured.max() / measured.mean()),
                     "per_round_max_over_mean": per_round.tolist(),
                     "predicted_max_over_mean": float(predicted.max() / predicted.mean()),
                     "noise": noise(list(slot_runs))}
        print(f"  {mode:8s} max/mean predicted {out[mode]['predicted_max_over_mean']:.3f} | measured: of the "
              f"medians {out[mode]['measured_max_over_mean']:.3f}, per round {per_round.mean():.3f} "
              f"+- {standard_error(per_round):.3f} | max (s) "
              f"predicted {predicted.max():.2f} measured {measured.max():.2f} | run-to-run noise "
              f"{out[mode]['noise']:.0%}", flush=True)
    return out


def plot(path: Path, lens, times, cost: CostModel, singles: int, slots: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [name for name, on in (("fit", lens is not None), ("slots", slots)) if on]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    if slots:
        _plot_slots(axes[0, -1], slots)
    if lens is None:
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return
    ax = axes[0, 0]
    predicted = cost.sample_costs(lens) * 1e3
    ax.plot(predicted[:singles], times[:singles] * 1e3, "o", label="one document of L tokens")
    if len(times) > singles:
        ax.plot(predicted[singles:], times[singles:] * 1e3, "^", label="full sample, n equal documents")
    edge = [0, max(predicted.max(), times.max() * 1e3) * 1.05]
    ax.plot(edge, edge, "k-", lw=0.5)
    ax.set_xlabel("predicted forward+backward (ms)")
    ax.set_ylabel("measured (ms, CPU time)")
    ax.set_title(f"a={cost.a:.3g}/tok², b={cost.b:.3g}/tok, c={cost.c:.3g}; R²={cost.r2:.4f}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def standard_error(values: np.ndarray) -> float:
    return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0


def _plot_slots(ax, slots: dict) -> None:
    modes = list(slots)
    x = np.arange(len(modes))
    rounds = [np.array(slots[m]["per_round_max_over_mean"]) for m in modes]
    ax.bar(x - 0.2, [r.mean() for r in rounds], 0.4, label="measured (mean over rounds)",
           yerr=[standard_error(r) for r in rounds], capsize=3)
    ax.bar(x + 0.2, [slots[m]["predicted_max_over_mean"] for m in modes], 0.4, label="predicted")
    ax.set_xticks(x, modes)
    ax.set_ylabel("max / mean slot time (error bar: standard error)")
    ax.set_ylim(bottom=0.9)
    ax.axhline(1.0, color="k", lw=0.5)
    ax.legend(fontsize=8)


def main(argv=None) -> int:
    p = OneLineParser(description="fit the attention cost model from measured forward+backward times")
    p.add_argument("--recipe", default="tiny")
    p.add_argument("--set", action="append", default=[], help="recipe override key=value")
    p.add_argument("--seq", type=int, default=2048, help="longest document / sample length measured")
    p.add_argument("--bucket", type=int, default=256, help="length step of the single-document calibration")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--micro-batch-num", type=int, default=4)
    p.add_argument("--skip-batch", action="store_true", help="calibrate only (step 1)")
    p.add_argument("--cost", default="", help="use this calibration file instead of measuring one (step 2 only)")
    p.add_argument("--batch-seed", type=int, default=None, help="which global batch of the corpus (default: "
                   "the recipe's seed)")
    p.add_argument("--from-measurements", default="", help="fit these measurements instead of measuring")
    p.add_argument("--out", default=str(REPO / "output" / "attention_cost.json"))
    args = p.parse_args(argv)
    try:
        out = Path(args.out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(f"--out: cannot create {out.parent} ({e.strerror})") from None
        report: dict = {}
        slots = None
        lens = times = None
        if args.from_measurements:
            lens, times = load_measurements(args.from_measurements)
            cost = fit_attention_cost(lens, times, source=f"measurements {args.from_measurements}")
            singles = len(lens)
        else:
            if args.seq % args.bucket or args.bucket < 1:
                raise DataError(f"--seq {args.seq} must be a positive multiple of --bucket {args.bucket}")
            os.environ.setdefault("GLOG_v", "3")
            from telechat_moe.recipe import RecipeError, load_recipe
            try:
                recipe = load_recipe(args.recipe, [f"model.seq_length={args.seq}",
                                                   f"model.max_position_embeddings={args.seq}",
                                                   f"model.original_max_position_embeddings={args.seq}",
                                                   "model.attention_kernel=flash", *args.set])
            except RecipeError as e:
                raise DataError(str(e)) from None
            stepper = Stepper(recipe)
            if args.cost:
                cost = CostModel.load(args.cost)
                singles = 0
                print(f"[1/2] calibration from {args.cost}", flush=True)
            else:
                print(f"[1/2] calibration: {recipe.name} ({recipe.model.attention_kernel} attention), single "
                      f"documents of {args.bucket}..{args.seq} tokens and full samples of n equal documents",
                      flush=True)
                cal = calibrate(stepper, args.seq, args.bucket, args.repeats)
                lens, singles = cal["doc_lens"], cal["singles"]
                times = np.array([np.median(r) for r in cal["runs"]])
                cost = fit_attention_cost(lens, times, source=f"{recipe.name} forward+backward on "
                                          f"{recipe.context.device_target}, {recipe.model.attention_kernel} "
                                          f"attention, single documents {args.bucket}..{args.seq} and full mixes")
                report["calibration_noise"] = noise(cal["runs"])
                report["calibration_runs_s"] = [r.tolist() for r in cal["runs"]]
        print(f"fit: a={cost.a:.4g} s/token^2  b={cost.b:.4g} s/token  c={cost.c:.4g} s   R^2={cost.r2:.4f} "
              f"({cost.num_points} points)")
        report["cost"] = cost.__dict__
        if lens is not None:
            sq, _ = length_moments(lens)
            attention_share = cost.a * sq / cost.sample_costs(lens)
            print(f"attention term: {attention_share.min():.0%} .. {attention_share.max():.0%} of the predicted time")
            report.update(doc_lens=[l.tolist() for l in lens], seconds=times.tolist(),
                          predicted=cost.sample_costs(lens).tolist())
        if not args.from_measurements and not args.skip_batch:
            print(f"[2/2] a real global batch of {args.global_batch} x {args.seq} tokens over dp={args.dp} x "
                  f"micro_batch_num={args.micro_batch_num} slots, each slot one micro-batch", flush=True)
            doc_lens = real_batch(recipe, args.seq, args.global_batch,
                                  recipe.seed if args.batch_seed is None else args.batch_seed)
            slots = measure_slots(stepper, doc_lens, args.dp, args.micro_batch_num, cost, args.repeats)
            report["slots"] = slots
        if not args.cost:
            cost.save(str(out))
        out.with_suffix(".report.json").write_text(json.dumps(report, indent=1))
        plot(out.with_suffix(".png"), lens, times, cost, singles, slots)
        print(f"wrote {'' if args.cost else f'{out} (calibration), '}{out.with_suffix('.report.json')}, "
              f"{out.with_suffix('.png')}")
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
