"""Deterministic, resumable batches of packed samples, split over data-parallel ranks.

The samples are any sample set (`packing.PackedSamples` in memory, `indexed_samples.IndexedSamples` memory-mapped,
`blend.BlendedSamples`): epoch e visits them in the order the set gives for (seed, e), a seeded permutation or a
blend's fixed mix; global batch k of that epoch is positions k*G..(k+1)*G of it (the incomplete last batch is
dropped) and DP rank r takes the r-th of dp_size equal, contiguous shares, reading only those samples' tokens.
The position is (epoch, index of the next global batch): restoring it continues with exactly that batch. The
global order depends on the seed, the global batch size and the data, never on data_parallel, so a run resumed
with another data_parallel (same global_batch_size) trains the same global batches; only their split over ranks
changes.

With attention balancing on, every rank computes the same assignment of the global batch to (rank, micro-batch)
slots (`balance_global_batch`, pure and seeded by (seed, epoch, index)) and takes its share; micro-batch m of a
rank is rows m*mbs:(m+1)*mbs of its share, so the trainer splits the local batch into consecutive micro-batches.
`context_loss` is the share of the tokens of the batch at the loader's position (the one being trained) that
repack's cuts left without their earlier context, for the training log.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from data_sched.attention_balance import balance_global_batch, check_balance_mode, check_context_loss
from data_sched.attention_cost import CostModel
from data_sched.errors import DataError
from data_sched.packing import doc_lens_to_segment_ids

# Without a calibration the plan is made and priced with the attention term alone. With fixed-length samples the
# token and sample terms add the same to every slot: a calibrated model changes the predicted times and how close
# to even is close enough (the tolerances are shares of a slot's whole cost), not what balancing aims at.
ATTENTION_ONLY = CostModel(a=1.0, b=0.0, c=0.0, source="attention term only")

COLUMNS = ("input_ids", "labels", "segment_ids")


def holdout_mask(num_docs: int, fraction: float, seed: int) -> np.ndarray:
    """bool [num_docs]: a seeded random `fraction` of the documents (at least one when fraction > 0) is held out."""
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"data.eval_fraction: expected a number in [0, 1), got {fraction}")
    n_held = int(round(fraction * num_docs))
    if fraction > 0:
        n_held = max(1, n_held)
    if n_held >= num_docs:
        raise DataError(f"data.eval_fraction={fraction}: {num_docs} document(s) leave nothing to train on")
    held = np.zeros(num_docs, dtype=bool)
    held[np.random.default_rng([seed, 0x401D]).permutation(num_docs)[:n_held]] = True
    return held


def split_holdout(docs: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, held_out) by `holdout_mask`; both keep corpus order."""
    held = holdout_mask(len(docs), fraction, seed)
    return [d for d, h in zip(docs, held) if not h], [d for d, h in zip(docs, held) if h]


