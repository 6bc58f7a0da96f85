"""Enumerate the layout space as NumPy arrays, prune what cannot exist, score the rest in one vectorised pass.

Dimensions: tp, cp, pp, vpp, ep, etp, micro-batch size, recompute, EP scheme, EP overlap; dp follows from the device
count and the number of micro-batches from the global batch. A layout is dropped before scoring when it cannot
exist (the rules of parallel.layout, evaluated on the arrays: divisibility, micro-batch counts, heads and GQA's KV
heads, experts (a dense model has none: ep = etp = 1), layers, tensor parallelism within a node), lies outside the
space searched (expert TP wider than the dense TP) or is a duplicate (an EP scheme or overlap without EP, a
hierarchical scheme inside one node). A layout the trainer does not run (parallel.planner.trainable, the predicate
`check_trainable` asks) is dropped too, so that every layout the planner proposes trains.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from parallel.layout import (EP_SCHEMES, RECOMPUTE, experts_fold_over_dense, experts_split, fills_world,
                             global_batch_splits, heads_split, interleave_fills_stages, interleave_has_stages,
                             kv_heads_split, layers_fill_chunks, micro_batches_fill_stages, tp_within_node)
from parallel.planner.cost_model import evaluate
from parallel.planner.trainable import trainable
from parallel.planner import trainable as trainable_module
from parallel.planner.workload import Layouts, Workload


@dataclass(frozen=True)
class SearchSpace:
    tp: tuple[int, ...] = (1, 2, 4, 8, 16)
    # context parallelism, tried where each rank keeps at least CP_MIN_POSITIONS positions of a sequence
    cp: tuple[int, ...] = (1, 2, 4, 8)
    vpp: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    etp: tuple[int, ...] = (1, 2, 4, 8)
    mbs: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[str, ...] = RECOMPUTE
    ep_scheme: tuple[str, ...] = ("flat", "hierarchical")  # what the runtime implements; node_dedup on request
    ep_overlap: tuple[bool, ...] = (False, True)
    pp: tuple[int, ...] | None = None  # None: every divisor of the device count
    ep: tuple[int, ...] | None = None  # None: every divisor of the routed-expert count (1 for a dense model)


# Below this many positions per rank a context-parallel split only adds its gather (the activations of a sequence
# this short fit beside tp and recompute); so 4K-sequence recipes search what they did, and 32K ones up to cp=8.
CP_MIN_POSITIONS = 4096


def divisors(n: int) -> np.ndarray:
    small = np.arange(1, int(np.sqrt(n)) + 1)
    small = small[n % small == 0]
    return np.unique(np.concatenate([small, n // small]))


def enumerate_layouts(w: Workload, space: SearchSpace = SearchSpace()) -> tuple[Layouts, int]:
    """(all valid, distinct layouts; size of the raw product before pruning)."""
    s, n = w.shape, w.devices
    pp_values = np.array(space.pp) if space.pp else divisors(n)
    ep_values = np.array(space.ep) if space.ep else divisors(s.num_routed_experts or 1)
    axes = [np.array(space.tp), pp_values, np.array(space.vpp), ep_values, np.array(space.etp),
            np.array(space.mbs), np.array([RECOMPUTE.index(r) for r in space.recompute]),
            np.array([EP_SCHEMES.index(e) for e in space.ep_scheme]), np.array([int(o) for o in space.ep_overlap])]
    cp_values = np.array([c for c in space.cp if c > 1 and w.seq_length // c >= CP_MIN_POSITIONS], dtype=np.int64)
    # cp > 1 is enumerated only over the pipeline depths it trains at (the raw product stays what it was at cp = 1)
    cp_pp = pp_values if trainable_module.CONTEXT_PARALLEL_WITH_PIPELINE else pp_values[pp_values == 1]
    blocks = [(axes, np.array([1] if 1 in space.cp else [], dtype=np.int64)), ([axes[0], cp_pp] + axes[2:], cp_values)]
    tp, pp, vpp, ep, etp, mbs, rc, scheme, overlap, cp = (np.concatenate(parts) for parts in zip(*(
        [g.ravel() for g in np.meshgrid(*block, cps, indexing="ij", sparse=False)] for block, cps in blocks)))
    raw = tp.size
    dp = n // (tp * cp * pp)
    ok = fills_world(dp, tp, cp, pp, n) & tp_within_node(tp, w.cluster.devices_per_node) & heads_split(s, tp)
    ok &= kv_heads_split(s, tp)
    dp = np.where(ok, dp, 1)
    ok &= experts_fold_over_dense(dp, cp, tp, ep, etp) & experts_split(s, ep, etp)
    ok &= etp <= tp  # the space searched: expert TP within the dense TP group
    ok &= global_batch_splits(w.global_batch, dp, mbs)
    m = w.global_batch // (dp * mbs)
    ok &= micro_batches_fill_stages(pp, m) & interleave_has_stages(pp, vpp) & interleave_fills_stages(pp, vpp, m)
    ok &= layers_fill_chunks(s, pp, vpp)
    # the default schedule of each layout (1f1b, interleaved); refine adds another only where the trainer runs it
    ok &= trainable(s, w.seq_length, tp, pp, ep, etp, cp, sp=tp > 1, ep_scheme=np.array(EP_SCHEMES)[scheme],
                    schedule=np.where(vpp > 1, "interleaved", "1f1b"))
    # duplicates: EP options that change nothing
    ok &= (ep > 1) | ((scheme == 0) & (overlap == 0))
    ok &= (scheme == 0) | (ep * etp > w.cluster.devices_per_node)
    keep = np.flatnonzero(ok)
    lay = Layouts(tp=tp[keep], pp=pp[keep], vpp=vpp[keep], dp=dp[keep], ep=ep[keep], etp=etp[keep],
                  mbs=mbs[keep], m=m[keep], recompute=rc[keep], ep_scheme=scheme[keep], ep_overlap=overlap[keep],
                  devices_per_node=np.full(keep.size, w.cluster.devices_per_node), cp=cp[keep])
    return lay, raw


@dataclass
class SearchResult:
    layouts: Layouts
    scores: dict[str, np.ndarray]
    raw_size: int
    seconds: float

    @property
    def scored(self) -> int:
        return len(self.layouts)

    def ranked(self, feasible_only: bool = True) -> np.ndarray:
        """Indices by predicted step time, fitting layouts only unless asked otherwise."""
        order = np.argsort(self.scores["step_time"], kind="stable")
        return order[self.scores["fits"][order]] if feasible_only else order


def search(w: Workload, space: SearchSpace = SearchSpace(), chunk: int = 262_144, progress=None) -> SearchResult:
    """Score every valid layout (in chunks, to bound memory); `progress(done, total)` is called per chunk."""
    t0 = time.perf_counter()
    lay, raw = enumerate_layouts(w, space)
    parts: list[dict[str, np.ndarray]] = []
    for start in range(0, len(lay), chunk):
        parts.append(evaluate(w, lay.take(slice(start, start + chunk))))
        if progress:
            progress(min(start + chunk, len(lay)), len(lay))
    parts = parts or [evaluate(w, lay)]  # no layout: empty arrays of the right kinds
    scores = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return SearchResult(lay, scores, raw, time.perf_counter() - t0)
