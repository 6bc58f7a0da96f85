"""The document lengths of a global batch's samples as one flat array (`DocLengths`), the packed dataset's own
layout, and the two index helpers the balancer and the datasets share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


def _segment_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start, start+length) over segments, without a Python loop."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - ends + lengths, lengths) + np.arange(int(ends[-1]) if len(ends) else 0)


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)])


@dataclass(frozen=True)
class DocLengths:
    """The document lengths of a global batch's samples, flat: sample j's are lengths[offsets[j]:offsets[j+1]].
    The balancer also takes a list of per-sample arrays; this is the packed dataset's own layout, which spares
    building and concatenating a thousand small arrays per batch."""
    lengths: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, batch: "Sequence[np.ndarray] | DocLengths") -> "DocLengths":
        if isinstance(batch, DocLengths):
            return batch
        counts = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch))
        return cls(np.concatenate(batch), _offsets(counts))

    @classmethod
    def take(cls, lengths: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> "DocLengths":
        """Samples `rows` of a packed dataset whose sample j has documents lengths[offsets[j]:offsets[j+1]]."""
        counts = offsets[rows + 1] - offsets[rows]
        return cls(lengths[_segment_positions(offsets[rows], counts)], _offsets(counts))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample(self, j: int) -> np.ndarray:
        return self.lengths[self.offsets[j]:self.offsets[j + 1]]
