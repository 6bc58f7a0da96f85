"""From a recipe's data section to packed train/held-out samples and the tokenizer: the trainer's one call."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data_sched.default_corpus import default_corpus
from data_sched.loader import split_holdout
from data_sched.packing import PackedSamples, pack_documents
from data_sched.sources import load_texts
from data_sched.tokenizer import Tokenizer, train_tokenizer


@dataclass(frozen=True)
class PreparedData:
    tokenizer: Tokenizer
    train: PackedSamples
    held_out: PackedSamples | None


def prepare_data(paths: list[str] | None, seq_length: int, seed: int, eval_fraction: float,
                 tokenizer_path: str | None = None, vocab_size: int | None = None,
                 tokenizer_out: str | None = None) -> PreparedData:
    """Load documents (the default corpus when `paths` is empty), split off a held-out set, tokenize, pack.

    The tokenizer is loaded from `tokenizer_path` when given; otherwise trained on the training split with
    `vocab_size` and written to `<tokenizer_out>.model`. The held-out documents never reach tokenizer training.
    """
    texts = load_texts(paths) if paths else default_corpus()
    train_texts, held_texts = split_holdout(texts, eval_fraction, seed)
    if tokenizer_path:
        tokenizer = Tokenizer.load(tokenizer_path)
    else:
        if not vocab_size or not tokenizer_out:
            raise ValueError("prepare_data: give tokenizer_path, or vocab_size and tokenizer_out to train one")
        Path(tokenizer_out).parent.mkdir(parents=True, exist_ok=True)
        tokenizer = Tokenizer.load(train_tokenizer(train_texts, vocab_size, tokenizer_out))
    train = pack_documents(tokenizer.encode_documents(train_texts), seq_length, tokenizer.eod_id)
    held = pack_documents(tokenizer.encode_documents(held_texts), seq_length, tokenizer.eod_id) if held_texts else None
    return PreparedData(tokenizer, train, held)
