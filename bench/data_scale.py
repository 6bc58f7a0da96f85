"""Pre-training data at scale: peak resident memory and data preparation time of tiny.yaml against corpus size.

For each size an indexed dataset of random token ids with log-normal document lengths is written (Megatron's
.bin/.idx through data_sched.indexed_dataset.IndexWriter), then tiny trains 2 steps on it twice in fresh processes:
the first run builds the packing and shuffle indexes into an empty cache folder, the second finds them there.
Each run reports its peak resident set (the process's ru_maxrss, memory-mapped pages it touched included) and the
trainer's own "[data] ... (N s)" preparation time. Ratios ("x") are to the smallest size's run of the same kind,
"x first" to the smallest size's first run.

    .venv/bin/python -m bench.data_scale [--tokens 2e6 2e8 2e9] [--dir /tmp/data_scale] [--keep]

The datasets take 2 bytes a token (uint16) under --dir, their indexes beside them, and are deleted at the end unless --keep; the size that
does not fit the free disk (with 2 GiB to spare) is skipped with a note.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from data_sched.index_cache import CACHE_FOLDER
from oneline import OneLineParser

REPO = Path(__file__).resolve().parents[1]
CHUNK_TOKENS = 1 << 25
MEAN_LOG_LENGTH, SIGMA_LOG_LENGTH = 6.0, 1.0    # median document 403 tokens, mean 665


def write_random_dataset(prefix: str, num_tokens: int, vocab_size: int, seed: int = 0) -> int:
    """Random ids, log-normal document lengths (at least 1), written in chunks; returns the document count."""
    from data_sched.indexed_dataset import IndexWriter

    rng = np.random.default_rng(seed)
    writer = IndexWriter(prefix, vocab_size)
    try:
        left = num_tokens
        while left:
            target = min(left, CHUNK_TOKENS)
            lengths = np.maximum(1, rng.lognormal(MEAN_LOG_LENGTH, SIGMA_LOG_LENGTH, target // 50 + 10)).astype(
                np.int64)
            ends = np.cumsum(lengths)
            last = int(np.searchsorted(ends, target))
            lengths = lengths[:last + 1]
            lengths[-1] -= int(ends[last]) - target       # the chunk ends with a cut document
            writer.add(rng.integers(0, vocab_size, target, dtype=np.uint16), lengths)
            left -= target
        return writer.commit()[0]
    finally:
        writer.discard()


def train_twice(data: Path, tokenizer: str, out: Path) -> list[dict]:
    """Two 2-step tiny runs on `data`; the first with no indexes in its cache (the default, beside the data)."""
    shutil.rmtree(data.parent / CACHE_FOLDER, ignore_errors=True)
    runs = []
    for label in ("first", "cached"):
        overrides = [f"data.paths=[{data}]", f"data.tokenizer={tokenizer}", f"output_dir={out / label}", "training.train_steps=2", "training.eval_interval=0",
                     "training.eval_batches=0", "training.log_interval=1", "training.save_interval=0"]
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "run_train.py", "--recipe", "tiny",
                                 *[x for o in overrides for x in ("--set", o)]],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        if status:
            raise SystemExit(f"tiny on {data} failed:\n{log[-3000:]}")
        prep = re.search(r"\[data\] \d+ training samples.*\(([\d.]+)s\)", log)
        runs.append({"run": label, "peak_rss_gib": usage.ru_maxrss / 2 ** 20,
                     "prep_s": float(prep.group(1)), "wall_s": time.perf_counter() - start})
    return runs


def main() -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", nargs="+", type=float, default=[2e6, 2e8, 2e9])
    ap.add_argument("--dir", default="/tmp/data_scale")
    ap.add_argument("--keep", action="store_true", help="keep the datasets (reused by the next run)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    from data_sched.default_corpus import default_corpus
    from data_sched.tokenizer import Tokenizer, train_tokenizer
    from telechat_moe.recipe import load_recipe

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    vocab = load_recipe("tiny", []).model.vocab_size
    tokenizer = train_tokenizer(default_corpus(), vocab, str(root / "tokenizer"))
    vocab = Tokenizer.load(tokenizer).vocab_size
    rows = []
    try:
        for count in (int(t) for t in args.tokens):
            prefix = root / f"tokens_{count}" / "random"
            prefix.parent.mkdir(exist_ok=True)
            if not Path(f"{prefix}.bin").is_file():
                if shutil.disk_usage(root).free < 2 * count + 2 ** 31:
                    print(f"{count:,} tokens: skipped, {shutil.disk_usage(root).free / 2 ** 30:.1f} GiB free")
                    continue
                start = time.perf_counter()
                docs = write_random_dataset(str(prefix), count, vocab)
                print(f"{count:,} tokens: wrote {docs:,} documents in {time.perf_counter() - start:.1f}s",
                      flush=True)
            for run in train_twice(prefix.with_suffix(".bin"), tokenizer, root / f"out_{count}"):
                rows.append({"tokens": count, **run})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if not args.keep:
            for path in [*root.glob("tokens_*"), *root.glob("out_*")]:
                shutil.rmtree(path, ignore_errors=True)
    base = {r["run"]: r for r in rows if r["tokens"] == rows[0]["tokens"]}

    def ratio(value: float, to: float) -> str:
        return f"{value / to:6.2f}" if to > 0 else "     -"
    print(f"\n{'tokens':>14} {'run':>7} {'peak RSS GiB':>13} {'x':>6} {'prep s':>7} {'x':>6} {'x first':>8}")
    for r in rows:
        b = base[r["run"]]
        print(f"{r['tokens']:>14,} {r['run']:>7} {r['peak_rss_gib']:>13.3f} {ratio(r['peak_rss_gib'], b['peak_rss_gib'])}"
              f" {r['prep_s']:>7.2f} {ratio(r['prep_s'], b['prep_s'])} {ratio(r['prep_s'], base['first']['prep_s']):>8}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
