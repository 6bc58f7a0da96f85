"""Dynamic expert placement (issue 17), pure NumPy: load statistics, a load predictor, a two-level placement planner
with replicas of hot experts, and the migration trigger that weighs the predicted gain against the cost of moving
weights and Adam moments. The trainer side (collecting the counts, moving the tensors over the EP group, the
router's expert -> slot map) is built on these objects and is not here.

Model. An MoE layer's E routed experts live in `slots_per_device` (S) slots on each of D devices (slots fixed by
memory, D*S >= E); nodes are runs of `devices_per_node` consecutive devices. An expert may have several copies
(replicas) on distinct devices; the tokens routed to it split evenly between its copies, so a device's load is
sum over its slots of load[e] / copies[e]. The slowest device sets the layer's pace: the planner minimises the
most loaded device (max/mean is reported; mean = total / D).

    window = LoadWindow(num_layers, num_experts, window=50)   # per step: window.append(global_counts[L, E])
    predictor = LoadPredictor()                               # per completed window: predictor.observe(window.total())
    placement = plan_placement(load, D, S, devices_per_node, replicas=True)
    migration = plan_migration(current, predictor.predict()[layer], cost=MoveCost.from_cluster("ascend910b", P),
                               seconds_per_token=t)
    if migration.accepted: apply migration.moves (all at once), then use migration.placement.expert_to_slots()

Planner (`plan_placement`): replica counts first (spare slots go one at a time to the expert whose per-copy load is
largest while that piece exceeds `split_above` x the mean device load); then nodes: the copies, largest first, onto
the least loaded node with room (at most devices_per_node copies of one expert per node; a copy heavier than the
mean device load takes a whole device's slots there, so its device can hold it alone), refined by moves and
pairwise swaps between the most loaded node and any other that lower it; then, inside each node separately, the
same greedy and refinement over its devices (at most one copy of an expert per device), which never moves a copy
to another node; last (`cross_node`, on by default) moves and swaps between devices of different nodes wherever
they still lower the most loaded device (a node whose slots are full may hold copies that its devices cannot
balance). Refinements stop within `tol` (0.2%) of the lower bound max(mean, heaviest copy).

Migration (`plan_migration`): candidates priced with `MoveCost` (bytes over the intra- or inter-node link of each
device, the links run concurrently) against the predicted gain (the most loaded device's drop over the next window
times the expert time per token), with a threshold per level:
  intra  - every copy stays on its node, only intra-node moves: the current copies refined by moves and swaps
           inside their nodes, or each node's copies re-planned over its devices;
  inter  - any move: a fresh two-level plan (replicas re-chosen), or the current copies with the fresh plan's
           replica counts (surplus copies dropped, new ones added where there is room) refined over all devices.
A fresh plan is matched to the current one before it is priced (nodes, then each node's devices, by an assignment
that keeps the most copies where they are; a copy that stays on its device keeps its slot). A refined candidate is
cut at its first step whose net gain is within half a margin of its best step's, and among the accepted candidates
(gain > level threshold x cost) net gains within the margin (1% of the mean device load's time) count as equal
and the fewest moves win: a placement that barely changes moves little (two experts whose loads trade places are
swapped back, nothing else).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["LoadWindow", "LoadPredictor", "Placement", "plan_placement", "greedy_placement", "replica_counts",
           "load_bound", "MoveCost", "Migration", "plan_migration", "align_placement", "migration_moves",
           "expert_flops_per_token"]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def _load_vector(load, num_experts: int | None = None, name: str = "load") -> np.ndarray:
    v = np.asarray(load, np.float64)
    if v.ndim != 1 or (num_experts is not None and v.shape[0] != num_experts):
        want = f"[{num_experts}]" if num_experts is not None else "[num_experts]"
        raise ValueError(f"{name}: expected a vector {want} of tokens per expert, got shape {v.shape}")
    if not np.all(np.isfinite(v)) or np.any(v < 0):
        raise ValueError(f"{name}: token counts must be finite and non-negative")
    return v


# ---- load statistics ------------------------------------------------------------------------------------------
class LoadWindow:
    """Per layer, per expert token counts of the last `window` steps (a ring buffer). The trainer appends the GLOBAL
    counts of each step (summed over ranks already); `append` says when a window of steps has been completed."""

    def __init__(self, num_layers: int, num_experts: int, window: int):
        self.num_layers = _positive_int("LoadWindow.num_layers", num_layers)
        self.num_experts = _positive_int("LoadWindow.num_experts", num_experts)
        self.window = _positive_int("LoadWindow.window", window)
        self._counts = np.zeros((self.window, self.num_layers, self.num_experts), np.float64)
        self._steps = np.zeros(self.window, np.int64)
        self.appended = 0

    def append(self, counts, step: int | None = None) -> bool:
        """counts [num_layers, num_experts] (or [num_experts] for one layer) of one step -> True when this step
        completes a window (every `window`-th append)."""
        c = np.asarray(counts, np.float64)
        if c.ndim == 1 and self.num_layers == 1:
            c = c[None]
        if c.shape != (self.num_layers, self.num_experts):
            raise ValueError(f"LoadWindow.append: expected counts of shape ({self.num_layers}, {self.num_experts}), "
                             f"got {c.shape}")
        if not np.all(np.isfinite(c)) or np.any(c < 0):
            raise ValueError("LoadWindow.append: token counts must be finite and non-negative")
        i = self.appended % self.window
        self._counts[i] = c
        self._steps[i] = self.appended if step is None else int(step)
        self.appended += 1
        return self.appended % self.window == 0

    @property
    def size(self) -> int:
        return min(self.appended, self.window)

    @property
    def full(self) -> bool:
        return self.appended >= self.window

    def _order(self) -> np.ndarray:
        n = self.size
        start = self.appended - n
        return (start + np.arange(n)) % self.window

    def counts(self, layer: int | None = None) -> np.ndarray:
        """The kept steps, oldest first: [steps, layers, experts], or [steps, experts] of one layer."""
        c = self._counts[self._order()]
        return c if layer is None else c[:, self._layer(layer)]

    def steps(self) -> np.ndarray:
        return self._steps[self._order()].copy()

    def total(self) -> np.ndarray:
        """[layers, experts] tokens over the kept steps (the load of a window, as the predictor takes it)."""
        return self.counts().sum(0)

    def mean(self) -> np.ndarray:
        """[layers, experts] tokens per step over the kept steps."""
        if self.size == 0:
            raise ValueError("LoadWindow.mean: no step appended yet")
        return self.total() / self.size

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ValueError(f"LoadWindow: layer must be in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    def heatmap_png(self, path: str | Path, layer: int, *, title: str | None = None) -> Path:
        """An expert x step heatmap of one layer's token counts over the kept steps (each step's column as its
        share of that step's tokens, times the number of experts: 1 = the uniform share)."""
        layer = self._layer(layer)
        if self.size == 0:
            raise ValueError("LoadWindow.heatmap_png: no step appended yet")
        try:
            import matplotlib
        except ImportError:
            raise RuntimeError("LoadWindow.heatmap_png needs matplotlib, which is not installed") from None
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        c = self.counts(layer)                                        # [steps, experts]
        per_step = c.sum(1, keepdims=True)
        rel = np.divide(c * self.num_experts, per_step, out=np.zeros_like(c), where=per_step > 0)
        steps = self.steps()
        fig, ax = plt.subplots(figsize=(min(16.0, 4 + 0.08 * len(steps)), min(12.0, 2.5 + 0.03 * self.num_experts)))
        im = ax.imshow(rel.T, aspect="auto", origin="lower", interpolation="nearest", cmap="magma",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, self.num_experts - 0.5))
        fig.colorbar(im, ax=ax, label="load / uniform share")
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
        ax.set_title(title or f"MoE layer {layer}: expert load over {len(steps)} steps "
                              f"(hottest {rel.max():.2f}x the uniform share)")
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


