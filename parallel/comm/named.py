"""Named arrays of different names and shapes on each member of a group, put together on every member: for what
one rank cannot size in advance, such as the tensors of another pipeline stage in a tensor dump.

Collectives move tensors of shapes every member knows, so it takes three all-gathers of the transport: each
member's description length, the descriptions (names, shapes and dtypes as UTF-8 JSON, one byte per float32, padded
to the longest), then the values (flattened into one float32 buffer, padded to the longest). Values travel as
float32 and come back in their own dtype: exact for float32, float16 and the integers a dump holds.
"""
from __future__ import annotations

import json
from typing import Mapping

import numpy as np


def _gather_padded(transport, flat: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    """Every member's 1-D float32 `flat` (member j's of lengths[j]), by an all-gather of equal-sized buffers."""
    from mindspore import Tensor
    width = max(max(lengths), 1)
    buffer = np.zeros(width, np.float32)
    buffer[:flat.size] = flat
    gathered = transport.all_gather(Tensor(buffer)).asnumpy().reshape(len(lengths), width)
    return [gathered[j, :n] for j, n in enumerate(lengths)]


def all_gather_named(transport, arrays: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Member j's arrays, for every member j of the transport's group, in group order (every member calls it)."""
    from mindspore import Tensor
    arrays = {name: np.asarray(value) for name, value in arrays.items()}
    description = json.dumps([[name, list(a.shape), str(a.dtype)] for name, a in arrays.items()]).encode()
    lengths = [int(n) for n in transport.all_gather(Tensor(np.array([len(description)], np.float32))).asnumpy()]
    texts = _gather_padded(transport, np.frombuffer(description, np.uint8).astype(np.float32), lengths)
    described = [json.loads(bytes(t.astype(np.uint8)).decode()) for t in texts]
    values = np.concatenate([a.astype(np.float32).ravel() for a in arrays.values()]) if arrays \
        else np.zeros(0, np.float32)
    flats = _gather_padded(transport, values, [sum(int(np.prod(shape)) for _, shape, _ in d) for d in described])
    members = []
    for flat, entries in zip(flats, described):
        out, at = {}, 0
        for name, shape, dtype in entries:
            n = int(np.prod(shape))
            out[name] = flat[at:at + n].reshape(shape).astype(dtype)
            at += n
        members.append(out)
    return members