class BatchLoader:
    """This DP rank's share of each global batch: {input_ids, labels, segment_ids}, int32 [G/dp, seq_length]."""

    def __init__(self, samples, global_batch_size: int, seed: int, dp_rank: int = 0,
                 dp_size: int = 1, micro_batch_num: int = 1, attention_balance: str = "off",
                 cost_model: CostModel | None = None, max_context_loss: float = 1.0, context_parallel: int = 1):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(f"parallel_config.data_parallel: rank {dp_rank} is not in [0, {dp_size})")
        if global_batch_size < 1 or global_batch_size % dp_size:
            raise DataError(f"global_batch_size: expected a positive multiple of data_parallel={dp_size}, "
                            f"got {global_batch_size}")
        check_balance_mode(attention_balance)
        check_context_loss(max_context_loss)
        if micro_batch_num < 1 or global_batch_size % (dp_size * micro_batch_num):
            raise DataError(f"global_batch_size: expected a multiple of data_parallel x micro_batch_num = "
                            f"{dp_size} x {micro_batch_num}, got {global_batch_size}")
        if len(samples) < global_batch_size:
            raise DataError(f"corpus too small: {len(samples)} packed samples of seq_length={samples.seq_length}"
                            f" cannot fill one global batch of {global_batch_size}")
        self.samples = samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro_batch_num = micro_batch_num
        self.attention_balance = attention_balance
        self.cost_model = cost_model or ATTENTION_ONLY
        self.max_context_loss = max_context_loss
        self.context_parallel = context_parallel       # the split whose slowest rank prices a sample (balancing)
        self.local_batch_size = global_batch_size // dp_size
        self.batches_per_epoch = len(samples) // global_batch_size
        self.epoch = 0
        self.index = 0
        self._context_loss: dict[tuple[int, int], float] = {}   # of the batches made, by (epoch, index)

    def global_batch_indices(self, epoch: int, index: int) -> np.ndarray:
        """Sample ids of global batch `index` of `epoch`, in DP-rank order."""
        g = self.global_batch_size
        return self.samples.ids_at(self.seed, epoch, index * g, (index + 1) * g)

    def source_shares(self, epoch: int, index: int) -> dict[str, float]:
        """Each source's share of the samples of a global batch (one source: {name: 1.0})."""
        counts = np.bincount(self.samples.source_of(self.global_batch_indices(epoch, index)),
                             minlength=len(self.samples.source_names))
        return {name: float(c) / self.global_batch_size for name, c in zip(self.samples.source_names, counts)}

    def assignment_at(self, epoch: int, index: int):
        """The balanced layout of a global batch (None when balancing is off); the same on every rank."""
        if self.attention_balance == "off":
            return None
        rows = self.global_batch_indices(epoch, index)
        return balance_global_batch(self.samples.doc_lengths(rows), self.attention_balance,
                                    self.dp_size, self.micro_batch_num, self.cost_model,
                                    seed=int(np.random.default_rng([self.seed, epoch, index]).integers(2**31)),
                                    max_context_loss=self.max_context_loss, cp=self.context_parallel)

    @property
    def context_loss(self) -> float:
        """Share of the tokens of the batch at the current position (the next to train, or the one in training
        until `advance`) that lost their earlier context to repack's cuts; 0 unless repacking. Kept from when the
        batch was made (a prefetching pipeline makes it ahead), else planned again."""
        if self.attention_balance != "repack":
            return 0.0
        at = (self.epoch, self.index)
        for key in [k for k in list(self._context_loss) if k < at]:
            self._context_loss.pop(key, None)
        if at not in self._context_loss:
            self._context_loss[at] = self.assignment_at(*at).context_loss
        return self._context_loss[at]

    def _own(self) -> slice:
        return slice(self.dp_rank * self.local_batch_size, (self.dp_rank + 1) * self.local_batch_size)

    def samples_read(self, epoch: int, index: int) -> np.ndarray:
        """Ids of the samples of a global batch whose tokens this rank reads: its share; with balancing, the
        samples its slots take pieces of."""
        rows, plan = self.global_batch_indices(epoch, index), self.assignment_at(epoch, index)
        if plan is None:
            return rows[self._own()]
        return rows[np.unique(plan.pieces(self._own().start, self._own().stop)[0])]

    def batch_at(self, epoch: int, index: int) -> dict[str, np.ndarray]:
        rows = self.global_batch_indices(epoch, index)
        lo, hi = self._own().start, self._own().stop
        seq = self.samples.seq_length
        plan = self.assignment_at(epoch, index)
        if plan is None:
            tokens = self.samples.take(rows[lo:hi])
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            found = self.samples.doc_lengths(rows[lo:hi])
            lens = [found.sample(j) for j in range(len(found))]
        else:
            # only the global batch's samples this rank's micro-batches take pieces of are read
            tokens = np.zeros((len(rows), seq + 1), dtype=np.int32)
            needed = np.unique(plan.pieces(lo, hi)[0])
            tokens[needed] = self.samples.take(rows[needed])
            inputs, labels = plan.apply(tokens, lo, hi)
            lens = np.split(plan.pieces(lo, hi)[2], np.cumsum(plan.counts[lo:hi].sum(axis=1))[:-1])
            if len(self._context_loss) < 64:
                self._context_loss[(epoch, index)] = plan.context_loss
        segments = np.stack([doc_lens_to_segment_ids(x, seq) for x in lens])
        return {"input_ids": np.ascontiguousarray(inputs), "labels": np.ascontiguousarray(labels),
                "segment_ids": segments}

    def advance(self, num_batches: int = 1) -> None:
        """Move the position by `num_batches` global batches (what the trainer consumed)."""
        pos = self.epoch * self.batches_per_epoch + self.index + num_batches
        self.epoch, self.index = divmod(pos, self.batches_per_epoch)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.epoch, self.index)
        self.advance(1)
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "global_batch_size": self.global_batch_size, "num_samples": len(self.samples)}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("seed", self.seed), ("global_batch_size", self.global_batch_size),
                          ("num_samples", len(self.samples))):
            if key in state and int(state[key]) != mine:
                raise DataError(f"data state: checkpoint has {key}={state[key]}, this run has {mine}; "
                                f"the data position cannot be resumed")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self.batches_per_epoch:
            raise DataError(f"data state: position (epoch={epoch}, index={index}) is outside "
                            f"{self.batches_per_epoch} batches per epoch")
        self.epoch, self.index = epoch, index

    def as_mindspore_dataset(self, num_batches: int):
        """A GeneratorDataset of the next `num_batches` batches from the current position.

        The pipeline prefetches, so it reads from a snapshot of the position and never moves this loader: the
        trainer calls `advance(1)` per step it trains, which keeps `state_dict()` at the next batch to train.
        """
        import mindspore.dataset as ds

        return ds.GeneratorDataset(_Snapshot(self, num_batches), column_names=list(COLUMNS), shuffle=False,
                                   python_multiprocessing=False)


class _Snapshot:
    """Iterable over `count` batches starting at the loader's position when created."""

    def __init__(self, loader: BatchLoader, count: int):
        self.loader, self.count = loader, count
        self.start = loader.epoch * loader.batches_per_epoch + loader.index

    def __iter__(self):
        per_epoch = self.loader.batches_per_epoch
        for pos in range(self.start, self.start + self.count):
            batch = self.loader.batch_at(*divmod(pos, per_epoch))
            yield tuple(batch[c] for c in COLUMNS)