# ---- predictor --------------------------------------------------------------------------------------------------
class LoadPredictor:
    """The next window's load per expert from the windows seen so far: Holt's exponential smoothing with a trend,
    elementwise over any shape ([experts] or [layers, experts]). Level l and trend b after observation y:
        l' = alpha * y + (1 - alpha) * (l + b),   b' = beta * (l' - l) + (1 - beta) * b,   forecast = max(l' + b', 0)
    started from l = y1, b = 0, and b = y2 - y1 at the second window (so a linear trend is forecast exactly from
    the third window on; beta = 0: no trend, b stays 0). `error()`: relative error of the last forecast against
    the window that came. Defaults from bench/expert_placement.py's traces: a fixed skewed load (where sampling
    noise is all there is to miss, and the last window alone does as well) and a fast drift (where a trend
    follows best)."""

    def __init__(self, alpha: float = 0.8, beta: float = 0.5):
        if not (0 < alpha <= 1 and 0 <= beta <= 1):
            raise ValueError(f"LoadPredictor: alpha in (0, 1] and beta in [0, 1] expected, got {alpha}, {beta}")
        self.alpha, self.beta = float(alpha), float(beta)
        self.level: np.ndarray | None = None
        self.trend: np.ndarray | None = None
        self.observed = 0
        self._forecast: np.ndarray | None = None
        self.errors: list[float] = []
        self._last_error_rows: np.ndarray | None = None

    def observe(self, load) -> np.ndarray:
        """Take one window's load (tokens per expert over the window); returns the forecast of the next window."""
        y = np.asarray(load, np.float64)
        if not np.all(np.isfinite(y)) or np.any(y < 0):
            raise ValueError("LoadPredictor.observe: token counts must be finite and non-negative")
        if self.level is not None and y.shape != self.level.shape:
            raise ValueError(f"LoadPredictor.observe: shape {y.shape} differs from the earlier windows' "
                             f"{self.level.shape}")
        if self._forecast is not None:
            diff = np.abs(self._forecast - y)
            flat = y.reshape(-1, y.shape[-1]) if y.ndim else y.reshape(1, 1)
            dflat = diff.reshape(flat.shape)
            den = flat.sum(-1)
            self._last_error_rows = np.divide(dflat.sum(-1), den, out=np.zeros_like(den), where=den > 0)
            total = y.sum()
            self.errors.append(float(diff.sum() / total) if total > 0 else 0.0)
        if self.level is None:
            self.level, self.trend = y.copy(), np.zeros_like(y)
        elif self.observed == 1:
            self.trend = y - self.level if self.beta > 0 else np.zeros_like(y)
            self.level = y.copy()
        else:
            level = self.alpha * y + (1 - self.alpha) * (self.level + self.trend)
            self.trend = self.beta * (level - self.level) + (1 - self.beta) * self.trend
            self.level = level
        self.observed += 1
        self._forecast = np.maximum(self.level + self.trend, 0.0)
        return self._forecast.copy()

    def predict(self) -> np.ndarray:
        if self._forecast is None:
            raise ValueError("LoadPredictor.predict: no window observed yet")
        return self._forecast.copy()

    def error(self, per_layer: bool = False):
        """Relative L1 error sum|forecast - actual| / sum(actual) of the last forecast against the window observed
        after it (None before a forecast has been checked); per_layer: one value per leading index ([layers])."""
        if not self.errors:
            return None
        return self._last_error_rows.copy() if per_layer else self.errors[-1]


