"""The one error type of the data side: bad user data, reported in one line."""
from __future__ import annotations

from oneline import InputError


class DataError(InputError):
    """A corpus, tokenizer or dataset file that cannot be used.

    The message is one line naming the file (or field) and what was expected; entry points print it and exit 2.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
