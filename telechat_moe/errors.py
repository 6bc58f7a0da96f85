"""User-facing errors of the application: each message is one line naming the key or file and what was expected.
The entry point prints it and exits with code 2. Kept free of MindSpore so that bad input fails fast."""
import argparse


class RecipeError(ValueError):
    """A recipe that cannot be used."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used."""


class OneLineParser(argparse.ArgumentParser):
    """The command line of every tool: a usage error is one line on stderr naming the program, and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")
