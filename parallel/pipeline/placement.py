"""Place the model's units (embedding, dense layers, MoE layers, MTP, output head) on pipeline stages x chunks.

The model is a chain of units cut into p*v contiguous segments; segment k is chunk k // p of stage k % p
(Megatron/MindFormers interleaved order), so a stage's time is the sum of v non-adjacent segments. `balance`
minimises the (interleaved) 1F1B period, then the slowest stage's time, under a per-stage memory limit exactly, as
a mixed-integer program (scipy.optimize.milp / HiGHS); `equal_layer_split` is the naive split it is compared with.

Units carry plain numbers (seconds, bytes). `planner_units` takes them from the planner's cost model
(parallel.planner.cost_model) for one layout on one cluster: per block forward and backward time with the TP
and expert all-to-all communication it charges and the recompute it runs, weights + gradients + optimizer
states, activations per micro-batch in flight and the block's transient working memory; `recipe_workload`
gives that layout and cluster for a recipe, `memory_limit` the device memory the placement must respect.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from oneline import InputError
from parallel.planner.cost_model import Layouts, StagePlan, Workload, block_costs, p2p_time, stage_memory, stage_parts
from parallel.planner.cost_model import in_flight as held_micro_batches
from parallel.pipeline.simulator import StageCosts

KINDS = ("embedding", "dense", "moe", "mtp", "head")


class PlacementError(InputError):
    """No placement satisfies the request; the message says which constraint."""


@dataclass(frozen=True)
class Unit:
    name: str
    kind: str  # one of KINDS
    forward: float  # time of one micro-batch's forward
    backward: float
    weight_memory: float = 0.0  # bytes held regardless of micro-batches: weights, gradients, optimizer states
    activation_memory: float = 0.0  # bytes held per micro-batch in flight
    layer: int = -1  # decoder layer index of dense/moe units
    transient: float = 0.0  # bytes alive only while the unit runs: a stage holds its units' largest
    forward_comm: float = 0.0  # of `forward`, the in-pass communication (TP, expert all-to-all)
    backward_comm: float = 0.0

    @property
    def time(self) -> float:
        return self.forward + self.backward


@dataclass(frozen=True)
class PlacementOptions:
    # MTP on another stage than the output head (it then holds its own copy of the shared head weights); off:
    # MTP and the head share the last segment, as MindFormers places them.
    mtp_apart_from_head: bool = False
    # MTP's embedding lookup done on the first stage next to the main one, its result sent along; off: the MTP
    # stage holds its own copy of the embedding table.
    mtp_embedding_on_first_stage: bool = False
    memory_limit: float = math.inf  # bytes per device


@dataclass(frozen=True)
class Placement:
    stages: int
    chunks: int
    units: tuple[Unit, ...]
    sizes: tuple[int, ...]  # units per segment, segment k = chunk k // p of stage k % p
    stage_time: tuple[float, ...]
    stage_memory: tuple[float, ...]  # peak bytes: fixed part + activations of the in-flight micro-batches
    stage_fixed_memory: tuple[float, ...]  # weights, gradients, optimizer states and the largest transient
    method: str

    @property
    def segments(self) -> list[tuple[Unit, ...]]:
        bounds = np.concatenate([[0], np.cumsum(self.sizes)])
        return [self.units[bounds[k]:bounds[k + 1]] for k in range(len(self.sizes))]

    def location(self, name: str) -> tuple[int, int]:
        """(stage, chunk) of a unit."""
        for k, seg in enumerate(self.segments):
            if any(u.name == name for u in seg):
                return k % self.stages, k // self.stages
        raise KeyError(name)

    @property
    def slowest_over_mean(self) -> float:
        return max(self.stage_time) / (sum(self.stage_time) / self.stages)

    def stage_costs(self, p2p: float = 0.0) -> StageCosts:
        """The simulator's per-(stage, chunk) costs: compute, in-pass communication, activation bytes."""
        grids = {key: [[0.0] * self.chunks for _ in range(self.stages)]
                 for key in ("forward", "backward", "forward_comm", "backward_comm", "activation")}
        for k, seg in enumerate(self.segments):
            s, c = k % self.stages, k // self.stages
            for u in seg:
                grids["forward"][s][c] += u.forward - u.forward_comm
                grids["backward"][s][c] += u.backward - u.backward_comm
                grids["forward_comm"][s][c] += u.forward_comm
                grids["backward_comm"][s][c] += u.backward_comm
                grids["activation"][s][c] += u.activation_memory
        return StageCosts(**{key: tuple(map(tuple, g)) for key, g in grids.items()}, p2p=p2p)

    def describe(self) -> str:
        """One line per stage: time relative to the mean stage, memory in GiB, the units of each chunk."""
        mean = sum(self.stage_time) / self.stages
        rows = []
        for s in range(self.stages):
            parts = [_compact(self.segments[c * self.stages + s]) for c in range(self.chunks)]
            rows.append(f"stage {s:>2}: time {self.stage_time[s] / mean:5.3f} x mean  "
                        f"memory {self.stage_memory[s] / 2 ** 30:7.2f} GiB  " + " | ".join(parts))
        return "\n".join(rows)


