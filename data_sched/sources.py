"""User corpora: JSONL with a "text" field per line, or plain text split into documents at blank lines.

Plain text: documents end at blank-line runs; a file without any blank line has one document per line.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from data_sched.errors import DataError

# A blank-line run (possibly holding spaces) ends a document: paragraphs, speeches and chapters stay whole.
_BLANK_RUN = re.compile(r"\n[ \t\r\f\v]*\n\s*")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: corpus file not found") from None
    except IsADirectoryError:
        raise DataError(f"{path}: expected a corpus file, got a directory") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: expected UTF-8 text, undecodable byte at offset {e.start}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read corpus file ({e.strerror})") from None


def _jsonl_documents(path: Path, text: str) -> list[str]:
    docs = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: corrupt JSONL line ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict) or "text" not in record:
            raise DataError(f"{path}:{lineno}: expected a JSON object with a \"text\" field")
        if not isinstance(record["text"], str):
            raise DataError(f"{path}:{lineno}: field \"text\" must be a string, got {type(record['text']).__name__}")
        if record["text"]:
            docs.append(record["text"])
    return docs


def _plain_documents(text: str) -> list[str]:
    # A file with no blank line at all (one paragraph per line, as many Chinese texts are) is split at lines,
    # otherwise it would be a single document the size of the file.
    parts = _BLANK_RUN.split(text) if _BLANK_RUN.search(text) else text.splitlines()
    return [d.strip("\n") for d in parts if d.strip()]


def load_texts(paths: list[str]) -> list[str]:
    """Documents of every file in order. `.jsonl`: one per line; `.txt`: split at blank-line runs (or lines)."""
    if not paths:
        raise DataError("data.paths: expected at least one corpus file (.jsonl or .txt)")
    docs: list[str] = []
    for name in paths:
        path = Path(name)
        suffix = path.suffix.lower()
        if suffix not in (".jsonl", ".txt"):
            raise DataError(f"{path}: expected a .jsonl or .txt corpus file, got suffix {suffix or '(none)'!r}")
        text = _read_text(path)
        docs.extend(_jsonl_documents(path, text) if suffix == ".jsonl" else _plain_documents(text))
    if not docs:
        raise DataError(f"{', '.join(paths)}: corpus is empty (no non-empty documents)")
    return docs
