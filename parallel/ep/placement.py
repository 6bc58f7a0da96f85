"""Dynamic expert placement (issue 17), pure NumPy, in three modules: load statistics and a load predictor
(parallel/ep/load.py), the placement and its two-level planner with replicas of hot experts (here), and the
migration trigger that weighs the predicted gain against the cost of moving weights and Adam moments
(parallel/ep/migration_plan.py). The trainer side (collecting the counts, moving the tensors over the EP group, the
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

When to move to a better placement, and how: parallel/ep/migration_plan.py.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from parallel.ep.load import _load_vector, _positive_int

__all__ = ["Placement", "plan_placement", "greedy_placement", "replica_counts", "load_bound",
           "expert_flops_per_token"]


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
