"""Checkpoints: per-rank safetensors of model + optimizer, and a JSON trainer state, written atomically.

Layout: `<dir>/rank_<r>/step_<n>/{weights.safetensors, state.json}`. The weights go through the application's one
safetensors reader and writer (`telechat_moe.safetensors_io`), every parameter in its own dtype, bit for bit (a
file of float32 and integer parameters is also what `safetensors.numpy.load_file` reads). A checkpoint is first
written to a hidden `.tmp_step_<n>` folder and renamed only when complete, so a crash mid-write leaves the previous
one intact and the half-written folder is never picked by `--resume`.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
from mindspore import Parameter, Tensor

from telechat_moe.errors import CheckpointError
from telechat_moe.safetensors_io import read_safetensors, write_safetensors

WEIGHTS, STATE = "weights.safetensors", "state.json"


def rank_dir(root: str | Path, rank: int) -> Path:
    return Path(root) / f"rank_{rank}"


def preflight(root: str | Path, rank: int, nbytes: int) -> None:
    """Before training: the rank's checkpoint folder can be created and written, and its filesystem has room for one
    more checkpoint of `nbytes`; else CheckpointError naming the folder and what is wrong."""
    d = rank_dir(root, rank)
    probe = d / f".probe_{os.getpid()}"
    try:
        d.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"0")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise CheckpointError(f"{d}: checkpoint folder is not writable ({e.strerror or e.__class__.__name__})") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    free = shutil.disk_usage(d).free
    if free < nbytes:
        raise CheckpointError(f"{d}: {free / 2**20:.1f} MiB free on its filesystem, one checkpoint needs "
                              f"{nbytes / 2**20:.1f} MiB")


def list_checkpoints(root: str | Path, rank: int) -> list[Path]:
    d = rank_dir(root, rank)
    if not d.is_dir():
        return []
    done = [p for p in d.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / STATE).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(root: str | Path, rank: int) -> Path | None:
    found = list_checkpoints(root, rank)
    return found[-1] if found else None


def save_checkpoint(root: str | Path, rank: int, step: int, params: list[Parameter], state: dict, keep: int) -> Path:
    d = rank_dir(root, rank)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"step_{step:08d}"
    tmp = d / f".tmp_step_{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_safetensors(tmp / WEIGHTS, {p.name: p.asnumpy() for p in params}, {"format": "ms"})
    with open(tmp / STATE, "w", encoding="utf-8") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(root, rank)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path, params: list[Parameter]) -> dict:
    """Load weights into `params` (all of them must be present, with the same shapes) and return the state."""
    path = Path(path)
    weights, state_file = path / WEIGHTS, path / STATE
    if not weights.is_file() or not state_file.is_file():
        raise CheckpointError(f"{path}: not a checkpoint folder (expected {WEIGHTS} and {STATE})")
    stored, _ = read_safetensors(weights)  # a torn or foreign file: CheckpointError naming it
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{state_file}: unreadable trainer state ({e.__class__.__name__})") from None
    for p in params:
        if p.name not in stored:
            raise CheckpointError(f"{weights}: has no tensor {p.name!r}; it was written by a different model")
        if tuple(stored[p.name].shape) != tuple(p.shape):
            raise CheckpointError(f"{weights}: {p.name} has shape {tuple(stored[p.name].shape)}, this model "
                                  f"expects {tuple(p.shape)}; it was written by a model of another shape")
    for p in params:
        p.set_data(Tensor(np.array(stored[p.name])).astype(p.dtype))  # a copy: the file is mapped read-only
    return state
