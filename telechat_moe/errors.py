"""User-facing errors of the application: each message is one line naming the key or file and what was expected.
The entry point prints it and exits with code 2. Kept free of MindSpore so that bad input fails fast."""
from oneline import InputError


class RecipeError(InputError):
    """A recipe that cannot be used."""


class CheckpointError(InputError):
    """A checkpoint that cannot be used."""


def require(cond: bool, message: str) -> None:
    """A recipe check: RecipeError(message) unless `cond`."""
    if not cond:
        raise RecipeError(message)
