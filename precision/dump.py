"""Tensor dumps: named tensors of chosen training steps, saved as safetensors with a JSON index.

Layout of a dump directory (one per run; every rank of the run writes its own files, so ranks never contend):

    run.json                         format version and run metadata (model config hash, parallel layout, ...)
    step_00000010.rank0.safetensors  the tensors of step 10 on rank 0
    step_00000010.rank0.json         their index: name, kind, layer, operator, order, shape, dtype, k, dims

Kinds: forward (per-layer outputs, listed in forward order), loss, grad (listed in parameter order, i.e. forward
order; the comparison walks them backwards, as backward computes them) and optimizer (states after the step).
Every file is written to a temporary name and renamed, so a killed writer never leaves a half file behind and an
index never points at tensors that are not there.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from oneline import InputError

FORMAT = "precision-dump/1"
KINDS = ("forward", "loss", "grad", "optimizer")
_STEP_FILE = re.compile(r"^step_(\d+)\.rank(\d+)\.json$")


class DumpError(InputError):
    """A dump that cannot be written or read; the message is one line that names the file or field."""


@dataclass(frozen=True)
class TensorRecord:
    """One tensor to dump. `k` is the accumulation count of the operator that produced it (the tolerance of
    the comparison grows with it; None: the tensor's last dimension). `dims` names the axes, one letter each
    (b batch, s sequence, h hidden, n heads, d head dim, e experts, t tokens), so the comparison can tell an
    error confined to a sequence shard."""
    name: str
    kind: str
    value: Any
    layer: int | None = None
    operator: str = ""
    k: int | None = None
    dims: str = ""


@dataclass(frozen=True)
class IndexEntry:
    name: str
    kind: str
    layer: int | None
    operator: str
    order: int
    shape: tuple[int, ...]
    dtype: str
    k: int
    dims: str
    step: int
    rank: int


def to_numpy(value) -> tuple[np.ndarray, str]:
    """(array, original dtype name) of a NumPy array or a MindSpore tensor; bfloat16 is stored as float32,
    which holds it exactly (NumPy has no bfloat16)."""
    if hasattr(value, "asnumpy"):
        dtype = str(value.dtype).lower()
        if dtype == "bfloat16":
            import mindspore as ms
            return value.astype(ms.float32).asnumpy(), "bfloat16"
        value = value.asnumpy()
    array = np.ascontiguousarray(np.asarray(value))
    return array, str(array.dtype)


def config_hash(config: Any) -> str:
    """A short stable hash of a model configuration (dataclass, dict or anything JSON can render)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def layout_meta(layout) -> dict:
    """The parallel degrees of a ParallelLayout as plain JSON."""
    return layout.degrees()


def parse_steps(text: str, field_name: str = "dump_steps") -> frozenset[int]:
    """'10,20,100-105' -> {10, 20, 100, ..., 105}; a clear error naming `field_name` otherwise."""
    steps: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match or (match.group(2) and int(match.group(2)) < int(match.group(1))):
            raise DumpError(f"{field_name}: expected step numbers and ranges like '10,20,100-105', got {text!r}")
        first = int(match.group(1))
        steps.update(range(first, int(match.group(2) or first) + 1))
    return frozenset(steps)


def _atomic_write_bytes(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _atomic_write_json(path: Path, payload) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    _atomic_write_bytes(path, write)


class DumpWriter:
    """Writes the tensors of chosen steps for one rank. Reusing a directory continues the same run (resume);
    a directory that holds a dump of another model or layout is refused, so no earlier dump is mixed up."""

    def __init__(self, root, meta: Mapping[str, Any], steps: Iterable[int] | None = None, rank: int = 0):
        self.root = Path(root)
        self.meta = dict(meta)
        self.steps = None if steps is None else frozenset(steps)
        self.rank = rank
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise DumpError(f"{self.root}: cannot create the dump directory ({error.strerror})") from None
        run_file = self.root / "run.json"
        if run_file.exists():
            existing = read_run_meta(self.root)
            if json.loads(json.dumps(self.meta, default=str)) != existing:
                raise DumpError(f"{self.root}: already holds a dump of another run (run.json differs); "
                                f"choose a new directory")
        elif rank == 0:
            _atomic_write_json(run_file, {"format": FORMAT, "meta": json.loads(json.dumps(self.meta, default=str))})

    def wants(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def write(self, step: int, records: Sequence[TensorRecord]) -> list[IndexEntry]:
        """Save `records` of `step`: forward records in forward order, grads in parameter order."""
        arrays: dict[str, np.ndarray] = {}
        entries: list[IndexEntry] = []
        order = {kind: 0 for kind in KINDS}
        for record in records:
            if record.kind not in KINDS:
                raise DumpError(f"{record.name}: kind must be one of {KINDS}, got {record.kind!r}")
            if record.name in arrays:
                raise DumpError(f"{record.name}: dumped twice in step {step}")
            array, dtype = to_numpy(record.value)
            if record.dims and len(record.dims) != array.ndim:
                raise DumpError(f"{record.name}: dims {record.dims!r} do not match its {array.ndim} axes")
            arrays[record.name] = array
            k = record.k if record.k is not None else (array.shape[-1] if array.ndim else 1)
            entries.append(IndexEntry(record.name, record.kind, record.layer, record.operator, order[record.kind],
                                      tuple(array.shape), dtype, max(1, int(k)), record.dims, step, self.rank))
            order[record.kind] += 1
        stem = f"step_{step:08d}.rank{self.rank}"
        _atomic_write_bytes(self.root / f"{stem}.safetensors", lambda tmp: save_file(arrays, str(tmp)))
        _atomic_write_json(self.root / f"{stem}.json", [dataclasses.asdict(e) for e in entries])
        return entries


# ---- reading ------------------------------------------------------------------------------------------
def read_run_meta(root) -> dict:
    path = Path(root) / "run.json"
    if not Path(root).is_dir():
        raise DumpError(f"{root}: no such dump directory")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DumpError(f"{root}: not a tensor dump (no run.json)") from None
    except (OSError, json.JSONDecodeError) as error:
        raise DumpError(f"{path}: unreadable run metadata ({error})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise DumpError(f"{path}: expected format {FORMAT!r}")
    return payload.get("meta", {})


@dataclass
class DumpRun:
    """A dump directory opened for reading: metadata and, per step and rank, the index entries."""
    root: Path
    meta: dict
    index: dict[int, dict[int, list[IndexEntry]]] = field(default_factory=dict)
    # One open (memory-mapped) file per step and rank: opening it parses its whole header, so opening it per
    # tensor made reading a dump quadratic in its tensor count (10 s for 1500 tensors).
    _files: dict[Path, Any] = field(default_factory=dict, repr=False)

    @property
    def steps(self) -> list[int]:
        return sorted(self.index)

    def entries(self, step: int, rank: int = 0) -> list[IndexEntry]:
        return self.index[step][rank]

    def ranks(self, step: int) -> list[int]:
        return sorted(self.index.get(step, {}))

    def load(self, entry: IndexEntry) -> np.ndarray:
        path = self.root / f"step_{entry.step:08d}.rank{entry.rank}.safetensors"
        try:
            if path not in self._files:
                self._files[path] = safe_open(str(path), framework="np")
            return self._files[path].get_tensor(entry.name)
        except FileNotFoundError:
            raise DumpError(f"{path}: missing tensor file for the index beside it") from None
        except Exception as error:  # safetensors raises its own error types for corrupt files
            raise DumpError(f"{path}: unreadable tensor {entry.name!r} ({type(error).__name__})") from None


def open_run(root) -> DumpRun:
    root = Path(root)
    run = DumpRun(root, read_run_meta(root))
    for path in sorted(root.iterdir()):
        match = _STEP_FILE.match(path.name)
        if not match:
            continue
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            entries = [IndexEntry(**{**item, "shape": tuple(item["shape"])}) for item in raw]
        except (OSError, json.JSONDecodeError, TypeError, KeyError) as error:
            raise DumpError(f"{path}: unreadable index ({type(error).__name__})") from None
        run.index.setdefault(int(match.group(1)), {})[int(match.group(2))] = entries
    if not run.index:
        raise DumpError(f"{root}: the dump holds no step")
    return run
