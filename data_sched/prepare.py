"""From a recipe's data section to packed train/held-out samples and the tokenizer: the trainer's one call."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data_sched.blend import BlendedSamples, blend, parse_paths
from data_sched.default_corpus import default_corpus
from data_sched.errors import DataError
from data_sched.indexed_samples import IndexedSamples, open_indexed_samples
from data_sched.loader import split_holdout
from data_sched.packing import PackedSamples, pack_documents
from data_sched.sources import load_texts
from data_sched.tokenizer import Tokenizer, train_tokenizer


@dataclass(frozen=True)
class PreparedData:
    tokenizer: Tokenizer
    train: PackedSamples | IndexedSamples | BlendedSamples     # the sample-set members of PackedSamples
    held_out: PackedSamples | IndexedSamples | BlendedSamples | None


# Where a run that trains its own tokenizer keeps it, in its output folder; later runs into the folder load it.
TOKENIZER_FILE = "tokenizer.model"


def tokenizer_in_use(configured: str, output_dir: str | Path) -> str | None:
    """The tokenizer file a run loads: the configured one, else the one an earlier run trained into output_dir;
    None when the run trains its own."""
    if configured:
        return configured
    earlier = Path(output_dir) / TOKENIZER_FILE
    return str(earlier) if earlier.is_file() else None


def check_tokenizer_fits(path: str, vocab_size: int) -> Tokenizer:
    """The tokenizer at `path`, refused when its ids do not all fit an embedding of `vocab_size` rows."""
    tokenizer = Tokenizer.load(path)
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"{path}: the tokenizer has {tokenizer.vocab_size} pieces, more than model.vocab_size="
                        f"{vocab_size}; set model.vocab_size to at least {tokenizer.vocab_size} or use another "
                        f"tokenizer")
    return tokenizer


def _load_tokenizer(path: str, vocab_size: int | None) -> Tokenizer:
    return check_tokenizer_fits(path, vocab_size) if vocab_size else Tokenizer.load(path)


def _is_indexed(path: str) -> bool:
    return path.endswith((".bin", ".idx"))


def _prepare_indexed(entries: list[tuple[str, float | None]], seq_length: int, seed: int, eval_fraction: float,
                     tokenizer_path: str | None, vocab_size: int | None, cache_dir: str) -> PreparedData:
    if not tokenizer_path:
        raise DataError(f"data.tokenizer: {entries[0][0]} holds token ids; name the tokenizer that produced them")
    tokenizer = _load_tokenizer(tokenizer_path, vocab_size)
    opened = [open_indexed_samples(path, seq_length, seed, eval_fraction, tokenizer.eod_id, tokenizer.vocab_size,
                                   cache_dir) for path, _ in entries]
    weights = [w for _, w in entries]
    if len(opened) == 1:
        train, held = opened[0]["train"], opened[0]["held_out"]
    else:
        train = blend([o["train"] for o in opened], weights)
        kept = [(o["held_out"], w) for o, w in zip(opened, weights) if len(o["held_out"])]
        held = blend(*map(list, zip(*kept))) if kept else None
    if not len(train):      # (a blend refuses a source too small for one sample itself)
        raise DataError(f"corpus too small: {train.num_tokens} tokens cannot fill one sample of "
                        f"seq_length={seq_length} (+1 for the labels)")
    return PreparedData(tokenizer, train, held if held is not None and len(held) else None)


def prepare_data(paths: list[str] | None, seq_length: int, seed: int, eval_fraction: float,
                 tokenizer_path: str | None = None, vocab_size: int | None = None,
                 tokenizer_out: str | None = None, cache_dir: str = "") -> PreparedData:
    """Load documents (the default corpus when `paths` is empty), split off a held-out set, tokenize, pack.

    `paths` (`data.paths`, see `blend.parse_paths`) are text corpora (.jsonl/.txt), read into memory, or indexed
    datasets (.bin/.idx from scripts/preprocess_data.py, with the tokenizer that wrote them), served memory-mapped
    with their packing and shuffle indexes cached in `cache_dir` (default: beside the data); several indexed
    datasets are blended by their weights. The tokenizer is loaded from `tokenizer_path` when given (refused when it has
    more pieces than a given `vocab_size`); otherwise trained on the training split with `vocab_size` and written
    to `<tokenizer_out>.model`. Held-out documents never reach tokenizer training.
    """
    entries = parse_paths(paths or [])
    if any(_is_indexed(p) for p, _ in entries):
        if not all(_is_indexed(p) for p, _ in entries):
            raise DataError("data.paths: do not mix indexed datasets (.bin/.idx) with text corpora")
        return _prepare_indexed(entries, seq_length, seed, eval_fraction, tokenizer_path, vocab_size, cache_dir)
    if any(w is not None for _, w in entries):
        raise DataError("data.paths: weights blend indexed datasets; tokenize the text corpora first with "
                        "python -m scripts.preprocess_data")
    paths = [p for p, _ in entries]
    texts = load_texts(paths) if paths else default_corpus()
    train_texts, held_texts = split_holdout(texts, eval_fraction, seed)
    if tokenizer_path:
        tokenizer = _load_tokenizer(tokenizer_path, vocab_size)
    else:
        if not vocab_size or not tokenizer_out:
            raise ValueError("prepare_data: give tokenizer_path, or vocab_size and tokenizer_out to train one")
        Path(tokenizer_out).parent.mkdir(parents=True, exist_ok=True)
        tokenizer = Tokenizer.load(train_tokenizer(train_texts, vocab_size, tokenizer_out))
    train = pack_documents(tokenizer.encode_documents(train_texts), seq_length, tokenizer.eod_id)
    held = pack_documents(tokenizer.encode_documents(held_texts), seq_length, tokenizer.eod_id) if held_texts else None
    return PreparedData(tokenizer, train, held)
