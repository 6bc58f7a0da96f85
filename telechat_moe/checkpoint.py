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

Sharded parameters (expert parallelism splits the routed experts and their Adam moments along dim 0; tensor
parallelism will split others along other dims) are saved as each rank's own slice, and the rank's `state.json`
records `"shards": {name: [dim, offset, full]}` and `"world"` (how many ranks saved that step); a parameter not
named there is replicated (every rank holds all of it). `resume_point` picks the newest step that every rank of the
run that saved it completed. `load_checkpoint` given this run's layout (`shards`) takes a parameter laid out as it
was saved from the rank's own file, and otherwise assembles the slice it needs from the ranks that saved the step
(`<root>/rank_<r>/<step>/`, opening only the files that hold a part of it), so a resume with another number of
ranks or another split computes the same function. Checkpoints older than these fields load as one rank's, nothing
sharded.

The distributed optimizer (parallel/optim) holds a parameter's Adam moments (and float32 master, below float32
weights) as each rank's slice of its flattened elements: they are saved as flat arrays `adam_m.<name>` sharded
along dim 0 of the flattened parameter, and a tensor saved flat loads into one wanted in the parameter's shape and
the other way round (`_reflattened`), so a dp=4 run resumes at dp=1 (replicated optimizer) or dp=2 and back.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
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


def _complete_steps(root: str | Path, rank: int) -> dict[int, Path]:
    return {_step_of(p): p for p in list_checkpoints(root, rank)}


def _saved_world(step_dir: Path) -> int | None:
    """The number of ranks that saved this step, as its state.json says (1 where it predates the field), or None
    where the file cannot tell (unreadable, not an object, a bad value): load_checkpoint then says what is wrong."""
    try:
        state = json.loads((step_dir / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    world = state.get("world", 1)
    return world if isinstance(world, int) and not isinstance(world, bool) and world >= 1 else None


def resume_point(root: str | Path, rank: int) -> Path | None:
    """The checkpoint folder `rank` resumes from: the newest step of rank 0 that every rank of the run that saved it
    (rank_0 .. rank_<world-1>, world as its state.json records) holds complete; a newer step missing on some rank
    is passed over for an older one. The rank's own folder of that step where it was one of the ranks that saved it,
    else (this run has more ranks than that one) rank 0's: load_checkpoint takes the slices it needs from the
    others. None where there is no such step."""
    steps = {0: _complete_steps(root, 0)}
    for step in sorted(steps[0], reverse=True):
        first = steps[0][step]
        world = _saved_world(first)
        if world is None:  # unreadable: not judged here, load_checkpoint refuses it in one line
            world = 1
        for r in range(1, world):
            if r not in steps:
                steps[r] = _complete_steps(root, r)
        if all(step in steps[r] for r in range(world)):
            if rank == 0:
                return first
            own = steps[rank].get(step) if rank < world else _complete_steps(root, rank).get(step)
            # a folder of that step left by another run (one with more ranks) is not this save's: rank 0's then
            return own if own is not None and _saved_world(own) == _saved_world(first) else first
    return None


@dataclass(frozen=True)
class Shard:
    """This rank holds indices [offset, offset + local size) of dimension `dim` of a tensor whose global size along
    that dimension is `full` (the local size is the parameter's own shape[dim])."""
    dim: int
    offset: int
    full: int


def _shard_problem(shard, shape: tuple) -> str | None:
    """What is wrong with `shard` for a local tensor of `shape`, or None."""
    if not isinstance(shard, Shard) or not all(isinstance(v, int) and not isinstance(v, bool)
                                               for v in (shard.dim, shard.offset, shard.full)):
        return f"{shard!r} is not a Shard(dim, offset, full) of integers"
    if not 0 <= shard.dim < len(shape):
        return f"dim {shard.dim} of a tensor of shape {shape}"
    if not 0 <= shard.offset <= shard.offset + shape[shard.dim] <= shard.full:
        return (f"indices {shard.offset}..{shard.offset + shape[shard.dim]} of dim {shard.dim} are not inside "
                f"its global size {shard.full}")
    return None


def save_checkpoint(root: str | Path, rank: int, step: int, params: list[Parameter], state: dict, keep: int,
                    shards: dict[str, Shard] | None = None, world: int = 1) -> Path:
    """Write `step_<step>/` atomically. On failure the half-written folder is removed, the earlier checkpoints are
    untouched (one of the same step too), and an OSError becomes a CheckpointError naming the folder and the cause.
    `shards` names the parameters of which this rank holds a slice (the others are replicated); state.json records
    them and `world`, the number of ranks saving this step. A wrong `shards` / `world` / a `state` with those keys
    is the caller's bug: ValueError, before anything is written."""
    tensors = {p.name: p.asnumpy() for p in params}
    shards = dict(shards or {})
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"save_checkpoint: world={world!r}, expected a positive integer")
    if "shards" in state or "world" in state:
        raise ValueError("save_checkpoint: the state must not hold 'shards' or 'world'; they are the layout's")
    for name, shard in shards.items():
        if name not in tensors:
            raise ValueError(f"save_checkpoint: shards names {name!r}, which is not among the parameters")
        problem = _shard_problem(shard, tuple(tensors[name].shape))
        if problem:
            raise ValueError(f"save_checkpoint: shards[{name!r}]: {problem}")
    state = {**state, "shards": {n: [s.dim, s.offset, s.full] for n, s in shards.items()}, "world": world}
    d = rank_dir(root, rank)
    final = d / f"step_{step:08d}"
    tmp = d / f".tmp_step_{step:08d}"
    old = d / f".old_step_{step:08d}"  # a checkpoint of the same step, set aside until the new one is in place
    try:
        d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_safetensors(tmp / WEIGHTS, tensors, {"format": "ms"})
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


def _layout(state, state_file: Path) -> tuple[int, dict[str, Shard]]:
    """(world, shards) that a state.json records: (1, {}) where it predates them (or is no object: the trainer
    state's own check says so); a malformed one is a CheckpointError naming the file."""
    if not isinstance(state, dict):
        return 1, {}
    world, raw = state.get("world", 1), state.get("shards", {})
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CheckpointError(f"{state_file}: world is {world!r}, expected a positive integer")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{state_file}: shards is {type(raw).__name__}, expected an object of "
                              f"name: [dim, offset, full]")
    shards = {}
    for name, meta in raw.items():
        if not (isinstance(meta, list) and len(meta) == 3 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                  and v >= 0 for v in meta)):
            raise CheckpointError(f"{state_file}: shards of {name} is {meta!r}, expected [dim, offset, full]")
        shards[name] = Shard(*meta)
    return world, shards


