"""Checkpoints: per-rank safetensors of model + optimizer, and a JSON trainer state, written atomically.

Layout: `<dir>/rank_<r>/step_<n>/{weights.safetensors, state.json}`. The weights go through the application's one
safetensors reader and writer (`telechat_moe.safetensors_io`), every parameter in its own dtype, bit for bit (a
file of float32 and integer parameters is also what `safetensors.numpy.load_file` reads). A checkpoint is first
written to a hidden `.tmp_step_<n>` folder and renamed only when complete, so a crash mid-write leaves the previous
one intact and the half-written folder is never picked by `--resume`; a write that fails (disk full, read-only
folder) removes that folder and is one `CheckpointError` naming the rank's folder and the cause.

Discovery takes only `step_<number>/` folders holding a `state.json`; anything else in a rank's folder (a user's
`step_best/`, another tool's files) is left alone with one warning line on stderr. A loaded `state.json` is checked
against the fields its reader needs (`TRAINER_STATE` for the trainer's), so a `{}` or mistyped state is one line
naming the file, not a KeyError later.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from mindspore import Parameter, Tensor

from telechat_moe.errors import CheckpointError
from telechat_moe.safetensors_io import read_safetensors, write_probe, write_safetensors

WEIGHTS, STATE = "weights.safetensors", "state.json"
# What Trainer.save writes and Trainer.resume reads: field -> type, or the fields of a nested object.
TRAINER_STATE = {"step": int, "data": {"epoch": int, "index": int}, "loss_scale": float, "loss_scale_good_steps": int}
_warned: set[Path] = set()  # foreign entries already reported by this process (discovery runs at every save)


def rank_dir(root: str | Path, rank: int) -> Path:
    return Path(root) / f"rank_{rank}"


def preflight(root: str | Path, rank: int, nbytes: int) -> None:
    """Before training: the rank's checkpoint folder can be created and written, and its filesystem has room for one
    more checkpoint of `nbytes`; else CheckpointError naming the folder and what is wrong."""
    d = rank_dir(root, rank)
    try:
        write_probe(d)
    except OSError as e:
        cause = e.strerror or e.__class__.__name__
        raise CheckpointError(f"{d}: checkpoint folder is not writable ({cause})") from None
    free = shutil.disk_usage(d).free
    if free < nbytes:
        raise CheckpointError(f"{d}: {free / 2**20:.1f} MiB free on its filesystem, one checkpoint needs "
                              f"{nbytes / 2**20:.1f} MiB")


def _step_of(p: Path) -> int | None:
    """The step of a complete checkpoint folder `step_<number>/` (with its state.json), else None."""
    number = p.name[len("step_"):]
    if p.name.startswith("step_") and number.isascii() and number.isdigit() and p.is_dir() and (p / STATE).is_file():
        return int(number)
    return None


def list_checkpoints(root: str | Path, rank: int) -> list[Path]:
    """The rank's complete checkpoints, oldest first. Hidden entries (this module's temporary folders) are skipped;
    any other foreign entry is skipped with one warning line on stderr (once per process)."""
    d = rank_dir(root, rank)
    if not d.is_dir():
        return []
    done = []
    for p in sorted(d.iterdir()):
        step = _step_of(p)
        if step is not None:
            done.append((step, p))
        elif not p.name.startswith(".") and p not in _warned:
            _warned.add(p)
            print(f"WARNING: {p}: not a checkpoint (expected step_<number>/ holding {STATE}), ignored",
                  file=sys.stderr, flush=True)
    return [p for _, p in sorted(done)]


def latest_checkpoint(root: str | Path, rank: int) -> Path | None:
    found = list_checkpoints(root, rank)
    return found[-1] if found else None


def save_checkpoint(root: str | Path, rank: int, step: int, params: list[Parameter], state: dict, keep: int) -> Path:
    """Write `step_<step>/` atomically. On failure the half-written folder is removed, the earlier checkpoints are
    untouched (one of the same step too), and an OSError becomes a CheckpointError naming the folder and the cause."""
    d = rank_dir(root, rank)
    final = d / f"step_{step:08d}"
    tmp = d / f".tmp_step_{step:08d}"
    old = d / f".old_step_{step:08d}"  # a checkpoint of the same step, set aside until the new one is in place
    try:
        d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_safetensors(tmp / WEIGHTS, {p.name: p.asnumpy() for p in params}, {"format": "ms"})
        with open(tmp / STATE, "w", encoding="utf-8") as f:
            json.dump(state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            os.replace(old, final)
        if not isinstance(e, OSError):
            raise
        left = "its temporary folder could not be removed" if tmp.exists() else "nothing half-written is left"
        previous = [p.name for p in list_checkpoints(root, rank)]
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "there is no earlier checkpoint"
        raise CheckpointError(f"{d}: checkpoint of step {step} not saved ({e.strerror or e.__class__.__name__}); "
                              f"{kept}, {left}") from None
    shutil.rmtree(old, ignore_errors=True)
    for stale in list_checkpoints(root, rank)[:-keep] if keep > 0 else []:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _state_problem(state, fields: dict, where: str = "") -> str | None:
    """What is wrong with `state` against `fields` (field -> type, or a nested dict of fields), or None."""
    if not isinstance(state, dict):
        return f"{where or 'the state'} is {type(state).__name__}, expected a JSON object"
    for key, want in fields.items():
        name = f"{where}.{key}" if where else key
        if key not in state:
            return f"has no field {name!r}"
        value = state[key]
        if isinstance(want, dict):
            problem = _state_problem(value, want, name)
            if problem:
                return problem
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if want is float and not (number and math.isfinite(value) and value > 0):
            return f"{name} is {value!r}, expected a positive finite number"
        if want is int and not (number and isinstance(value, int) and value >= 0):
            return f"{name} is {value!r}, expected a non-negative integer"
    return None


def load_checkpoint(path: str | Path, params: list[Parameter], fields: dict | None = None) -> dict:
    """Load weights into `params` (all of them must be present, with the same shapes) and return the state, which
    must have `fields` (as TRAINER_STATE describes them) if given. Nothing is loaded unless everything checks."""
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
    problem = _state_problem(state, fields or {})
    if problem:
        raise CheckpointError(f"{state_file}: not a trainer state ({problem})")
    for p in params:
        p.set_data(Tensor(np.array(stored[p.name])).astype(p.dtype))  # a copy: the file is mapped read-only
    return state
