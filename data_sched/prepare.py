"""From a recipe's data section to packed train/held-out samples and the tokenizer: the trainer's one call."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data_sched.default_corpus import default_corpus
from data_sched.errors import DataError
from data_sched.loader import split_holdout
from data_sched.packing import PackedSamples, pack_documents
from data_sched.sources import load_texts
from data_sched.tokenizer import Tokenizer, train_tokenizer


@dataclass(frozen=True)
class PreparedData:
    tokenizer: Tokenizer
    train: PackedSamples
    held_out: PackedSamples | None


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


def _prepare_indexed(paths: list[str], seq_length: int, seed: int, eval_fraction: float,
                     tokenizer_path: str | None, vocab_size: int | None) -> PreparedData:
    from data_sched.indexed_dataset import read_documents

    if not tokenizer_path:
        raise DataError(f"data.tokenizer: {paths[0]} holds token ids; name the tokenizer that produced them")
    tokenizer = _load_tokenizer(tokenizer_path, vocab_size)
    docs = []
    for path in paths:
        found = read_documents(path, eod_id=tokenizer.eod_id)
        top = max((int(d.max()) for d in found if len(d)), default=0)
        if top >= tokenizer.vocab_size:
            raise DataError(f"{path}: token id {top} does not fit tokenizer {tokenizer_path} "
                            f"(vocab_size {tokenizer.vocab_size})")
        docs.extend(found)
    train_docs, held_docs = split_holdout(docs, eval_fraction, seed)
    held = pack_documents(held_docs, seq_length, tokenizer.eod_id) if held_docs else None
    return PreparedData(tokenizer, pack_documents(train_docs, seq_length, tokenizer.eod_id), held)


def prepare_data(paths: list[str] | None, seq_length: int, seed: int, eval_fraction: float,
                 tokenizer_path: str | None = None, vocab_size: int | None = None,
                 tokenizer_out: str | None = None) -> PreparedData:
    """Load documents (the default corpus when `paths` is empty), split off a held-out set, tokenize, pack.

    `paths` are text corpora (.jsonl/.txt) or indexed datasets (.bin/.idx from scripts/preprocess_data.py, with
    the tokenizer that wrote them). The tokenizer is loaded from `tokenizer_path` when given (refused when it has
    more pieces than a given `vocab_size`); otherwise trained on the training split with `vocab_size` and written
    to `<tokenizer_out>.model`. Held-out documents never reach tokenizer training.
    """
    if paths and any(_is_indexed(p) for p in paths):
        if not all(_is_indexed(p) for p in paths):
            raise DataError("data.paths: do not mix indexed datasets (.bin/.idx) with text corpora")
        return _prepare_indexed(list(paths), seq_length, seed, eval_fraction, tokenizer_path, vocab_size)
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
