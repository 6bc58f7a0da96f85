"""An embedded default corpus: the docstrings of the installed Python standard library.

Real English prose (with code fragments), thousands of documents with a long tail of lengths, and no download:
the text ships with every Python. The stdlib sources are parsed with `ast`, never imported, so no module runs
(antigravity, turtle, tkinter ...) and the result depends only on the Python version. Files and docstrings are
visited in sorted-path, source order, so the corpus is identical across runs and machines with the same Python.
Parsing takes seconds, paid by every process of every launch, so the result is kept in the user's cache folder,
keyed by the sources it came from and by this file's own text (an edited extractor never reads an old corpus).
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import tempfile
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


def cache_dir() -> Path:
    """Where prepared data is kept between runs: $XDG_CACHE_HOME/telechat_moe (~/.cache/telechat_moe)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "telechat_moe"


def default_corpus(root: str | None = None) -> list[str]:
    """Docstrings of the standard library, deduplicated, at least MIN_CHARS long, in a deterministic order (read
    from the cache when these sources were parsed before)."""
    sources = stdlib_sources(root)
    key = hashlib.sha256(Path(__file__).read_bytes())
    for path in sources:
        try:
            stat = path.stat()
            key.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        except OSError:                      # a dangling link: _parse skips it too
            key.update(f"{path}\0missing\0".encode())
    cached = cache_dir() / f"default_corpus-{key.hexdigest()[:24]}.json"
    try:
        return json.loads(cached.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    docs = _parse(sources)
    try:                                     # written whole under another name, then renamed: concurrent ranks
        cached.parent.mkdir(parents=True, exist_ok=True)        # never read half a file
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=cached.parent, delete=False) as f:
            json.dump(docs, f, ensure_ascii=False)
        os.replace(f.name, cached)
    except OSError:
        pass                                 # a read-only home: parse again next time
    return docs


def _parse(sources: list[Path]) -> list[str]:
    seen: set[str] = set()
    docs: list[str] = []
    for path in sources:
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue  # a broken or unreadable file in someone's stdlib is not the user's problem
        for doc in _docstrings_in_source_order(tree):
            if len(doc) >= MIN_CHARS and doc not in seen:
                seen.add(doc)
                docs.append(doc)
    return docs