def _compact(seg: tuple[Unit, ...]) -> str:
    """'emb, L0-L3, mtp' style summary of a segment."""
    out: list[str] = []
    run: list[str] = []
    for u in seg:
        if u.kind in ("dense", "moe"):
            run.append(u.name)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run = []
        out.append(u.name)
    if run:
        out.append(run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out) or "-"


def _in_flight(stages: int, chunks: int, in_flight) -> np.ndarray:
    """Micro-batches whose activations a (stage, chunk) holds at its peak; default 1 (memory = one micro-batch)."""
    if in_flight is None:
        return np.ones((stages, chunks))
    arr = np.asarray(in_flight, dtype=float)
    if arr.shape != (stages, chunks):
        raise PlacementError(f"in_flight: expected {stages} x {chunks} counts, got shape {arr.shape}")
    return arr


def evaluate(units, stages: int, chunks: int, sizes, in_flight=None, method: str = "given") -> Placement:
    """Stage times and memory of the placement that puts sizes[k] consecutive units into segment k."""
    units = tuple(units)
    sizes = tuple(int(x) for x in sizes)
    if len(sizes) != stages * chunks or sum(sizes) != len(units) or min(sizes) < 0:
        raise PlacementError(f"sizes: expected {stages * chunks} non-negative segment sizes summing to "
                             f"{len(units)} units, got {list(sizes)}")
    n = _in_flight(stages, chunks, in_flight)
    time = [0.0] * stages
    static = [0.0] * stages
    transient = [0.0] * stages
    act = [0.0] * stages
    i = 0
    for k, size in enumerate(sizes):
        s, c = k % stages, k // stages
        for u in units[i:i + size]:
            time[s] += u.time
            static[s] += u.weight_memory
            transient[s] = max(transient[s], u.transient)
            act[s] += u.activation_memory * n[s, c]
        i += size
    fixed = tuple(a + b for a, b in zip(static, transient))
    return Placement(stages, chunks, units, sizes, tuple(time), tuple(f + a for f, a in zip(fixed, act)), fixed,
                     method)


def _check_chain(units: tuple[Unit, ...], stages: int, chunks: int) -> None:
    if stages < 1 or chunks < 1:
        raise PlacementError(f"stages/chunks: expected positive integers, got {stages}/{chunks}")
    for u in units:
        if u.kind not in KINDS:
            raise PlacementError(f"unit {u.name}: kind {u.kind!r} is not one of {KINDS}")
    if len(units) < stages * chunks:
        raise PlacementError(f"{len(units)} units cannot fill {stages} stages x {chunks} chunks "
                             f"(every segment needs at least one unit)")
    names = [u.name for u in units]
    if len(set(names)) != len(names):
        raise PlacementError("units: names must be unique")


