"""SentencePiece tokenizer: trained from a corpus or loaded from a model file; any text round-trips exactly.

BPE with byte fallback, so Chinese, code and any Unicode character encode without an unknown token. Identity
normalization, no dummy prefix and kept whitespace make decode(encode(text)) == text, which packing and evaluation
rely on. Special ids are fixed: unk 0, bos 1, eos 2 (the end-of-document token), pad 3.
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import sentencepiece as spm

from data_sched.errors import DataError

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
# Enough lines to learn an 8K vocabulary well; more only slows training (about linearly).
MAX_TRAINING_LINES = 200_000
MAX_LINE_BYTES = 16384
CHARACTER_COVERAGE = 0.9995
MIN_CHARACTER_COVERAGE = 0.98
# 256 byte pieces and the 4 special ids come before any learned piece.
RESERVED_PIECES = 260


def _training_lines(texts: list[str], max_lines: int) -> list[str]:
    lines = [line for text in texts for line in text.split("\n") if line.strip()]
    if len(lines) > max_lines:
        # An even stride keeps the sample deterministic and spread over the whole corpus.
        keep = np.linspace(0, len(lines) - 1, max_lines).round().astype(np.int64)
        lines = [lines[i] for i in keep]
    return lines


def _character_coverage(lines: list[str], vocab_size: int) -> float:
    """Coverage that leaves about half of the learnable vocabulary to merges.

    SentencePiece gives every character inside the coverage its own piece; a Chinese corpus has thousands, more
    than a small vocabulary holds. Rarer characters fall back to bytes, so lowering the coverage only costs length;
    SentencePiece accepts no coverage below MIN_CHARACTER_COVERAGE.
    """
    counts = np.sort(np.fromiter(Counter("".join(lines)).values(), dtype=np.int64))[::-1]
    cumulative = np.cumsum(counts) / counts.sum()
    budget = max(1, (vocab_size - RESERVED_PIECES) // 2)
    if len(counts) <= budget:
        return CHARACTER_COVERAGE
    needed = int(np.searchsorted(cumulative, MIN_CHARACTER_COVERAGE)) + 1
    if needed + RESERVED_PIECES > vocab_size:
        raise DataError(f"tokenizer.vocab_size={vocab_size}: this corpus needs at least {needed + RESERVED_PIECES}"
                        f" to give its most frequent characters (98% of the text) their own pieces")
    return float(np.clip(cumulative[budget - 1] * (1 - 1e-6), MIN_CHARACTER_COVERAGE, CHARACTER_COVERAGE))


def train_tokenizer(texts: list[str], vocab_size: int, out_prefix: str,
                    max_lines: int = MAX_TRAINING_LINES) -> str:
    """Train a BPE model on `texts` and write `<out_prefix>.model`; returns that path. Deterministic."""
    lines = _training_lines(texts, max_lines)
    if not lines:
        raise DataError("tokenizer training corpus is empty (no non-blank line)")
    out = Path(f"{out_prefix}.model")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines), model_writer=f, vocab_size=int(vocab_size), model_type="bpe",
                byte_fallback=True, character_coverage=_character_coverage(lines, int(vocab_size)), split_digits=True,
                normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
                allow_whitespace_only_pieces=True, max_sentence_length=MAX_LINE_BYTES,
                unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
                shuffle_input_sentence=False, num_threads=1, minloglevel=2)
        os.replace(tmp, out)
    except RuntimeError as e:
        raise DataError(f"tokenizer.vocab_size={vocab_size}: training failed: {str(e).strip()}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return str(out)


class Tokenizer:
    """A loaded SentencePiece model with the ids the data pipeline needs."""

    def __init__(self, processor: spm.SentencePieceProcessor, path: str):
        self._sp = processor
        self.path = path

    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        if not Path(path).is_file():
            raise DataError(f"{path}: tokenizer model file not found")
        sp = spm.SentencePieceProcessor()
        try:
            sp.load(str(path))
        except (RuntimeError, OSError):
            raise DataError(f"{path}: not a SentencePiece tokenizer model") from None
        tok = cls(sp, str(path))
        if sp.eos_id() < 0:
            raise DataError(f"{path}: tokenizer model has no eos (end-of-document) token")
        return tok

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        # Models trained elsewhere may lack a pad piece; pad positions are masked, so any valid id serves.
        pad = self._sp.pad_id()
        return pad if pad >= 0 else self.eod_id

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each document as int32 arrays (batched in C++)."""
        return [np.asarray(ids, dtype=np.int32) for ids in self._sp.encode(list(texts))]
