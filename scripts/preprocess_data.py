"""Tokenize JSONL / text corpora into a Megatron-compatible indexed dataset (<prefix>.bin + <prefix>.idx).

    python -m scripts.preprocess_data --input corpus.jsonl more.txt --output-prefix data/corpus \
        --tokenizer tok.model --workers 4
    python -m scripts.preprocess_data --input corpus.jsonl --output-prefix data/corpus --vocab-size 32000

Without --tokenizer one is trained on the input (written to <prefix>.model). Documents are tokenized by a pool of
workers in input order (the output does not depend on --workers) with a progress bar; the files are written under
temporary names and renamed at the end, so an interrupted run leaves any earlier dataset intact. Bad input: one
line on stderr, exit code 2.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

from oneline import OneLineParser
from data_sched.errors import DataError
from data_sched.sources import load_texts
from data_sched.tokenizer import Tokenizer, train_tokenizer

CHUNK = 64  # documents per task: large enough to amortise pickling, small enough for a smooth progress bar

_worker_tokenizer: Tokenizer | None = None


def _init_worker(model_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.load(model_path)


def _encode_chunk(args: tuple[list[str], bool]):
    texts, append_eod = args
    docs = _worker_tokenizer.encode_documents(texts)
    if append_eod:
        eod = _worker_tokenizer.eod_id
        docs = [list(d) + [eod] for d in docs]
    return docs


def parse_args(argv):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help=".jsonl ({\"text\": ...} per line) or .txt files")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    p.add_argument("--tokenizer", default="", help="a sentencepiece .model; default: train one")
    p.add_argument("--vocab-size", type=int, default=32000, help="when training a tokenizer")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)))
    p.add_argument("--append-eod", action="store_true",
                   help="end each document with EOD in the .bin (Megatron's flag; this project's packer adds it)")
    return p.parse_args(argv)


def _check_output(prefix: str) -> None:
    out_dir = Path(prefix).resolve().parent
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"--output-prefix: cannot create directory {out_dir} ({e.strerror})") from None
    if not os.access(out_dir, os.W_OK):
        raise DataError(f"--output-prefix: directory {out_dir} is not writable")


def run(args) -> None:
    from tqdm import tqdm

    if args.workers < 1:
        raise DataError(f"--workers: expected a positive integer, got {args.workers}")
    _check_output(args.output_prefix)
    texts = load_texts(args.input)
    model = args.tokenizer or train_tokenizer(texts, args.vocab_size, args.output_prefix)
    tokenizer = Tokenizer.load(model)
    os.environ.setdefault("LOG_MF_PATH", str(Path(args.output_prefix).resolve().parent / "log"))
    from data_sched.indexed_dataset import token_dtype, write_indexed_dataset

    token_dtype(tokenizer.vocab_size)  # imports MindFormers (seconds) before the clock starts
    tasks = [(texts[i:i + CHUNK], args.append_eod) for i in range(0, len(texts), CHUNK)]
    start = time.perf_counter()
    bar = tqdm(total=len(texts), unit="doc", file=sys.stderr, desc="tokenizing", mininterval=0.5)

    def documents(pool):
        chunks = pool.imap(_encode_chunk, tasks) if pool else map(_encode_chunk, tasks)
        for chunk in chunks:
            bar.update(len(chunk))
            yield from chunk

    if args.workers == 1:
        _init_worker(model)
        num_docs, num_tokens = write_indexed_dataset(args.output_prefix, documents(None), tokenizer.vocab_size)
    else:
        with mp.get_context("spawn").Pool(args.workers, initializer=_init_worker, initargs=(model,)) as pool:
            num_docs, num_tokens = write_indexed_dataset(args.output_prefix, documents(pool), tokenizer.vocab_size)
    bar.close()
    seconds = time.perf_counter() - start
    print(f"wrote {args.output_prefix}.bin/.idx: {num_docs} documents, {num_tokens} tokens, tokenizer {model}, "
          f"{num_tokens / max(seconds, 1e-9):,.0f} tokens/s with {args.workers} worker(s)")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