def equal_layer_split(units, stages: int, chunks: int, in_flight=None) -> Placement:
    """The naive split: the same number of decoder layers in every segment (remainder to the middle segments),
    embedding with the first segment, MTP and head with the last."""
    units = tuple(units)
    _check_chain(units, stages, chunks)
    layers = [i for i, u in enumerate(units) if u.kind in ("dense", "moe")]
    segs = stages * chunks
    base, extra = divmod(len(layers), segs)
    counts = [base] * segs
    first = (segs - extra) // 2
    for k in range(first, first + extra):
        counts[k] += 1
    if min(counts) == 0:
        raise PlacementError(f"{len(layers)} layers cannot give each of {segs} segments one layer")
    counts[0] += layers[0]  # the units before the first layer (embedding)
    counts[-1] += len(units) - 1 - layers[-1]  # and after the last one (MTP, head)
    return evaluate(units, stages, chunks, counts, in_flight, method="equal layers")


def _runs(units: tuple[Unit, ...]) -> list[tuple[int, int]]:
    """(start, length) of the maximal runs of consecutive units with equal time and memory."""
    key = [(u.forward, u.backward, u.weight_memory, u.activation_memory, u.transient) for u in units]
    out: list[tuple[int, int]] = []
    for i in range(len(units)):
        if out and key[i] == key[i - 1]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def balance(units, stages: int, chunks: int, options: PlacementOptions = PlacementOptions(),
            in_flight=None, time_limit: float = 60.0, tie_break_nodes: int = 500) -> Placement:
    """Exact placement under every stage's memory <= the limit, every segment non-empty, and the MTP options.

    Objective, lexicographic: first the steady-state period of (interleaved) 1F1B, the sum over chunks of the
    slowest stage's chunk (the planner's step formula, stage_ilp: (m - 1/v) * sum_c max_s t[s, c] + work / v),
    then the slowest stage's time; for one chunk per stage both are the slowest stage. Minimising only the slowest
    stage lets the chunks of a stage differ freely, and the interleaved step then pays each chunk's own maximum.

    A MILP over the p*v-1 cut positions. Inside a run of identical units (the MoE layers) the prefix sums of
    time and memory are linear in the cut's offset, so each cut needs one binary per run (the run it falls in)
    and an integer offset inside it: a few hundred variables for a 1T model, solved to proven optimality by HiGHS
    in well under a second (one binary per unit and segment instead takes minutes).
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    units = tuple(units)
    _check_chain(units, stages, chunks)
    n, segs = len(units), stages * chunks
    flight = _in_flight(stages, chunks, in_flight)
    # HiGHS works to absolute tolerances: scale times to at most 1 and memory to the limit
    t = np.array([u.time for u in units])
    t = t / max(t.max(), np.finfo(float).tiny)
    mem_scale = options.memory_limit if math.isfinite(options.memory_limit) else 1.0
    w = np.array([u.weight_memory for u in units]) / mem_scale
    a = np.array([u.activation_memory for u in units]) / mem_scale
    prefix = {name: np.concatenate([[0.0], np.cumsum(x)]) for name, x in (("t", t), ("w", w), ("a", a))}
    prefix["pos"] = np.arange(n + 1, dtype=float)
    runs = _runs(units)
    rows: list[tuple[dict[int, float], float, float]] = []

    integrality: list[int] = []
    upper: list[float] = []

    def var(up: float, integer: bool = True) -> int:
        integrality.append(int(integer))
        upper.append(up)
        return len(upper) - 1

    # per internal cut k and run r: in_run (binary), offset inside the run (integer)
    cut_vars = {(k, r): (var(1.0), var(length - 1.0)) for k in range(1, segs) for r, (_, length) in enumerate(runs)}
    z = var(np.inf, integer=False)
    floor = var(np.inf, integer=False)  # the fastest stage's time, raised in the last pass
    chunk_max = [var(np.inf, integer=False) for _ in range(chunks)]
    period = var(np.inf, integer=False)

    def at(k: int, what: str) -> tuple[dict[int, float], float]:
        """prefix[what] at cut k as a linear expression (coefficients, constant)."""
        if k == 0 or k == segs:
            return {}, float(prefix[what][0 if k == 0 else n])
        acc = {}
        pre = prefix[what]
        for r, (start, _) in enumerate(runs):
            in_run, offset = cut_vars[k, r]
            acc[in_run] = pre[start]
            acc[offset] = pre[start + 1] - pre[start]
        return acc, 0.0

    def add(terms: list[tuple[float, tuple[dict[int, float], float]]], low: float, up: float) -> None:
        acc: dict[int, float] = {}
        const = 0.0
        for coef, (expr, c0) in terms:
            for j, v in expr.items():
                acc[j] = acc.get(j, 0.0) + coef * v
            const += coef * c0
        rows.append((acc, low - const, up - const))

    for k in range(1, segs):
        rows.append(({cut_vars[k, r][0]: 1.0 for r in range(len(runs))}, 1.0, 1.0))
        for r, (_, length) in enumerate(runs):
            in_run, offset = cut_vars[k, r]
            rows.append(({offset: 1.0, in_run: -(length - 1.0)}, -np.inf, 0.0))
    for k in range(segs):  # every segment holds at least one unit, and at most its chunk's slowest time
        add([(1.0, at(k + 1, "pos")), (-1.0, at(k, "pos"))], 1.0, np.inf)
        add([(1.0, at(k + 1, "t")), (-1.0, at(k, "t")), (-1.0, ({chunk_max[k // stages]: 1.0}, 0.0))], -np.inf, 0.0)
    rows.append(({period: 1.0, **{x: -1.0 for x in chunk_max}}, 0.0, 0.0))
    holding: dict[int, list[int]] = {}

    def containing(j: int) -> list[int]:
        """One binary per segment, 1 for the segment that holds unit j."""
        if j in holding:
            return holding[j]
        g = holding[j] = [var(1.0) for _ in range(segs)]
        rows.append(({x: 1.0 for x in g}, 1.0, 1.0))
        for k, x in enumerate(g):
            add([(1.0, at(k, "pos")), (n - j, ({x: 1.0}, 0.0))], -np.inf, float(n))  # starts at or before j
            add([(1.0, at(k + 1, "pos")), (-(j + 1.0), ({x: 1.0}, 0.0))], 0.0, np.inf)  # ends after j
        return g

    limited = math.isfinite(options.memory_limit)
    if limited:
        # a stage holds the largest transient of its units: tr_s >= transient of every run reaching stage s. The
        # runs reaching a segment are those between the runs holding its first and last unit, so the run's first
        # and last unit each get a segment indicator and the run covers segments from the one to the other.
        tau = np.array([u.transient for u in units]) / mem_scale
        low = float(tau.min())  # every stage holds some unit
        tr = [var(np.inf, integer=False) for _ in range(stages)]
        for x in tr:
            rows.append(({x: 1.0}, low, np.inf))
        for start, length in runs:
            if tau[start] <= low:
                continue
            first = containing(start)
            last = first if length == 1 else containing(start + length - 1)
            for k in range(segs):
                covers = {x: 1.0 for x in first[:k + 1]}
                for x in last[:k]:
                    covers[x] = covers.get(x, 0.0) - 1.0
                add([(1.0, ({tr[k % stages]: 1.0}, 0.0)), (-tau[start], (covers, 0.0))], 0.0, np.inf)
    for s in range(stages):
        ks = [c * stages + s for c in range(chunks)]
        stage_time = [(sign, at(k + d, "t")) for k in ks for sign, d in ((1.0, 1), (-1.0, 0))]
        add(stage_time + [(-1.0, ({z: 1.0}, 0.0))], -np.inf, 0.0)
        add(stage_time + [(-1.0, ({floor: 1.0}, 0.0))], 0.0, np.inf)
        if limited:
            terms = [(1.0, ({tr[s]: 1.0}, 0.0))]
            for c, k in enumerate(ks):
                for what, coef in (("w", 1.0), ("a", flight[s, c])):
                    terms += [(coef, at(k + 1, what)), (-coef, at(k, what))]
            add(terms, -np.inf, 1.0)
    mtps = [i for i, u in enumerate(units) if u.kind == "mtp"]
    if mtps and units[-1].kind == "head":
        if options.mtp_apart_from_head:  # the head's stage p-1 holds no MTP
            for j in mtps:
                g = containing(j)
                for k in range(stages - 1, segs, stages):
                    upper[g[k]] = 0.0
        else:  # MTP in the head's segment, the last one
            add([(1.0, at(segs - 1, "pos"))], -np.inf, float(min(mtps)))

    nv = len(upper)
    mat = lil_matrix((len(rows), nv))
    lo, hi = np.empty(len(rows)), np.empty(len(rows))
    for i, (acc, low, up) in enumerate(rows):
        for j, v in acc.items():
            mat[i, j] = v
        lo[i], hi[i] = low, up
    constraints = LinearConstraint(mat.tocsr(), lo, hi)
    bounds = Bounds(np.zeros(nv), np.array(upper))

    def solve(cost: np.ndarray, bounds: Bounds, limits: dict, prove: bool):
        res = milp(cost, constraints=constraints, integrality=np.array(integrality), bounds=bounds, options=limits)
        if res.status == 4:  # HiGHS' presolve fails on some capped passes (seen with scipy 1.17); solve without it
            res = milp(cost, constraints=constraints, integrality=np.array(integrality), bounds=bounds,
                       options={**limits, "presolve": False})
        if res.x is None:
            why = "memory_limit" if math.isfinite(options.memory_limit) else "the MTP and non-empty-segment constraints"
            raise PlacementError(f"no placement of {n} units on {stages} stages x {chunks} chunks satisfies {why} "
                                 f"({res.message})")
        if prove and res.status != 0:
            raise PlacementError(f"placement solver stopped before proving optimality: {res.message}")
        return res

    def minimise(target: int, bound: np.ndarray, limits: dict, prove: bool, sign: float = 1.0):
        cost = np.zeros(nv)
        cost[target] = sign
        return solve(cost, Bounds(np.zeros(nv), bound), limits, prove)

    def capped(bound: np.ndarray, target: int, value: float) -> np.ndarray:
        """`bound` with `target` at most `value`, widened by HiGHS' feasibility tolerance (1e-7): the value comes
        from a solution that may miss a row by that much, and the next pass must keep it feasible."""
        out = bound.copy()
        out[target] = value + 1e-7 * (1 + abs(value))
        return out

    bound = np.array(upper)
    proven = {"time_limit": time_limit}
    res = minimise(period, bound, proven, prove=True)
    if chunks > 1:
        bound = capped(bound, period, res.x[period])
        res = minimise(z, bound, proven, prove=True)
    # last pass, a tie-break: among the placements with that period and slowest stage, raise the fastest one, so
    # that the other stages do not keep whatever uneven split the first passes returned. Its best within a node
    # budget will do (a node budget, not a time limit, so that the answer does not depend on the machine's speed).
    res = minimise(floor, capped(bound, z, res.x[z]), {"node_limit": tie_break_nodes, "time_limit": time_limit},
                   prove=False, sign=-1.0)
    x = np.round(res.x)
    cuts = []
    for k in range(segs + 1):
        expr, const = at(k, "pos")
        cuts.append(int(round(const + sum(c * x[j] for j, c in expr.items()))))
    return evaluate(units, stages, chunks, np.diff(cuts), flight, method="balanced (MILP)")


# ---- units from the planner's cost model ---------------------------------------------------------------------------
def planner_units(w: Workload, layout: dict, options: PlacementOptions = PlacementOptions()) -> list[Unit]:
    """The model as a chain [embedding, dense layers, MoE layers, MTP depths, head] with the cost model's costs for
    `layout` (a Layouts.row dict): each unit is one block scored alone on a stage (stage_parts, stage_memory).

    The cost model bills head and MTP together on the last stage; the head is scored on the model without MTP and
    each MTP depth as the difference. MTP on a stage of its own holds its own copy of the head (the head's vocabulary
    matrix) and, unless its embedding lookup runs on the first stage (`mtp_embedding_on_first_stage`, which adds
    that lookup to the embedding unit), a copy of the embedding table.
    """
    mode = ("none", "selective", "full").index(layout["recompute"])
    head_only = dataclasses.replace(w, shape=dataclasses.replace(w.shape, mtp_depth=0))
    rows = [("embedding", w), ("dense", w), ("moe", w), ("head", head_only), ("last", w)]
    n = len(rows)
    lay = Layouts(**{k: np.full(n, v) for k, v in Layouts.single(**layout).__dict__.items()})
    onehot = lambda names: np.array([[float(r == mode and name in names) for name, _ in rows]  # noqa: E731
                                     for r in range(3)])
    plan = StagePlan(stage=np.zeros(n, int), dense_by_mode=onehot({"dense"}), moe_by_mode=onehot({"moe"}),
                     embedding=np.array([float(name == "embedding") for name, _ in rows]),
                     last=np.array([float(name in ("head", "last")) for name, _ in rows]), mtp_mode=np.full(n, mode))
    cost: dict[str, dict[str, float]] = {}
    for i, (name, wk) in enumerate(rows):
        b = block_costs(wk, lay)
        parts = stage_parts(wk, b, plan)
        mem = stage_memory(wk, lay, b, plan)
        cost[name] = {key: float(parts[key][i]) for key in parts}
        cost[name].update(static=float((mem["weights"] + mem["grads"] + mem["optimizer"])[i]),
                          act=float(mem["activations"][i] / held_micro_batches(lay, plan.stage)[i]),
                          transient=float(mem["transient"][i]))
    depth = w.shape.mtp_depth
    mtp = {key: (cost["last"][key] - cost["head"][key]) / max(depth, 1) for key in cost["last"]}
    mtp["transient"] = cost["last"]["transient"]  # an MTP depth runs the shared head itself
    if options.mtp_apart_from_head:
        mtp["static"] += cost["head"]["static"]
    emb = dict(cost["embedding"])
    if depth and options.mtp_embedding_on_first_stage:
        for key in ("fwd_compute", "bwd_compute"):
            emb[key] *= 1 + depth
    elif depth:
        mtp["static"] += cost["embedding"]["static"]

    def unit(name: str, kind: str, c: dict, layer: int = -1) -> Unit:
        return Unit(name, kind, c["fwd_compute"] + c["fwd_comm"], c["bwd_compute"] + c["bwd_comm"], c["static"],
                    c["act"], layer, c["transient"], c["fwd_comm"], c["bwd_comm"])

    units = [unit("embedding", "embedding", emb)]
    units += [unit(f"L{i}", "dense" if i < w.shape.first_k_dense else "moe",
                   cost["dense" if i < w.shape.first_k_dense else "moe"], i) for i in range(w.shape.num_layers)]
    units += [unit(f"mtp{d}" if depth > 1 else "mtp", "mtp", mtp) for d in range(depth)]
    return units + [unit("head", "head", cost["head"])]


def recipe_workload(recipe, cluster: str) -> tuple[Workload, dict]:
    """The planner's workload (the recipe's model on its device count of `cluster`) and the recipe's layout as a
    Layouts.row dict, as `python -m parallel.plan --recipe R --cluster C --evaluate ...` scores it."""
    from types import SimpleNamespace

    from parallel.plan import build_workload

    lay = recipe.layout
    w = build_workload(SimpleNamespace(cluster=cluster, seq=None, dtype=None, devices=lay.world_size,
                                       global_batch=None), recipe)
    hierarchical = recipe.model.moe_token_dispatcher_type == "hierarchical"
    row = {"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "dp": lay.dp, "ep": lay.ep, "etp": lay.etp,
           "mbs": w.global_batch // (lay.dp * lay.micro_batch_num), "m": lay.micro_batch_num,
           "recompute": recipe.recompute_config.mode, "ep_scheme": "hierarchical" if hierarchical else "flat",
           "ep_overlap": False}
    return w, row


def memory_limit(recipe, w: Workload) -> float:
    """Bytes per device: the recipe's context.max_device_memory_gb (MindSpore's GB are GiB) or the cluster's
    usable memory."""
    gb = recipe.context.max_device_memory_gb
    return gb * 2 ** 30 if gb > 0 else w.cluster.usable_memory


def placement_p2p(w: Workload, layout: dict) -> float:
    """Seconds to send one micro-batch's hidden state to the next stage (the simulator's p2p)."""
    return float(p2p_time(w, Layouts.single(**layout))[0])
