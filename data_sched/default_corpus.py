"""An embedded default corpus: the docstrings of the installed Python standard library.

Real English prose (with code fragments), thousands of documents with a long tail of lengths, and no download:
the text ships with every Python. The stdlib sources are parsed with `ast`, never imported, so no module runs
(antigravity, turtle, tkinter ...) and the result depends only on the Python version. Files and docstrings are
visited in sorted-path, source order, so the corpus is identical across runs and machines with the same Python.
"""
from __future__ import annotations

import ast
import os
import sysconfig
from pathlib import Path

# Test suites, GUI and demo packages, and third-party installs are not documentation of the standard library.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "tkinter",
                          "lib2to3", "ensurepip", "__pycache__", "venv"})
# One-line docstrings such as "Return self." carry no language to learn from.
MIN_CHARS = 40

_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_sources(root: str | None = None) -> list[Path]:
    """The standard library's .py files in sorted order (directories pruned by SKIPPED_DIRS)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for here, dirs, names in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        files.extend(Path(here) / n for n in sorted(names) if n.endswith(".py"))
    return files


def _docstrings_in_source_order(node: ast.AST):
    if isinstance(node, _DOC_NODES):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc
    for child in ast.iter_child_nodes(node):
        yield from _docstrings_in_source_order(child)


def default_corpus(root: str | None = None) -> list[str]:
    """Docstrings of the standard library, deduplicated, at least MIN_CHARS long, in a deterministic order."""
    seen: set[str] = set()
    docs: list[str] = []
    for path in stdlib_sources(root):
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue  # a broken or unreadable file in someone's stdlib is not the user's problem
        for doc in _docstrings_in_source_order(tree):
            if len(doc) >= MIN_CHARS and doc not in seen:
                seen.add(doc)
                docs.append(doc)
    return docs