def checkpoint_layout(path: str | Path) -> tuple[int, dict[str, Shard]]:
    """(world, shards) of a checkpoint folder: how many ranks saved it and which slice this folder holds of each
    sharded parameter. CheckpointError where its state.json cannot be read or is malformed."""
    state_file = Path(path) / STATE
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{state_file}: unreadable trainer state ({e.__class__.__name__})") from None
    return _layout(state, state_file)


def _with(shape: tuple, dim: int, size: int) -> tuple:
    return shape[:dim] + (size,) + shape[dim + 1:]


class _Step:
    """The folders of one saved step, opened on demand: every rank's layout (state.json) and weights."""

    def __init__(self, path: Path, world: int, stored: dict, shards: dict[str, Shard]):
        self.path, self.world = path, world
        self.root, self.name = path.parent.parent, path.name
        number = path.parent.name[len("rank_"):]
        self.own = int(number) if path.parent.name.startswith("rank_") and number.isdigit() else None
        self.layouts: dict[int, dict[str, Shard]] = {}
        self.stored: dict[int, dict] = {}
        if self.own is not None:
            self.layouts[self.own], self.stored[self.own] = shards, stored

    def folder(self, rank: int) -> Path:
        return rank_dir(self.root, rank) / self.name

    def layout(self, rank: int, tensor: str) -> dict[str, Shard]:
        if rank not in self.layouts:
            d = self.folder(rank)
            if not (d / WEIGHTS).is_file() or not (d / STATE).is_file():
                raise CheckpointError(f"{d}: missing or incomplete (expected {WEIGHTS} and {STATE}); it holds a "
                                      f"slice of {tensor}, which {self.world} ranks saved sharded")
            world, shards = checkpoint_layout(d)
            if world != self.world:
                raise CheckpointError(f"{d / STATE}: saved by {world} ranks, {self.path / STATE} by {self.world}; "
                                      f"they are not one save of {tensor}")
            self.layouts[rank] = shards
        return self.layouts[rank]

    def weights(self, rank: int) -> dict:
        if rank not in self.stored:
            self.stored[rank] = read_safetensors(self.folder(rank) / WEIGHTS)[0]
        return self.stored[rank]

    def holds(self, rank: int, tensor: str) -> bool:
        """Whether `rank` saved `tensor` at all (under pipeline parallelism a rank saves its stage's tensors)."""
        return (self.folder(rank) / WEIGHTS).is_file() and tensor in self.weights(rank)

    def holder(self, tensor: str) -> int | None:
        """The first rank that saved `tensor`, if any."""
        return next((r for r in range(self.world) if r != self.own and self.holds(r, tensor)), None)


