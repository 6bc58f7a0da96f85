"""The one-line convention every tool here keeps: bad input stops with one line naming the field or file, and
exit code 2. Its two pieces live here, below every package, so that libraries and entry points share them without
importing the application.

- `InputError`: the base of every "this input cannot be used" error (recipes, data, layouts, clusters, dumps,
  checkpoints, conversions); its message is the line the user sees. Entry points catch it, print it, exit 2.
- `OneLineParser`: the argparse parser of every command line; a usage error is one line and exit code 2.
"""
import argparse


class InputError(ValueError):
    """An input that cannot be used; the message is one line naming the field or file and what was expected."""


class OneLineParser(argparse.ArgumentParser):
    """The command line of every tool: a usage error is one line on stderr naming the program, and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")
