"""Collect named tensors of a training step for a dump: sub-Cell outputs through forward hooks, gradients and
optimizer states by parameter name.

Forward hooks fire in PyNative mode (the alignment harness runs there); a Cell called several times in one step
(micro-batches) has its outputs concatenated along its batch axis, in call order, so a micro-batched run dumps
the same tensors as a plain one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from precision.dump import TensorRecord, to_numpy

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_of(name: str) -> int | None:
    """Decoder layer index in a parameter or Cell name ('layers.3.mlp' -> 3); None outside the layers."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Target:
    """What to record of one sub-Cell: which element of a tuple output, the operator name, axis letters (the
    first is the batch axis used to join micro-batches) and the accumulation count of its producer."""
    operator: str
    dims: str = ""
    output_index: int | None = None
    k: int | None = None


class ForwardCapture:
    """Context manager: hooks the named sub-Cells of `root`, records their outputs in first-call order."""

    def __init__(self, root, targets: Mapping[str, Target]):
        cells = dict(root.cells_and_names())
        missing = [name for name in targets if name not in cells]
        if missing:
            raise KeyError(f"capture target {missing[0]!r}: no such sub-Cell")
        self._cells = {name: cells[name] for name in targets}
        self.targets = dict(targets)
        self._outputs: dict[str, list[np.ndarray]] = {}
        self._handles = []

    def _hook(self, name: str):
        target = self.targets[name]

        def hook(cell, inputs, output):
            value = output if target.output_index is None else output[target.output_index]
            self._outputs.setdefault(name, []).append(to_numpy(value)[0].copy())
        return hook

    def __enter__(self) -> "ForwardCapture":
        self._handles = [cell.register_forward_hook(self._hook(name)) for name, cell in self._cells.items()]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def records(self) -> list[TensorRecord]:
        """Forward records in the order the Cells first ran."""
        out = []
        for name, parts in self._outputs.items():
            target = self.targets[name]
            value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            out.append(TensorRecord(name, "forward", value, layer_of(name), target.operator, target.k, target.dims))
        return out


def grad_records(names: Sequence[str], grads: Iterable) -> list[TensorRecord]:
    """Gradient records in parameter order (the comparison walks them backwards)."""
    return [TensorRecord(f"grad.{name}", "grad", g, layer_of(name), "grad") for name, g in zip(names, grads)]


def optimizer_records(states: Mapping[str, Sequence], names: Sequence[str]) -> list[TensorRecord]:
    """Optimizer records: `states` maps a state name ('param', 'exp_avg', ...) to values in parameter order."""
    return [TensorRecord(f"{state}.{name}", "optimizer", value, layer_of(name), state)
            for state, values in states.items() for name, value in zip(names, values)]