def _assemble(step: _Step, name: str, mine: np.ndarray, saved: Shard | None, want: Shard | None,
              shape: tuple) -> np.ndarray:
    """The slice `want` (the whole tensor if None) of a tensor saved as `saved` (replicated if None), of which the
    checkpoint folder itself holds `mine`; `shape` is this run's local shape. Every check raises CheckpointError."""
    weights = step.path / WEIGHTS
    nd = len(shape)
    if saved is not None:
        problem = _shard_problem(saved, tuple(mine.shape))
        if problem:
            raise CheckpointError(f"{step.path / STATE}: shards of {name}: {problem}")
    saved_global = tuple(mine.shape) if saved is None else _with(tuple(mine.shape), saved.dim, saved.full)
    want_global = shape if want is None else _with(shape, want.dim, want.full)
    if saved_global != want_global and math.prod(saved_global) == math.prod(want_global) \
            and 1 in (len(saved_global), len(want_global)):
        return _reflattened(step, name, mine, saved, want, shape, saved_global, want_global)
    if saved_global != want_global:
        raise CheckpointError(f"{weights}: {name} has shape {saved_global}, this model expects {want_global}; it "
                              f"was written by a model of another shape")
    if saved is None:  # replicated: the folder's own copy holds every slice
        return mine if want is None else mine[(slice(None),) * want.dim
                                              + (slice(want.offset, want.offset + shape[want.dim]),)]
    ds = saved.dim
    lo, hi = (want.offset, want.offset + shape[ds]) if want is not None and want.dim == ds else (0, saved.full)
    pieces = []  # (offset, rank) of every rank's slice, checked to be slices of one tensor
    for r in range(step.world):
        theirs = step.layout(r, name).get(name)
        if theirs is None and not step.holds(r, name):
            continue                # a rank of another pipeline stage
        if theirs is None or theirs.dim != ds or theirs.full != saved.full:
            said = "replicated" if theirs is None else f"[dim {theirs.dim}, offset {theirs.offset}, full {theirs.full}]"
            raise CheckpointError(f"{step.folder(r) / STATE}: {name} is {said}, {step.path / STATE} has it sharded "
                                  f"[dim {ds}, offset {saved.offset}, full {saved.full}]; the ranks disagree")
        pieces.append((theirs.offset, r))
    used, at = [], lo  # (rank, begin, end) along ds: the fewest files, this folder's own first
    while at < hi:
        candidates = sorted((p for p in pieces if p[0] <= at), key=lambda p: (-p[0], p[1] != step.own, p[1]))
        for off, r in candidates:
            pieces.remove((off, r))
            arr = step.weights(r).get(name)
            w = step.folder(r) / WEIGHTS
            if arr is None:
                raise CheckpointError(f"{w}: has no tensor {name!r}, of which {step.folder(r) / STATE} says it holds "
                                      f"a slice")
            if (arr.ndim != nd or _with(tuple(arr.shape), ds, saved.full) != saved_global or arr.dtype != mine.dtype
                    or off + arr.shape[ds] > saved.full):
                raise CheckpointError(f"{w}: {name} is {arr.dtype} {tuple(arr.shape)} at offset {off} of dim {ds}, "
                                      f"not a slice of the {mine.dtype} {saved_global} that {weights} holds a part of")
            if off + arr.shape[ds] > at:
                end = min(hi, off + arr.shape[ds])
                used.append((r, at, end))
                at = end
                break
        else:
            gap_end = min([hi] + [p[0] for p in pieces if p[0] > at])
            raise CheckpointError(f"{step.root}: indices {at}..{gap_end} of dim {ds} of {name} are in none of the "
                                  f"{step.world} ranks' {step.name} checkpoints")
    out = np.empty(shape, mine.dtype)  # this run's local slice
    for r, begin, end in used:
        off = step.layouts[r][name].offset
        src = [slice(None)] * nd
        dst = [slice(None)] * nd
        src[ds], dst[ds] = slice(begin - off, end - off), slice(begin - lo, end - lo)
        if want is not None and want.dim != ds:
            src[want.dim] = slice(want.offset, want.offset + shape[want.dim])
        out[tuple(dst)] = step.weights(r)[name][tuple(src)]
    return out


