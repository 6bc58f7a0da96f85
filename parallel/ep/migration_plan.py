"""The migration trigger of dynamic expert placement: a better placement (parallel/ep/placement.py) for the load
predicted (parallel/ep/load.py) is proposed, matched to the current one (`align_placement`), turned into moves
(`migration_moves`), priced (`MoveCost`) and accepted when the gain outweighs the cost (`plan_migration`).

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

from dataclasses import dataclass, field

import numpy as np

from parallel.ep.load import _load_vector
from parallel.ep.placement import Placement, _refine, _slots_from_devices, _within_nodes, plan_placement

__all__ = ["MoveCost", "Migration", "plan_migration", "align_placement", "migration_moves"]


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
