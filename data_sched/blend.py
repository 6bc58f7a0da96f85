"""Weighted blends of indexed datasets: which source each sample of the training order comes from.

`data.paths` names the sources: plain paths; Megatron's "0.3 a 0.7 b" (one string, or the same as a list); or a
list of {path, weight}. Weights are normalised to sum 1; without weights each source weighs its sample count.

The blend's order is fixed once, like Megatron-Core's BlendedDataset: position q of a blend epoch takes the next
sample of source dataset_index[q]. The positions are assigned by placing source j's k-th sample at (k + 1/2)/w_j
and merging the sources in that order, so every prefix of P positions holds w_j * P samples of source j, give or
take one: a short run sees the weights, not just a long one. Within a source the samples follow that source's own
shuffled epochs (`IndexedSamples.order`), continuing from one blend epoch to the next, so a small-weight source is
not stuck on the same subset. The blend epoch has the most positions for which no source repeats a sample:
min_j floor(len_j / w_j).

A blend's sample id is the source in the high bits and the source's sample below (`SOURCE_SHIFT`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data_sched.doc_lengths import DocLengths
from data_sched.errors import DataError
from data_sched.index_cache import cache_key, cached_arrays
from data_sched.indexed_samples import IndexedSamples

SOURCE_SHIFT = 40


def _weight(value, where: str) -> float:
    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise DataError(f"data.paths: expected a weight before {where}, got {value!r}") from None
    if not np.isfinite(weight) or weight <= 0:
        raise DataError(f"data.paths: the weight of {where} must be a positive number, got {value!r}")
    return weight


def _is_number(value) -> bool:
    try:
        float(value)
        return not isinstance(value, bool)
    except (TypeError, ValueError):
        return False


def parse_paths(paths) -> list[tuple[str, float | None]]:
    """(path, weight or None) of each source in `data.paths`; one-line DataError naming data.paths otherwise."""
    if isinstance(paths, str):
        paths = paths.split()
    if not isinstance(paths, (list, tuple)):
        raise DataError(f"data.paths: expected a list of paths, \"w1 path1 w2 path2\" or a list of "
                        f"{{path, weight}}, got {paths!r}")
    if paths and all(isinstance(x, dict) for x in paths):
        out = []
        for x in paths:
            if set(x) - {"path", "weight"} or not isinstance(x.get("path"), str):
                raise DataError(f"data.paths: expected {{path, weight}} entries, got {x!r}")
            out.append((x["path"], _weight(x["weight"], x["path"]) if "weight" in x else None))
        if len({w is None for _, w in out}) > 1:
            raise DataError("data.paths: give every source a weight, or none")
        return out
    if paths and _is_number(paths[0]):
        if len(paths) % 2 or not all(isinstance(p, str) for p in paths[1::2]):
            raise DataError(f"data.paths: expected weight/path pairs (\"0.3 a 0.7 b\"), got {paths!r}")
        return [(p, _weight(w, p)) for w, p in zip(paths[::2], paths[1::2])]
    if not all(isinstance(p, str) for p in paths):
        raise DataError(f"data.paths: expected a list of file paths, got {paths!r}")
    return [(p, None) for p in paths]


def blend_positions(counts: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, the source's running sample number) of each position: source j's k-th sample sits at
    (k + 1/2)/w_j, merged in that order (ties to the lower source)."""
    source = np.repeat(np.arange(len(counts)), counts)
    number = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    order = np.argsort((number + 0.5) / np.asarray(weights)[source], kind="stable")
    return source[order].astype(np.int16), number[order]


@dataclass(frozen=True)
class BlendedSamples:
    """Sources mixed by weight (the sample-set members of `packing.PackedSamples`)."""
    sources: tuple[IndexedSamples, ...]
    weights: np.ndarray              # float64 [S], sum 1
    per_epoch: np.ndarray            # int64 [S]: samples of each source in one blend epoch
    dataset_index: np.ndarray        # int16 [N], memory-mapped
    dataset_sample_index: np.ndarray  # int64 [N], memory-mapped

    @property
    def seq_length(self) -> int:
        return self.sources[0].seq_length

    @property
    def source_names(self) -> tuple[str, ...]:
        names = tuple(s.source_names[0] for s in self.sources)
        return names if len(set(names)) == len(names) else tuple(s.dataset.prefix for s in self.sources)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def ids_at(self, seed: int, epoch: int, lo: int, hi: int) -> np.ndarray:
        source = np.asarray(self.dataset_index[lo:hi], dtype=np.int64)
        number = epoch * self.per_epoch[source] + self.dataset_sample_index[lo:hi]
        out = np.empty(len(source), dtype=np.int64)
        for j in np.unique(source).tolist():
            size = len(self.sources[j])
            at = np.flatnonzero(source == j)
            source_epoch, pos = np.divmod(number[at], size)
            for e in np.unique(source_epoch).tolist():
                sel = source_epoch == e
                out[at[sel]] = (j << SOURCE_SHIFT) | self.sources[j].order(seed, e)[pos[sel]]
        return out

    def _by_source(self, ids: np.ndarray):
        ids = np.asarray(ids, dtype=np.int64)
        source, local = ids >> SOURCE_SHIFT, ids & ((1 << SOURCE_SHIFT) - 1)
        for j in np.unique(source).tolist():
            at = np.flatnonzero(source == j)
            yield self.sources[j], at, local[at]

    def take(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty((len(ids), self.seq_length + 1), dtype=np.int32)
        for source, at, local in self._by_source(ids):
            out[at] = source.take(local)
        return out

    def doc_lengths(self, ids: np.ndarray) -> DocLengths:
        per_sample: list = [None] * len(ids)
        for source, at, local in self._by_source(ids):
            found = source.doc_lengths(local)
            for j, row in enumerate(at.tolist()):
                per_sample[row] = found.sample(j)
        return DocLengths.of(per_sample)

    def source_of(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(ids, dtype=np.int64) >> SOURCE_SHIFT


def blend(sources: list[IndexedSamples], weights: list[float | None]) -> BlendedSamples:
    """The blend of `sources` (None weights: each source's sample count), its index cached beside the first's."""
    sizes = np.array([len(s) for s in sources], dtype=np.int64)
    w = sizes.astype(np.float64) if weights[0] is None else np.array(weights, dtype=np.float64)
    if (sizes == 0).any():
        empty = sources[int(np.argmin(sizes))]
        raise DataError(f"{empty.dataset.prefix}: too small for one sample of seq_length={empty.seq_length}")
    w = w / w.sum()
    total = int(np.min(np.floor(sizes / w)))
    per_epoch = np.floor(w * total).astype(np.int64)
    # the positions floor() left over go to the sources furthest below their share, so the counts sum to total
    per_epoch[np.argsort(per_epoch - w * total, kind="stable")[:total - int(per_epoch.sum())]] += 1
    key = cache_key(sources=[f"{s.key}_{s.split}" for s in sources], weights=w.tolist(), total=total)
    arrays = cached_arrays(sources[0].folder, f"blend_{key}", ("dataset_index", "dataset_sample_index"),
                           lambda: dict(zip(("dataset_index", "dataset_sample_index"),
                                            blend_positions(per_epoch, w))))
    return BlendedSamples(tuple(sources), w, per_epoch, arrays["dataset_index"], arrays["dataset_sample_index"])