# ---- placements ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Placement:
    """Copies of E experts in the slots of D devices. slot_expert[d, s] = expert held in slot s of device d (-1:
    empty); replicas[e] = copies of e (on distinct devices); device_load[d] = tokens on d under the load the
    placement was evaluated on (`load`), each expert's tokens split evenly between its copies."""
    slot_expert: np.ndarray
    replicas: np.ndarray
    device_load: np.ndarray
    devices_per_node: int
    load: np.ndarray = field(repr=False)

    def __post_init__(self):
        se = self.slot_expert
        if se.ndim != 2:
            raise ValueError(f"Placement.slot_expert: expected [devices, slots], got shape {se.shape}")
        d = se.shape[0]
        if d % self.devices_per_node:
            raise ValueError(f"Placement: devices_per_node={self.devices_per_node} does not divide {d} devices")
        e = self.replicas.shape[0]
        held = se[se >= 0]
        if held.size and held.max() >= e:
            raise ValueError(f"Placement: slot holds expert {held.max()} of only {e}")
        if not np.array_equal(np.bincount(held, minlength=e), self.replicas):
            raise ValueError("Placement: replicas differ from the copies in the slots")
        if np.any(self.replicas < 1):
            raise ValueError(f"Placement: expert {int(np.argmin(self.replicas))} has no copy")
        ordered = np.sort(se, 1)
        if np.any((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)):
            raise ValueError("Placement: a device holds two copies of one expert")

    def __repr__(self) -> str:
        return (f"Placement({self.num_devices} devices x {self.slots_per_device} slots, {self.devices_per_node} per "
                f"node, {self.num_experts} experts in {int(self.replicas.sum())} copies, max/mean "
                f"{self.imbalance:.4f})")

    # shape
    @property
    def num_devices(self) -> int:
        return self.slot_expert.shape[0]

    @property
    def slots_per_device(self) -> int:
        return self.slot_expert.shape[1]

    @property
    def num_experts(self) -> int:
        return self.replicas.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.num_devices // self.devices_per_node

    # load
    @property
    def max_load(self) -> float:
        return float(self.device_load.max())

    @property
    def mean_load(self) -> float:
        return float(self.device_load.mean())

    @property
    def imbalance(self) -> float:
        """max / mean device load (1.0 for no load)."""
        m = self.mean_load
        return self.max_load / m if m > 0 else 1.0

    @property
    def node_load(self) -> np.ndarray:
        return self.device_load.reshape(self.num_nodes, self.devices_per_node).sum(1)

    def device_loads(self, load) -> np.ndarray:
        """[devices] tokens under another load vector."""
        v = _load_vector(load, self.num_experts)
        per_copy = np.append(v / self.replicas, 0.0)          # index -1 (empty slot) -> 0
        return per_copy[self.slot_expert].sum(1)

    def evaluate(self, load) -> "Placement":
        """The same slots, evaluated on another load."""
        v = _load_vector(load, self.num_experts)
        return Placement(self.slot_expert, self.replicas, self.device_loads(v), self.devices_per_node, v)

    # dispatcher maps
    def expert_to_slots(self) -> list[list[tuple[int, int]]]:
        """For each expert, its copies as (device, slot), devices ascending."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.num_experts)]
        dev, slot = np.nonzero(self.slot_expert >= 0)
        for d, s in zip(dev.tolist(), slot.tolist()):
            out[int(self.slot_expert[d, s])].append((d, s))
        return out

    def slot_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The same map as arrays: (offsets [E+1], device [copies], slot [copies]); expert e's copies are
        [offsets[e], offsets[e+1]), devices ascending. The global slot of a copy is device * slots + slot."""
        dev, slot = np.nonzero(self.slot_expert >= 0)
        ex = self.slot_expert[dev, slot]
        order = np.lexsort((dev, ex))
        offsets = np.zeros(self.num_experts + 1, np.int64)
        np.cumsum(self.replicas, out=offsets[1:])
        return offsets, dev[order].astype(np.int64), slot[order].astype(np.int64)

    def presence(self) -> np.ndarray:
        """[devices, experts] bool: device holds a copy of the expert."""
        p = np.zeros((self.num_devices, self.num_experts), bool)
        d, s = np.nonzero(self.slot_expert >= 0)
        p[d, self.slot_expert[d, s]] = True
        return p

    @classmethod
    def static(cls, num_experts: int, num_devices: int, slots_per_device: int, devices_per_node: int,
               load=None) -> "Placement":
        """MindFormers' placement: expert e on device e // (E / D), in slot e % (E / D), one copy each."""
        e, d = _positive_int("num_experts", num_experts), _positive_int("num_devices", num_devices)
        if e % d:
            raise ValueError(f"Placement.static: {d} devices do not divide {e} experts")
        per = e // d
        if per > slots_per_device:
            raise ValueError(f"Placement.static: {per} experts per device exceed {slots_per_device} slots")
        se = np.full((d, slots_per_device), -1, np.int64)
        se[:, :per] = np.arange(e).reshape(d, per)
        return cls.from_slots(se, devices_per_node, np.ones(e) if load is None else load, num_experts=e)

    @classmethod
    def from_slots(cls, slot_expert, devices_per_node: int, load, num_experts: int | None = None) -> "Placement":
        se = np.asarray(slot_expert, np.int64)
        v = _load_vector(load, num_experts)
        reps = np.bincount(se[se >= 0], minlength=v.shape[0])
        p = cls(se, reps, np.zeros(se.shape[0]), _positive_int("devices_per_node", devices_per_node), v)
        return p.evaluate(v)


def expert_flops_per_token(hidden: int, ffn: int) -> float:
    """Training FLOPs of one token copy through one SwiGLU expert (3 GEMMs of hidden x ffn; forward 2 FLOPs per
    multiply-add, backward twice the forward): 18 * hidden * ffn."""
    return 18.0 * hidden * ffn


# ---- the planner's pieces ------------------------------------------------------------------------------------------
def replica_counts(load, spare_slots: int, num_devices: int, *, split_above: float = 0.5,
                   max_copies: int | None = None) -> np.ndarray:
    """Copies per expert: one each, then one more at a time for the expert with the largest per-copy load while
    spare slots remain and that per-copy load exceeds split_above x the mean device load (total / devices); at
    most max_copies (default: num_devices) copies of one expert."""
    v = _load_vector(load)
    copies = np.ones(v.shape[0], np.int64)
    cap = num_devices if max_copies is None else min(int(max_copies), num_devices)
    limit = split_above * v.sum() / num_devices
    heap = [(-x, e) for e, x in enumerate(v.tolist()) if x > limit]
    heapq.heapify(heap)
    spare = int(spare_slots)
    while spare > 0 and heap:
        neg, e = heapq.heappop(heap)
        if -neg <= limit:
            break
        if copies[e] >= cap:
            continue
        copies[e] += 1
        spare -= 1
        piece = v[e] / copies[e]
        if piece > limit:
            heapq.heappush(heap, (-piece, e))
    return copies


