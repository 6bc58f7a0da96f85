"""Indexes computed once and kept on disk as .npy files, named by a hash of everything that determines them.

Every rank that finds an index missing builds it itself and publishes it with an atomic rename; the arrays are
pure functions of the key, so concurrent builders write the same bytes and whichever rename lands last changes
nothing. No rank waits for another and no communicator is needed before the data is ready: the cache works the
same on a shared file system (the first run's ranks race, later runs find the files) and on node-local disks
(each node builds its own copy). The price is that on a corpus's first run every rank of a node computes the same
indexes at the same time (measured in bench/data_scale.py); later runs only memory-map them.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Callable

import numpy as np

from data_sched.errors import DataError

# Bump when what an index holds or how it is computed changes: old files then stop matching any key.
INDEX_FORMAT = 1

CACHE_FOLDER = "index_cache"   # beside the data when the recipe names no data.cache_dir


def file_identity(path: str) -> dict:
    """What names a data file's contents without reading them: its resolved path, size and modification time."""
    st = os.stat(path)
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def cache_key(**parts) -> str:
    """A short stable hash of `parts` (JSON-serialisable) and the index format."""
    text = json.dumps({"format": INDEX_FORMAT, **parts}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cache_folder(cache_dir: str, data_path: str) -> Path:
    """The recipe's data.cache_dir, else `index_cache/` beside the data; created, or a DataError naming the key."""
    folder = Path(cache_dir) if cache_dir else Path(data_path).resolve().parent / CACHE_FOLDER
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise DataError(f"data.cache_dir: cannot write indexes into {folder} ({e.strerror}); name a writable "
                        f"folder") from None
    return folder


def _save_atomically(path: Path, write: Callable[[str], None]) -> None:
    # the host too: ranks of two nodes building into one shared folder may have the same process id
    tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _write_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)


def cached_arrays(folder: Path, key: str, names: tuple[str, ...],
                  build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Arrays `names` of index `key`, memory-mapped from `folder`; built and published first when any is missing.

    The manifest `<key>.json` is written last, so its presence means every array of the key is complete.
    """
    manifest = folder / f"{key}.json"
    if not manifest.is_file():
        arrays = build()
        for name in names:
            _save_atomically(folder / f"{key}_{name}.npy", lambda tmp, a=arrays[name]: _write_npy(tmp, a))
        _save_atomically(manifest, lambda tmp: Path(tmp).write_text(json.dumps(sorted(names))))
        del arrays
    return {name: np.load(folder / f"{key}_{name}.npy", mmap_mode="r", allow_pickle=False) for name in names}


def cached_json(folder: Path, key: str, build: Callable[[], dict]) -> dict:
    """A small JSON record of index `key` (sizes, checks), built and published when missing."""
    path = folder / f"{key}_meta.json"
    if not path.is_file():
        record = build()
        _save_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(record, sort_keys=True)))
        return record
    return json.loads(path.read_text())
