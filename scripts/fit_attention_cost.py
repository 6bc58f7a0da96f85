"""Fit the per-sample cost model t = a*sum(l^2) + b*sum(l) + c from measured forward+backward times.

    python scripts/fit_attention_cost.py --recipe tiny --out output/attention_cost.json
    python scripts/fit_attention_cost.py --from-measurements times.json --out cost.json   # e.g. measured on Ascend

Measuring (the real TeleChat3-MoE model of the recipe, graph mode, the trainer's ForwardBackward cell):
1. Calibration: one document of length L per sample, for L = bucket, 2*bucket, ..., seq_length; the least of
   --repeats runs is kept. Times are CPU seconds of the process (all threads), which a shared machine's other
   load disturbs far less than wall time. The coefficients are fitted by non-negative least squares; R^2 is reported.
2. Dense-mask check: full samples of seq_length holding 1..16 documents. On CPU the model masks attention per
   document but still computes every query-key pair, so these times should not follow sum(l^2): the spread is
   printed next to the modelled one. Balancing pays off where attention skips masked blocks (FlashAttention
   with actual_seq_len on Ascend), which step 3 emulates.
3. A real global batch (the shared sample corpus if present, else the embedded default corpus), laid out by
   data.attention_balance off / reorder / repack over --dp x --micro-batch-num slots, each slot executed as
   variable-length attention does it: one forward+backward per document piece, padded up to the bucket (so the
   graphs of step 1 are reused). Measured max/mean slot time is printed beside the model's prediction.
The calibration file (JSON) is what the recipe's `data.attention_cost` names; a PNG shows the fit and the spreads.
--from-measurements takes a JSON list of {"doc_lens": [...], "seconds": t} and only fits.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_sched.attention_cost import CostModel, fit_attention_cost  # noqa: E402
from data_sched.errors import DataError  # noqa: E402

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
    """Forward+backward of the recipe's model on [1, L] inputs; one compiled graph per length."""

    def __init__(self, recipe):
        import mindspore as ms
        from mindspore import ParameterTuple

        from telechat_moe.model import TeleChatMoE
        from telechat_moe.trainer import ForwardBackward, configure_mindspore

        configure_mindspore(recipe)
        ms.set_seed(recipe.seed)
        self.ms = ms
        self.vocab = recipe.model.vocab_size
        model = TeleChatMoE(recipe.model, recipe.context.device_target)
        self.fb = ForwardBackward(model, ParameterTuple(model.trainable_params()))
        self.rng = np.random.default_rng(0)

    def seconds(self, length: int, segment_lens=None, real_tokens: int | None = None) -> float:
        from mindspore import Tensor

        ms = self.ms
        ids = self.rng.integers(4, self.vocab, (1, length)).astype(np.int32)
        mask = np.zeros((1, length), np.float32)
        mask[0, :real_tokens or length] = 1.0
        lens = segment_lens if segment_lens is not None else [length]
        seg = np.repeat(np.arange(len(lens), dtype=np.int32), lens)[None]
        pos = np.arange(length, dtype=np.int32)[None]
        args = (Tensor(ids), Tensor(ids), Tensor(mask), Tensor(seg), Tensor(pos), Tensor(1.0, ms.float32))
        # CPU seconds of all threads, not wall time: on a shared machine the wall clock also counts the time
        # other processes hold the cores, which has nothing to do with this work.
        start = time.process_time()
        out = self.fb(*args)
        out[0].asnumpy()
        for g in out[-1]:
            g.asnumpy()
        return time.process_time() - start


def calibrate(stepper: Stepper, lengths: list[int], repeats: int) -> tuple[list[np.ndarray], np.ndarray]:
    times = []
    for length in lengths:
        t0 = time.perf_counter()
        for _ in range(2):                            # compile, then let thread pools and caches settle
            stepper.seconds(length)
        best = min(stepper.seconds(length) for _ in range(repeats))
        times.append(best)
        print(f"  L={length:6d}: {best * 1e3:8.1f} ms (compile+warmup {time.perf_counter() - t0:5.1f} s)", flush=True)
    return [np.array([length]) for length in lengths], np.array(times)