def load_bound(load, num_devices: int, slots_per_device: int, copies=None) -> float:
    """A lower bound on the most loaded device (tokens) of any placement of these copies (default one per expert):
    the mean device load, the heaviest copy, and that copy plus the lightest others its device must take when the
    other devices' slots cannot hold the rest (n copies, n - (D-1)*S of them on every device at least)."""
    v = _load_vector(load)
    c = np.ones(v.shape[0], np.int64) if copies is None else np.asarray(copies, np.int64)
    ex, w = _items(v, c)
    d, s = _positive_int("num_devices", num_devices), _positive_int("slots_per_device", slots_per_device)
    bound = max(v.sum() / d, float(w.max()) if w.size else 0.0)
    forced = w.shape[0] - (d - 1) * s                    # copies every device holds at least
    if forced > 1:
        order = np.argsort(w, kind="stable")
        bound = max(bound, float(w[order[-1]] + w[order[:forced - 1]].sum()))
    return bound


def _lpt(w: np.ndarray, ex: np.ndarray, nbins: int, capacity: int, cap: int,
         use: np.ndarray | None = None) -> np.ndarray:
    """Largest first onto the least loaded bin that has room for the item (`use` slots, default 1; `capacity` per
    bin) and fewer than `cap` copies of its expert -> bin of each item."""
    n = w.shape[0]
    ul = [1] * n if use is None else use.tolist()
    if sum(ul) > nbins * capacity:
        raise ValueError(f"placement: {n} copies do not fit in {nbins} x {capacity} slots")
    order = np.argsort(-w, kind="stable").tolist()
    wl, el = w.tolist(), ex.tolist()
    loads = [0.0] * nbins
    heap = [(0.0, b) for b in range(nbins)]          # (load, bin); an entry whose load is not loads[bin] is stale
    count = [0] * nbins
    held: list[dict] = [{} for _ in range(nbins)]
    out = [-1] * n
    for i in order:
        e = el[i]
        skipped, b = [], -1
        while heap:
            load, c = heapq.heappop(heap)
            if load != loads[c] or count[c] >= capacity:
                continue
            if held[c].get(e, 0) < cap and count[c] + ul[i] <= capacity:
                b = c
                break
            skipped.append((load, c))
        for item in skipped:
            heapq.heappush(heap, item)
        if b < 0:       # never met in random trials: copies of one expert weigh the same, so they come together
            raise ValueError(f"placement: no bin with room for a copy of expert {e} lacks one already")
        out[i] = b
        count[b] += ul[i]
        held[b][e] = held[b].get(e, 0) + 1
        loads[b] += wl[i]
        if count[b] < capacity:
            heapq.heappush(heap, (loads[b], b))
    return np.asarray(out, np.int64)


