"""safetensors files with NumPy: the one reader and writer of them in the application. The trainer's per-rank
checkpoints (`telechat_moe.checkpoint`) and transformers' checkpoint folders (`read_hf_dir` / `write_hf_dir`,
which the HF converter uses) both go through `read_safetensors` / `write_safetensors`.

- Reading memory-maps the file and checks its header (dtypes, shapes, offsets inside the file), so a torn or
  foreign file is a one-line `CheckpointError` naming it, never a crash later. NumPy has no bfloat16: BF16
  tensors come back as float32, which is exact (a bfloat16 is the top half of the float32 of the same value).
- Writing goes to `<path>.partial`, is flushed to disk and then renamed, so `path` is either the old file or the
  whole new one; a write that fails (a full disk) removes the `.partial` file and raises its OSError. Arrays keep
  their dtype unless a cast is asked for; a cast to bfloat16 rounds to nearest even (exact for values that came
  from bfloat16). MindSpore's bfloat16 arrays (`Parameter.asnumpy()`) are written as BF16 bit for bit.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Mapping

import numpy as np

from telechat_moe.errors import CheckpointError

ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
             "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32,
             "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}
ST_NAMES = {np.dtype(t): name for name, t in ST_DTYPES.items() if name != "BF16"}
CASTS = ("float32", "float16", "bfloat16")
HF_INDEX = "model.safetensors.index.json"


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Exact: a bfloat16 is the top half of the float32 with the same value."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even; exact for values that came from bfloat16. A NaN stays a (quiet) NaN."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return np.where(np.isnan(x), (bits >> 16) | 0x40, rounded).astype(np.uint16)


def _is_bf16(arr: np.ndarray) -> bool:
    """MindSpore's asnumpy() of a bfloat16 tensor: NumPy's 2-byte custom dtype named bfloat16."""
    return arr.dtype.name == "bfloat16" and arr.dtype.itemsize == 2


# ---- one file -----------------------------------------------------------------------------------------------
def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of one file, memory-mapped read-only; bfloat16 tensors are widened to float32."""
    path = os.fspath(path)

    def bad(reason: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a readable safetensors file ({reason})")

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            text = f.read(n) if 8 <= size and n <= size - 8 else None
    except OSError as exc:
        raise bad(exc.__class__.__name__) from None
    if text is None:
        raise bad(f"a header of {n} bytes in a file of {size}")
    try:
        header = json.loads(text)
    except ValueError as exc:  # UnicodeDecodeError included
        raise bad(exc.__class__.__name__) from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ is not a map of strings")
    data_len = size - 8 - n
    raw = np.memmap(path, np.uint8, "r", offset=8 + n) if data_len else np.zeros(0, np.uint8)
    out = {}
    for name, spec in header.items():
        try:
            dtype, shape = spec["dtype"], [int(d) for d in spec["shape"]]
            begin, end = (int(o) for o in spec["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise bad(f"{name}: no dtype / shape / data_offsets") from None
        if dtype not in ST_DTYPES:
            raise bad(f"{name} has dtype {dtype}, which is not read here")
        nbytes = math.prod(shape) * np.dtype(ST_DTYPES[dtype]).itemsize
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_len or end - begin != nbytes:
            raise bad(f"{name}: bytes {begin}..{end} of {data_len} do not hold shape {shape} of {dtype}; "
                      f"the file is truncated or corrupt")
        arr = raw[begin:end].view(ST_DTYPES[dtype]).reshape(shape)
        out[name] = bf16_bits_to_f32(arr) if dtype == "BF16" else arr
    return out, dict(meta)


def _encode(name: str, arr, dtype: str | None) -> tuple[str, np.ndarray]:
    """(safetensors dtype, contiguous array of the bytes to write) of one tensor, cast to `dtype` if floating."""
    arr = np.asarray(arr)
    bf16 = _is_bf16(arr)
    if dtype and (bf16 or arr.dtype.kind == "f"):
        if dtype == "bfloat16":
            return "BF16", np.asarray(arr.view(np.uint16) if bf16 else f32_to_bf16_bits(arr), order="C")
        arr = (bf16_bits_to_f32(arr.view(np.uint16)) if bf16 else arr).astype(dtype)
    elif bf16:
        return "BF16", np.asarray(arr.view(np.uint16), order="C")
    arr = np.asarray(arr, arr.dtype.newbyteorder("<"), order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
    if arr.dtype not in ST_NAMES:
        raise CheckpointError(f"{name}: dtype {arr.dtype} has no safetensors equivalent")
    return ST_NAMES[arr.dtype], arr


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None, dtype: str | None = None) -> None:
    """Write tensors (floating ones cast to 'float32' | 'float16' | 'bfloat16' if `dtype` says so) to `path`,
    atomically: a crash leaves the previous file or none, never a torn one."""
    if dtype is not None and dtype not in CASTS:
        raise CheckpointError(f"dtype={dtype!r}: expected one of {', '.join(CASTS)}")
    header, arrays, offset = {}, [], 0
    for name, arr in tensors.items():
        st, arr = _encode(name, arr, dtype)
        header[name] = {"dtype": st, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        arrays.append(arr)
        offset += arr.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path = os.fspath(path)
    tmp = path + ".partial"
    try:
        with open(tmp, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            for arr in arrays:
                f.write(arr.reshape(-1).view(np.uint8).data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a size limit, an interrupt: no .partial left behind
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


# ---- transformers' checkpoint folders -------------------------------------------------------------------------
def _read_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: expected {what} ({exc.__class__.__name__})") from None


def read_hf_dir(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json, state dict) of a transformers checkpoint folder: one model.safetensors or indexed shards."""
    path = os.fspath(path)
    config = _read_json(os.path.join(path, "config.json"), "a transformers config.json")
    index = os.path.join(path, HF_INDEX)
    if os.path.exists(index):
        weight_map = _read_json(index, "a safetensors index with a weight_map")
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map", {}), dict):
            raise CheckpointError(f"{index}: expected a safetensors index with a weight_map")
        shards = sorted(set(weight_map.get("weight_map", {}).values()))
    else:
        shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not shards:
        raise CheckpointError(f"{path}: no *.safetensors weights (PyTorch .bin checkpoints are not read)")
    state: dict[str, np.ndarray] = {}
    for shard in shards:
        state.update(read_safetensors(os.path.join(path, shard))[0])
    return config, state


def write_hf_dir(path: str | os.PathLike, config: Mapping, state: Mapping[str, np.ndarray], dtype: str = "float32",
                 max_shard_bytes: int = 5 * 2 ** 30) -> list[str]:
    """config.json + model.safetensors, or numbered shards with model.safetensors.index.json past max_shard_bytes."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    shards, current, size = [], {}, 0
    for name, arr in state.items():
        nbytes = arr.size * itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = arr
        size += nbytes
    shards.append(current)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        write_safetensors(os.path.join(path, name), shard, {"format": "pt"}, dtype)
    if len(shards) > 1:
        weight_map = {t: name for name, shard in zip(names, shards) for t in shard}
        total = sum(a.size * itemsize for a in state.values())
        with open(os.path.join(path, HF_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "torch_dtype": dtype}, f, indent=2)
    return names


def write_probe(folder: Path) -> None:
    """Create `folder` if needed and write, sync and remove a probe file in it; OSError where that fails."""
    probe = folder / f".probe_{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"0")
            f.flush()
            os.fsync(f.fileno())
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