def dense_mask_check(stepper: Stepper, seq: int, cost: CostModel, repeats: int) -> dict:
    mixes = [[seq]] + [[seq // n] * n for n in (2, 4, 8, 16)]
    measured = np.array([min(stepper.seconds(seq, m) for _ in range(repeats)) for m in mixes])
    modelled = cost.sample_costs([np.array(m) for m in mixes])
    return {"mixes": [len(m) for m in mixes], "measured_s": measured.tolist(),
            "measured_max_over_min": float(measured.max() / measured.min()),
            "modelled_max_over_min": float(modelled.max() / modelled.min())}


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


def measure_slots(stepper: Stepper, doc_lens, dp: int, mb: int, cost: CostModel, bucket: int) -> dict:
    from data_sched.attention_balance import balance_global_batch

    out = {}
    for mode in ("off", "reorder", "repack"):
        plan = balance_global_batch(doc_lens, mode, dp, mb, cost, seed=0)
        mbs = plan.micro_batch_size
        slot_times = []
        for s in range(dp * mb):
            total = 0.0
            for j in range(s * mbs, (s + 1) * mbs):
                for piece in plan.doc_lens(j).tolist():
                    padded = -(-piece // bucket) * bucket
                    total += stepper.seconds(padded, [piece, padded - piece] if padded > piece else None, piece)
            slot_times.append(total)
        measured = np.array(slot_times)
        predicted = plan.slot_costs_after
        out[mode] = {"measured_s": measured.tolist(), "measured_max_over_mean": float(measured.max() / measured.mean()),
                     "predicted_max_over_mean": float(predicted.max() / predicted.mean())}
        print(f"  {mode:8s} measured max/mean {out[mode]['measured_max_over_mean']:.3f}   "
              f"predicted {out[mode]['predicted_max_over_mean']:.3f}   slots {np.round(measured, 2).tolist()}",
              flush=True)
    return out


def plot(path: Path, lens, times, cost: CostModel, slots: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if slots else 1, figsize=(11 if slots else 6, 4), squeeze=False)
    ax = axes[0, 0]
    x = np.array([float(np.sum(l)) for l in lens])
    ax.plot(x, times * 1e3, "o", label="measured (one document)")
    grid = np.linspace(x.min(), x.max(), 100)
    ax.plot(grid, (cost.a * grid ** 2 + cost.b * grid + cost.c) * 1e3, "-",
            label=f"fit a={cost.a:.3g} b={cost.b:.3g} c={cost.c:.3g}, R²={cost.r2:.4f}")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("forward+backward (ms)")
    ax.legend(fontsize=7)
    if slots:
        ax = axes[0, 1]
        modes = list(slots)
        ax.bar(np.arange(len(modes)) - 0.2, [slots[m]["measured_max_over_mean"] for m in modes], 0.4,
               label="measured")
        ax.bar(np.arange(len(modes)) + 0.2, [slots[m]["predicted_max_over_mean"] for m in modes], 0.4,
               label="predicted")
        ax.set_xticks(np.arange(len(modes)), modes)
        ax.set_ylabel("max / mean slot time")
        ax.axhline(1.0, color="k", lw=0.5)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="fit the attention cost model from measured forward+backward times")
    p.add_argument("--recipe", default="tiny")
    p.add_argument("--set", action="append", default=[], help="recipe override key=value")
    p.add_argument("--seq", type=int, default=1024, help="longest document / sample length measured")
    p.add_argument("--bucket", type=int, default=128, help="length step of the calibration (and padding)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--micro-batch-num", type=int, default=2)
    p.add_argument("--skip-batch", action="store_true", help="calibrate only (steps 1-2)")
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
        if args.from_measurements:
            lens, times = load_measurements(args.from_measurements)
            cost = fit_attention_cost(lens, times, source=f"measurements {args.from_measurements}")
            stepper = None
        else:
            if args.seq % args.bucket or args.bucket < 1:
                raise DataError(f"--seq {args.seq} must be a positive multiple of --bucket {args.bucket}")
            os.environ.setdefault("GLOG_v", "3")
            from telechat_moe.recipe import RecipeError, load_recipe
            try:
                recipe = load_recipe(args.recipe, [f"model.seq_length={args.seq}",
                                                   f"model.max_position_embeddings={args.seq}",
                                                   f"model.original_max_position_embeddings={args.seq}", *args.set])
            except RecipeError as e:
                raise DataError(str(e)) from None
            stepper = Stepper(recipe)
            lengths = list(range(args.bucket, args.seq + 1, args.bucket))
            print(f"[1/3] calibration: {recipe.name}, one document per sample, L in {lengths}", flush=True)
            lens, times = calibrate(stepper, lengths, args.repeats)
            cost = fit_attention_cost(lens, times, source=f"{recipe.name} forward+backward on "
                                      f"{recipe.context.device_target}, one document per sample, "
                                      f"L={args.bucket}..{args.seq}")
        print(f"fit: a={cost.a:.4g} s/token^2  b={cost.b:.4g} s/token  c={cost.c:.4g} s   R^2={cost.r2:.4f} "
              f"({cost.num_points} points)")
        report.update(cost=cost.__dict__, lengths=[int(np.sum(l)) for l in lens], seconds=times.tolist())
        slots = None
        if stepper is not None:
            print(f"[2/3] dense-mask check at {args.seq} tokens, 1..16 documents per sample", flush=True)
            report["dense_mask"] = dense_mask_check(stepper, args.seq, cost, args.repeats)
            print(f"  measured max/min {report['dense_mask']['measured_max_over_min']:.3f} vs modelled "
                  f"(variable-length attention) {report['dense_mask']['modelled_max_over_min']:.3f}")
            if not args.skip_batch:
                print(f"[3/3] a real global batch of {args.global_batch} x {args.seq} tokens over dp={args.dp} x "
                      f"micro_batch_num={args.micro_batch_num} slots, one forward+backward per document piece",
                      flush=True)
                doc_lens = real_batch(recipe, args.seq, args.global_batch, recipe.seed)
                slots = measure_slots(stepper, doc_lens, args.dp, args.micro_batch_num, cost, args.bucket)
                report["slots"] = slots
        cost.save(str(out))
        out.with_suffix(".report.json").write_text(json.dumps(report, indent=1))
        plot(out.with_suffix(".png"), lens, times, cost, slots)
        print(f"wrote {out} (calibration), {out.with_suffix('.report.json')}, {out.with_suffix('.png')}")
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