def _refine(bins: np.ndarray, w: np.ndarray, ex: np.ndarray, nbins: int, capacity: int, cap: int,
            num_experts: int, *, use: np.ndarray | None = None, group: np.ndarray | None = None,
            tol: float = 2e-3, max_iter: int = 10_000, trace: list | None = None) -> np.ndarray:
    """Moves and pairwise swaps out of the most loaded bin that lower it without raising the other bin to its
    load; the best one (lowest max of the two bins) each time, until none lowers the most loaded bin or it is
    within `tol` of the lower bound max(mean bin, heaviest item). Items take `use` slots (default 1) of a bin's
    `capacity`; with `group` (per bin) only between bins of one group. `trace`: gets (item, bin) of each step's
    changes and the most loaded bin's load after it. -> refined bin of each item (a new array)."""
    bins = bins.copy()
    n = w.shape[0]
    if n == 0 or nbins == 1:
        return bins
    use = np.ones(n, np.int64) if use is None else use
    loads = np.bincount(bins, w, nbins)
    count = np.bincount(bins, use, nbins).astype(np.int64)
    held = np.bincount(bins * num_experts + ex, minlength=nbins * num_experts).reshape(nbins, num_experts)
    bound = max(loads.sum() / nbins, float(w.max())) * (1 + tol)
    use_varies = bool(np.any(use != use[0]))
    idx = np.arange(n)
    for _ in range(max_iter):
        b = int(np.argmax(loads))
        top = loads[b]
        if top <= bound:
            break
        mine = bins == b
        ib = idx[mine]
        io = idx[~mine] if group is None else idx[~mine & (group[bins] == group[b])]
        wb, eb, ub = w[ib], ex[ib], use[ib]
        best, choice = top * (1 - 1e-12), None
        # moves: item i of b into a bin c with room
        room = count < capacity
        room[b] = False
        if group is not None:
            room &= group == group[b]
        cs = np.flatnonzero(room)
        if cs.size:
            val = np.maximum(top - wb[:, None], loads[cs][None, :] + wb[:, None])
            val[(held[cs[None, :], eb[:, None]] >= cap) | (count[cs][None, :] + ub[:, None] > capacity)] = np.inf
            k = int(np.argmin(val))
            if val.flat[k] < best:
                best, choice = val.flat[k], ("move", ib[k // cs.size], int(cs[k % cs.size]))
        # swaps: item i of b with item j of another bin
        if io.size:
            co = bins[io]
            d = wb[:, None] - w[io][None, :]
            val = np.maximum(top - d, loads[co][None, :] + d)
            bad = (d <= 0) | (held[co[None, :], eb[:, None]] >= cap) | (held[b, ex[io]][None, :] >= cap)
            if use_varies:
                du = ub[:, None] - use[io][None, :]
                bad |= (count[co][None, :] + du > capacity) | (count[b] - du > capacity)
            val[bad] = np.inf
            k = int(np.argmin(val))
            if val.flat[k] < best:
                best, choice = val.flat[k], ("swap", ib[k // io.size], io[k % io.size])
        if choice is None:
            break
        if choice[0] == "move":
            i, c = choice[1], choice[2]
            loads[b] -= w[i]
            loads[c] += w[i]
            count[b] -= use[i]
            count[c] += use[i]
            held[b, ex[i]] -= 1
            held[c, ex[i]] += 1
            bins[i] = c
            if trace is not None:
                trace.append((((i, c),), float(loads.max())))
        else:
            i, j = choice[1], choice[2]
            c = bins[j]
            delta = w[i] - w[j]
            loads[b] -= delta
            loads[c] += delta
            count[b] += use[j] - use[i]
            count[c] += use[i] - use[j]
            held[b, ex[i]] -= 1
            held[c, ex[i]] += 1
            held[c, ex[j]] -= 1
            held[b, ex[j]] += 1
            bins[i], bins[j] = c, b
            if trace is not None:
                trace.append((((i, c), (j, b)), float(loads.max())))
    return bins


def _items(load: np.ndarray, copies: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ex = np.repeat(np.arange(load.shape[0]), copies)
    return ex, load[ex] / copies[ex]


def _slots_from_devices(dev: np.ndarray, ex: np.ndarray, num_devices: int, slots: int) -> np.ndarray:
    """slot_expert [D, S] from each copy's device (copies of a device in expert order)."""
    order = np.lexsort((ex, dev))
    d_sorted = dev[order]
    starts = np.searchsorted(d_sorted, np.arange(num_devices))
    pos = np.arange(order.size) - starts[d_sorted]
    se = np.full((num_devices, slots), -1, np.int64)
    se[d_sorted, pos] = ex[order]
    return se


def _check_shape(num_experts: int, num_devices: int, slots: int, dpn: int) -> None:
    if num_experts > num_devices * slots:
        raise ValueError(f"placement: {num_experts} experts do not fit in {num_devices} devices x {slots} slots")
    if num_devices % dpn:
        raise ValueError(f"placement: devices_per_node={dpn} does not divide {num_devices} devices")


def _within_nodes(node: np.ndarray, w: np.ndarray, ex: np.ndarray, num_devices: int, slots: int, dpn: int,
                  num_experts: int, refine: bool, tol: float) -> np.ndarray:
    """Device of each copy: each node's copies over its own devices (greedy, then refined)."""
    dev = np.empty_like(node)
    for n in range(num_devices // dpn):
        mine = np.flatnonzero(node == n)
        if mine.size == 0:
            continue
        local = _lpt(w[mine], ex[mine], dpn, slots, 1)
        if refine:
            local = _refine(local, w[mine], ex[mine], dpn, slots, 1, num_experts, tol=tol)
        dev[mine] = n * dpn + local
    return dev


def _node_slot_use(w: np.ndarray, num_devices: int, slots: int) -> np.ndarray:
    """Slots each copy takes of its node's budget at the node level: 1, but a copy heavier than the mean device
    load takes a whole device's slots (heaviest first, as far as the spare slots allow), so that the node holding
    it leaves that device to it alone instead of filling it with the node's share of the other copies."""
    use = np.ones(w.shape[0], np.int64)
    big = np.flatnonzero(w > w.sum() / num_devices)
    budget = num_devices * slots - w.shape[0]              # slots beyond one per copy, heaviest copies first
    for i in big[np.argsort(-w[big], kind="stable")].tolist():
        extra = min(slots - 1, budget)
        if extra <= 0:
            break
        use[i] += extra
        budget -= extra
    return use


def plan_placement(load, num_devices: int, slots_per_device: int, devices_per_node: int | None = None, *,
                   replicas: bool = True, split_above: float = 0.5, max_copies: int | None = None,
                   refine: bool = True, cross_node: bool = True, tol: float = 2e-3) -> Placement:
    """The two-level placement of the module docstring for `load` (tokens per expert): nodes first, then devices
    inside each node; `replicas`: replicate the hottest experts into spare slots; `refine`: moves and swaps after
    each greedy; `cross_node`: then moves and swaps between devices of different nodes where they still lower the
    most loaded device (a node's copies fixed by the node level can leave a node's devices unbalanceable when its
    slots are full); False keeps every copy on the node the node level chose; `tol`: refinement stops within this
    fraction of the lower bound."""
    v = _load_vector(load)
    e = v.shape[0]
    d = _positive_int("num_devices", num_devices)
    s = _positive_int("slots_per_device", slots_per_device)
    dpn = d if devices_per_node is None else _positive_int("devices_per_node", devices_per_node)
    _check_shape(e, d, s, dpn)
    copies = (replica_counts(v, d * s - e, d, split_above=split_above, max_copies=max_copies) if replicas
              else np.ones(e, np.int64))
    ex, w = _items(v, copies)
    nodes = d // dpn
    if nodes > 1:
        use = _node_slot_use(w, d, s)
        node = _lpt(w, ex, nodes, dpn * s, dpn, use)
        if refine:
            node = _refine(node, w, ex, nodes, dpn * s, dpn, e, use=use, tol=tol)
    else:
        node = np.zeros(ex.shape[0], np.int64)
    dev = _within_nodes(node, w, ex, d, s, dpn, e, refine, tol)
    if refine and cross_node and nodes > 1:
        dev = _refine(dev, w, ex, d, s, 1, e, tol=tol)
    se = _slots_from_devices(dev, ex, d, s)
    return Placement(se, copies, np.bincount(dev, w, d), dpn, v)


def greedy_placement(load, num_devices: int, slots_per_device: int, devices_per_node: int | None = None) -> Placement:
    """The baseline: one copy per expert, largest first onto the least loaded device with a free slot, over all
    devices at once (nodes and the cost of moving ignored), no refinement."""
    v = _load_vector(load)
    d, s = _positive_int("num_devices", num_devices), _positive_int("slots_per_device", slots_per_device)
    dpn = d if devices_per_node is None else _positive_int("devices_per_node", devices_per_node)
    _check_shape(v.shape[0], d, s, dpn)
    ex = np.arange(v.shape[0])
    dev = _lpt(v, ex, d, s, 1)
    return Placement.from_slots(_slots_from_devices(dev, ex, d, s), dpn, v)


# ---- matching a new placement to the current one -----------------------------------------------------------------
def align_placement(new: Placement, current: Placement) -> Placement:
    """`new` with its nodes, then each node's devices, permuted (devices of a node are interchangeable, and so are
    nodes) to keep the most copies where `current` has them (linear assignment on the copies in common), and each
    copy that stays on its device in its current slot. Same loads per node and device as `new`, up to the
    permutation."""
    from scipy.optimize import linear_sum_assignment

    _same_shape(new, current)
    dpn, nodes, d, s = new.devices_per_node, new.num_nodes, new.num_devices, new.slots_per_device
    pn, pc = new.presence(), current.presence()                          # [D, E]
    perm = np.arange(d)                                                  # new device i -> physical device perm[i]
    if nodes > 1:
        cn = pn.reshape(nodes, dpn, -1).sum(1)
        cc = pc.reshape(nodes, dpn, -1).sum(1)
        overlap = np.minimum(cn[:, None, :], cc[None, :, :]).sum(2)
        rows, cols = linear_sum_assignment(-overlap)
        node_to = np.empty(nodes, np.int64)
        node_to[rows] = cols
    else:
        node_to = np.zeros(1, np.int64)
    for n in range(nodes):
        phys = node_to[n]
        a = pn[n * dpn:(n + 1) * dpn].astype(np.int64)
        b = pc[phys * dpn:(phys + 1) * dpn].astype(np.int64)
        rows, cols = linear_sum_assignment(-(a @ b.T))
        perm[n * dpn + rows] = phys * dpn + cols
    se = np.full_like(new.slot_expert, -1)
    for i in range(d):
        p = perm[i]
        want = [x for x in new.slot_expert[i].tolist() if x >= 0]
        cur = current.slot_expert[p].tolist()
        keep = set(want) & set(cur)
        for slot, x in enumerate(cur):
            if x in keep:
                se[p, slot] = x
        free = [slot for slot in range(s) if se[p, slot] < 0]      # empty or left by a copy that goes
        for x, slot in zip([x for x in want if x not in keep], free):
            se[p, slot] = x
    return Placement.from_slots(se, dpn, new.load, num_experts=new.num_experts)


def _same_shape(a: Placement, b: Placement) -> None:
    if a.slot_expert.shape != b.slot_expert.shape or a.num_experts != b.num_experts or \
            a.devices_per_node != b.devices_per_node:
        raise ValueError(f"placements of different shapes: {a.slot_expert.shape}, {a.num_experts} experts, "
                         f"{a.devices_per_node} per node vs {b.slot_expert.shape}, {b.num_experts}, "
                         f"{b.devices_per_node}")


def migration_moves(current: Placement, new: Placement) -> tuple[list[tuple[int, int, int, int, int]],
                                                                    list[tuple[int, int, int]]]:
    """(moves, drops) turning `current` into `new`: a move (expert, from_device, from_slot, to_device, to_slot) for
    every slot of `new` whose expert the slot did not hold before, its source a current copy (on the same device,
    else on the destination's node, else any; several copies taken in turn); a drop (expert, device, slot) for
    every current copy whose slot `new` gives to another expert or leaves empty (released once the moves have read
    it). Moves all read `current`'s slots, so they apply at once (one exchange), not one after another."""
    _same_shape(current, new)
    dpn = current.devices_per_node
    sources = current.expert_to_slots()
    used = [0] * current.num_experts
    moves, drops = [], []
    cur, nxt = current.slot_expert, new.slot_expert
    dev, slot = np.nonzero((nxt >= 0) & (nxt != cur))
    for d, s in zip(dev.tolist(), slot.tolist()):
        e = int(nxt[d, s])
        cands = sources[e]
        same_dev = [c for c in cands if c[0] == d]
        local = same_dev or [c for c in cands if c[0] // dpn == d // dpn] or cands
        src = local[used[e] % len(local)]
        used[e] += 1
        moves.append((e, src[0], src[1], d, s))
    dev, slot = np.nonzero((cur >= 0) & (cur != nxt))
    for d, s in zip(dev.tolist(), slot.tolist()):
        drops.append((int(cur[d, s]), d, s))
    return moves, drops


# ---- cost and trigger ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoveCost:
    """What moving an expert copy costs: `expert_bytes` (weights and both Adam moments) over a device's intra-node
    link (bytes/s per device and direction) or its inter-node link. The moves of one migration run at once; the
    two links are separate and full duplex, so a device takes max(intra sent, intra received, inter sent, inter
    received) time (copies x (expert_bytes / bandwidth + latency)) and the migration the slowest device's. A move
    inside one device (another slot) costs nothing here."""
    expert_bytes: float
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float = 0.0
    inter_latency: float = 0.0

    def __post_init__(self):
        for name in ("expert_bytes", "intra_bandwidth", "inter_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MoveCost.{name}: expected a positive number, got {getattr(self, name)!r}")

    @staticmethod
    def state_bytes(expert_params: float, weight_bytes: float = 4, moment_bytes: float = 4) -> float:
        """Bytes of one expert's training state: its weights and Adam's two moments."""
        return float(expert_params) * (weight_bytes + 2 * moment_bytes)

    @classmethod
    def from_cluster(cls, cluster, expert_params: float, *, weight_bytes: float = 4,
                     moment_bytes: float = 4) -> "MoveCost":
        """From a cluster description (a `parallel.planner.cluster.Cluster`, or a name/path for `load_cluster`): its
        intra- and inter-node bandwidth times its network efficiency, and its latencies."""
        from parallel.planner.cluster import Cluster, load_cluster

        c = cluster if isinstance(cluster, Cluster) else load_cluster(str(cluster))
        return cls(cls.state_bytes(expert_params, weight_bytes, moment_bytes),
                   c.intra_bandwidth * c.network_efficiency, c.inter_bandwidth * c.network_efficiency,
                   c.intra_latency, c.inter_latency)

    @staticmethod
    def _ends(moves) -> tuple[np.ndarray, np.ndarray]:
        a = np.asarray([(m[1], m[3]) for m in moves], np.int64).reshape(-1, 2)
        return a[:, 0], a[:, 1]

    def split(self, moves, devices_per_node: int) -> tuple[float, float]:
        """(intra-node bytes, inter-node bytes) of the moves."""
        fd, td = self._ends(moves)
        net = fd != td
        intra = int(np.count_nonzero(net & (fd // devices_per_node == td // devices_per_node)))
        return intra * self.expert_bytes, (int(np.count_nonzero(net)) - intra) * self.expert_bytes

    def seconds(self, moves, devices_per_node: int) -> float:
        """Seconds of the moves (expert, from_device, from_slot, to_device, to_slot) run at once."""
        return self.seconds_between(*self._ends(moves), devices_per_node)

    def seconds_between(self, from_device: np.ndarray, to_device: np.ndarray, devices_per_node: int) -> float:
        """The same for copies moved from_device[i] -> to_device[i]."""
        fd, td = np.asarray(from_device, np.int64), np.asarray(to_device, np.int64)
        keep = fd != td
        fd, td = fd[keep], td[keep]
        if fd.size == 0:
            return 0.0
        intra = fd // devices_per_node == td // devices_per_node
        worst = 0.0
        for mask, bw, lat in ((intra, self.intra_bandwidth, self.intra_latency),
                              (~intra, self.inter_bandwidth, self.inter_latency)):
            if mask.any():
                n = max(np.bincount(fd[mask]).max(), np.bincount(td[mask]).max())
                worst = max(worst, float(n) * (self.expert_bytes / bw + lat))
        return worst


@dataclass(frozen=True, eq=False)
class Migration:
    """A proposed change of placement and its verdict. moves: (expert, from_device, from_slot, to_device, to_slot),
    applied at once (each reads the current slots; see `migration_moves`); drops: (expert, device, slot) copies
    released; bytes: sent over the network (intra_bytes + inter_bytes); predicted_gain_s: the most loaded device's
    drop over the next window x the expert time per token; cost_s: MoveCost.seconds of the moves; accepted: gain >
    threshold x cost of its level ("intra": moves inside nodes only; "inter": any) and something moves; level: the
    proposal's; current and proposed: both evaluated on the predicted load; `placement`: proposed if accepted,
    else current; candidates: per level, the best candidate's gain, cost, moves and max device load."""
    moves: list
    drops: list
    bytes: float
    intra_bytes: float
    inter_bytes: float
    predicted_gain_s: float
    cost_s: float
    accepted: bool
    level: str
    current: Placement
    proposed: Placement
    reason: str = ""
    candidates: dict = field(default_factory=dict, repr=False)

    @property
    def placement(self) -> Placement:
        return self.proposed if self.accepted else self.current

    def __repr__(self) -> str:
        return (f"Migration({'accepted' if self.accepted else 'not accepted'}, {self.level}, {len(self.moves)} moves, "
                f"{self.bytes / 2 ** 30:.2f} GiB, gain {self.predicted_gain_s:.4g} s, cost {self.cost_s:.4g} s, "
                f"max/mean {self.current.imbalance:.4f} -> {self.proposed.imbalance:.4f}: {self.reason})")


def _current_items(current: Placement, load: np.ndarray):
    dev, slot = np.nonzero(current.slot_expert >= 0)
    ex = current.slot_expert[dev, slot]
    return dev.astype(np.int64), ex.astype(np.int64), load[ex] / current.replicas[ex]


@dataclass
class _Copies:
    """Copies of a placement in the making: device, expert, and where each came from (its current device and slot;
    -1 for a new copy, which is sent from `src`, a device holding a current copy)."""
    dev: np.ndarray
    ex: np.ndarray
    home: np.ndarray
    slot: np.ndarray
    src: np.ndarray

    @classmethod
    def of(cls, current: Placement) -> "_Copies":
        dev, slot = np.nonzero(current.slot_expert >= 0)
        dev, slot = dev.astype(np.int64), slot.astype(np.int64)
        return cls(dev.copy(), current.slot_expert[dev, slot].astype(np.int64), dev, slot, dev.copy())

    def weights(self, load: np.ndarray) -> np.ndarray:
        copies = np.bincount(self.ex, minlength=load.shape[0])
        return load[self.ex] / copies[self.ex]

    def placement(self, current: Placement, load: np.ndarray) -> Placement:
        """slot_expert with every copy that stays on its current device in its current slot, the others in the
        first free slots of their device."""
        se = np.full_like(current.slot_expert, -1)
        stay = self.dev == self.home
        se[self.dev[stay], self.slot[stay]] = self.ex[stay]
        for i in np.flatnonzero(~stay).tolist():
            d = self.dev[i]
            se[d, np.flatnonzero(se[d] < 0)[0]] = self.ex[i]
        return Placement.from_slots(se, current.devices_per_node, load, num_experts=current.num_experts)


def _recopy(current: Placement, load: np.ndarray, copies: np.ndarray) -> _Copies:
    """The current copies with the replica counts changed to `copies`: surplus copies dropped from the most loaded
    devices, new ones (hottest per copy first) onto the least loaded device with a free slot and no copy of the
    expert, sent from a current copy on its node where there is one. Fewer new copies where no device can take
    them."""
    c = _Copies.of(current)
    now = current.replicas
    d, s, dpn = current.num_devices, current.slots_per_device, current.devices_per_node
    per = load / copies
    dev_load = np.bincount(c.dev, per[c.ex], d)
    keep = np.ones(c.ex.shape[0], bool)
    for e in np.flatnonzero(now > copies).tolist():
        idx = np.flatnonzero(c.ex == e)
        drop = idx[np.argsort(-dev_load[c.dev[idx]], kind="stable")[:now[e] - copies[e]]]
        keep[drop] = False
        dev_load[c.dev[drop]] -= per[e]
    c = _Copies(c.dev[keep], c.ex[keep], c.home[keep], c.slot[keep], c.src[keep])
    add = np.flatnonzero(copies > now)
    if add.size == 0:
        return c
    count = np.bincount(c.dev, minlength=d)
    held = np.zeros((d, current.num_experts), bool)
    held[c.dev, c.ex] = True
    new_dev, new_ex, new_src = [], [], []
    for e in add[np.argsort(-per[add], kind="stable")].tolist():
        holders = np.flatnonzero(held[:, e])
        for _ in range(int(copies[e] - now[e])):
            free = np.flatnonzero((count < s) & ~held[:, e])
            if free.size == 0:
                break
            t = int(free[np.argmin(dev_load[free])])
            near = holders[holders // dpn == t // dpn]
            new_dev.append(t)
            new_ex.append(e)
            new_src.append(int(near[0] if near.size else holders[0]))
            count[t] += 1
            held[t, e] = True
            dev_load[t] += per[e]
    n = len(new_dev)
    return _Copies(np.append(c.dev, new_dev).astype(np.int64), np.append(c.ex, new_ex).astype(np.int64),
                   np.append(c.home, [-1] * n).astype(np.int64), np.append(c.slot, [-1] * n).astype(np.int64),
                   np.append(c.src, new_src).astype(np.int64))


def _incremental(current: Placement, load: np.ndarray, within_nodes: bool, tol: float, cost: MoveCost,
                 seconds_per_token: float, threshold: float, margin_s: float,
                 copies: np.ndarray | None = None) -> Placement:
    """The current copies (with their replica counts changed to `copies`, if given: `_recopy`) refined by moves
    and swaps (between devices of one node, or of any), cut after the first step whose net gain (gain - threshold
    x cost) is within `margin_s` of the best step's (the whole refinement when no step pays)."""
    c = _Copies.of(current) if copies is None else _recopy(current, load, copies)
    w = c.weights(load)
    d, dpn = current.num_devices, current.devices_per_node
    trace: list = []
    group = np.arange(d) // dpn if within_nodes else None
    _refine(c.dev, w, c.ex, d, current.slots_per_device, 1, current.num_experts, group=group, tol=tol, trace=trace)
    bins = c.dev.copy()
    top = current.max_load
    nets, gains = [], []
    for ops, after in [((), np.bincount(bins, w, d).max())] + trace:
        for i, b in ops:
            bins[i] = b
        moved = bins != c.home
        gains.append((top - after) * seconds_per_token)
        nets.append(gains[-1] - threshold * cost.seconds_between(c.src[moved], bins[moved], dpn))
    nets = np.asarray(nets)
    best = nets.max()
    best_k = len(trace) if best <= 0 else int(np.argmax(nets >= best - margin_s))
    bins = c.dev.copy()
    for ops, _ in trace[:best_k]:
        for i, b in ops:
            bins[i] = b
    c.dev = bins
    return c.placement(current, load)


def _fresh_within_nodes(current: Placement, load: np.ndarray, tol: float) -> Placement:
    """Each node's current copies re-planned over its devices (greedy and refinement), matched to the current."""
    dev, ex, w = _current_items(current, load)
    dpn = current.devices_per_node
    new_dev = _within_nodes(dev // dpn, w, ex, current.num_devices, current.slots_per_device, dpn,
                            current.num_experts, True, tol)
    se = _slots_from_devices(new_dev, ex, current.num_devices, current.slots_per_device)
    return align_placement(Placement.from_slots(se, dpn, load, num_experts=current.num_experts), current)


def plan_migration(current: Placement, predicted_load, *, cost: MoveCost, seconds_per_token: float,
                   replicas: bool = True, split_above: float = 0.5, max_copies: int | None = None,
                   threshold_intra: float = 1.0, threshold_inter: float = 1.0, same_gain: float = 0.01,
                   tol: float = 2e-3) -> Migration:
    """Whether and how to re-place one MoE layer's experts for the next window. predicted_load: tokens per expert
    over the next window (e.g. LoadPredictor.predict()[layer]); seconds_per_token: one token copy's expert time
    (forward and backward) on a device; thresholds: the gain must exceed threshold x cost (per level).

    Candidates (the module docstring's): intra - the current copies refined inside their nodes, each node's copies
    re-planned over its devices; inter - a fresh two-level plan matched to the current one, the current copies
    with the replica counts a fresh plan would choose (surplus dropped, new copies added) refined over all devices.
    Of the candidates whose gain exceeds their level's threshold x cost, the one with the most net gain (gain -
    threshold x cost) is taken, but net gains within same_gain x the mean device load x seconds_per_token of the
    best count as equal (1%: the most loaded device 1% of the mean apart), and then the fewest moves win (then
    intra); the refined ones stop at the first step within half that of their most profitable one."""
    v = _load_vector(predicted_load, current.num_experts, "predicted_load")
    if not seconds_per_token > 0:
        raise ValueError(f"plan_migration: seconds_per_token must be positive, got {seconds_per_token!r}")
    now = current.evaluate(v)
    d, s, dpn = now.num_devices, now.slots_per_device, now.devices_per_node
    threshold = {"intra": float(threshold_intra), "inter": float(threshold_inter)}
    fresh = plan_placement(v, d, s, dpn, replicas=replicas, split_above=split_above, max_copies=max_copies,
                           tol=tol)
    spt = seconds_per_token
    margin = same_gain * now.mean_load * spt
    proposals = [
        ("intra", _incremental(now, v, True, tol, cost, spt, threshold["intra"], margin / 2)),
        ("intra", _fresh_within_nodes(now, v, tol)),
        ("inter", align_placement(fresh, now)),
        ("inter", _incremental(now, v, False, tol, cost, spt, threshold["inter"], margin / 2, fresh.replicas)),
    ]
    priced = []
    for level, cand in proposals:
        moves, drops = migration_moves(now, cand)
        gain = (now.max_load - cand.max_load) * spt
        secs = cost.seconds(moves, dpn)
        priced.append(dict(level=level, cand=cand, moves=moves, drops=drops, gain=gain, secs=secs,
                           net=gain - threshold[level] * secs, ok=bool(moves) and gain > threshold[level] * secs))
    accepted = [p for p in priced if p["ok"]]
    if accepted:
        best = max(p["net"] for p in accepted)
        pick = min((p for p in accepted if p["net"] >= best - margin),
                   key=lambda p: (len(p["moves"]), p["level"] != "intra", -p["net"]))
    else:
        pick = max(priced, key=lambda p: (p["net"], p["level"] == "intra"))
    level, gain, secs = pick["level"], pick["gain"], pick["secs"]
    intra_b, inter_b = cost.split(pick["moves"], dpn)
    if accepted:
        reason = f"{level}: gain {gain:.4g} s > {threshold[level]:g} x cost {secs:.4g} s"
    elif not any(p["moves"] and p["gain"] > 0 for p in priced):
        reason = "nothing to move: no candidate lowers the most loaded device"
    else:
        reason = f"refused: best ({level}) gain {gain:.4g} s <= {threshold[level]:g} x cost {secs:.4g} s"
    summary = {}
    for p in priced:
        key = p["level"]
        if key not in summary or p["net"] > summary[key]["net"]:
            summary[key] = {"gain_s": p["gain"], "cost_s": p["secs"], "net": p["net"], "moves": len(p["moves"]),
                            "max_load": p["cand"].max_load}
    return Migration(pick["moves"], pick["drops"], intra_b + inter_b, intra_b, inter_b, gain, secs, bool(accepted),
                     level, now, pick["cand"], reason, summary)