def _reflattened(step: _Step, name: str, mine: np.ndarray, saved: Shard | None, want: Shard | None, shape: tuple,
                 saved_global: tuple, want_global: tuple) -> np.ndarray:
    """A tensor saved flat and wanted shaped, or the other way round (the distributed optimizer holds each rank's
    state as a flat slice of the parameter's elements; the replicated one holds it in the parameter's shape): the
    whole saved tensor assembled, flattened in C order, and cut or shaped as this run wants it."""
    whole = _assemble(step, name, mine, saved, None, saved_global).reshape(-1)
    if want is None:
        return whole.reshape(shape)
    if len(want_global) == 1:
        return whole[want.offset:want.offset + shape[0]]
    index = [slice(None)] * len(shape)
    index[want.dim] = slice(want.offset, want.offset + shape[want.dim])
    return whole.reshape(want_global)[tuple(index)]


def load_checkpoint(path: str | Path, params: list[Parameter], fields: dict | None = None,
                    shards: dict[str, Shard] | None = None) -> dict:
    """Load weights into `params` and return the state (without the layout fields that save_checkpoint added),
    which must have `fields` (as TRAINER_STATE describes them) if given. `shards` is this run's layout (names not
    among `params` are ignored): a parameter held as it was saved is read from `path`'s own file; one split another
    way now (or saved whole and now split, or the other way round) is assembled from the slices of the ranks that
    saved the step, `path`'s siblings `<root>/rank_<r>/<step>/`. Every parameter must be present with the same
    global shape; a missing rank folder or slice is a CheckpointError naming it and the tensor. Nothing is loaded
    unless everything checks."""
    path = Path(path)
    weights, state_file = path / WEIGHTS, path / STATE
    if not weights.is_file() or not state_file.is_file():
        raise CheckpointError(f"{path}: not a checkpoint folder (expected {WEIGHTS} and {STATE})")
    stored, _ = read_safetensors(weights)  # a torn or foreign file: CheckpointError naming it
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{state_file}: unreadable trainer state ({e.__class__.__name__})") from None
    world, saved_shards = _layout(state, state_file)
    shards = shards or {}
    for p in params:
        problem = _shard_problem(shards[p.name], tuple(p.shape)) if p.name in shards else None
        if problem:
            raise ValueError(f"load_checkpoint: shards[{p.name!r}]: {problem}")
    step = _Step(path, world, stored, saved_shards)
    loaded = {}
    for p in params:
        # a tensor of another pipeline stage (saved under another pipeline_stage) is in another rank's folder
        holder = step.own if p.name in stored else step.holder(p.name)
        if holder is None:
            raise CheckpointError(f"{weights}: has no tensor {p.name!r}; it was written by a different model")
        mine = step.weights(holder)[p.name] if holder != step.own else stored[p.name]
        saved = step.layout(holder, p.name).get(p.name) if holder != step.own else saved_shards.get(p.name)
        want, shape = shards.get(p.name), tuple(p.shape)
        # laid out as saved (a Shard does not say its local size: the shapes too), or replicated both times
        if saved is want is None or saved == want and tuple(mine.shape) == shape:
            if tuple(mine.shape) != shape:
                raise CheckpointError(f"{weights}: {p.name} has shape {tuple(mine.shape)}, this model "
                                      f"expects {shape}; it was written by a model of another shape")
            loaded[p.name] = mine
        else:
            loaded[p.name] = _assemble(step, p.name, mine, saved, want, shape)
    problem = _state_problem(state, fields or {})
    if problem:
        raise CheckpointError(f"{state_file}: not a trainer state ({problem})")
    for p in params:
        p.set_data(Tensor(np.array(loaded[p.name])).astype(p.dtype))  # a copy: the file is mapped read-only
    if isinstance(state, dict):
        state = {k: v for k, v in state.items() if k not in ("shards", "world")}
    return state
