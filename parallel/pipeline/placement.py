"""Place the model's units (embedding, dense layers, MoE layers, MTP, output head) on pipeline stages x chunks.

The model is a chain of units cut into p*v contiguous segments; segment k is chunk k // p of stage k % p
(Megatron/MindFormers interleaved order), so a stage's time is the sum of v non-adjacent segments. `balance`
minimises the slowest stage's time under a per-stage memory limit exactly, as a mixed-integer program
(scipy.optimize.milp / HiGHS); `equal_layer_split` is the naive split it is compared with.

Units carry plain numbers (seconds or relative time, bytes), so any cost source can feed them: the planner's cost
model, a profile, or `telechat_units` below, which derives them from FLOPs and parameter counts of a ModelShape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from parallel.layout import ParallelLayout
from parallel.planner.model_shape import (ModelShape, attention_core_flops, attention_params,
                                          attention_projection_flops, dense_ffn_params, expert_params, head_flops,
                                          moe_ffn_flops, router_params, shared_expert_params)

KINDS = ("embedding", "dense", "moe", "mtp", "head")


class PlacementError(ValueError):
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
    stage_memory: tuple[float, ...]
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

    def chunk_times(self) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
        """Forward and backward time per (stage, chunk): what the simulator's StageCosts take."""
        fwd = [[0.0] * self.chunks for _ in range(self.stages)]
        bwd = [[0.0] * self.chunks for _ in range(self.stages)]
        for k, seg in enumerate(self.segments):
            fwd[k % self.stages][k // self.stages] = sum(u.forward for u in seg)
            bwd[k % self.stages][k // self.stages] = sum(u.backward for u in seg)
        return tuple(map(tuple, fwd)), tuple(map(tuple, bwd))

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
    mem = [0.0] * stages
    i = 0
    for k, size in enumerate(sizes):
        s, c = k % stages, k // stages
        for u in units[i:i + size]:
            time[s] += u.time
            mem[s] += u.weight_memory + u.activation_memory * n[s, c]
        i += size
    return Placement(stages, chunks, units, sizes, tuple(time), tuple(mem), method)


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
    key = [(u.forward, u.backward, u.weight_memory, u.activation_memory) for u in units]
    out: list[tuple[int, int]] = []
    for i in range(len(units)):
        if out and key[i] == key[i - 1]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def balance(units, stages: int, chunks: int, options: PlacementOptions = PlacementOptions(),
            in_flight=None, time_limit: float = 60.0, tie_break_nodes: int = 500) -> Placement:
    """Exact min-max placement: minimise the slowest stage's time subject to every stage's memory <= the limit,
    every segment non-empty, and the MTP options.

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

    integrality: list[int] = []
    upper: list[float] = []

    def var(up: float, integer: bool = True) -> int:
        integrality.append(int(integer))
        upper.append(up)
        return len(upper) - 1

    # per internal cut k and run r: in_run (binary), offset inside the run (integer)
    cut_vars = {(k, r): (var(1.0), var(length - 1.0)) for k in range(1, segs) for r, (_, length) in enumerate(runs)}
    z = var(np.inf, integer=False)
    floor = var(np.inf, integer=False)  # the fastest stage's time, raised in the second pass

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

    rows: list[tuple[dict[int, float], float, float]] = []

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
    for k in range(segs):  # every segment holds at least one unit
        add([(1.0, at(k + 1, "pos")), (-1.0, at(k, "pos"))], 1.0, np.inf)
    for s in range(stages):
        ks = [c * stages + s for c in range(chunks)]
        stage_time = [(sign, at(k + d, "t")) for k in ks for sign, d in ((1.0, 1), (-1.0, 0))]
        add(stage_time + [(-1.0, ({z: 1.0}, 0.0))], -np.inf, 0.0)
        add(stage_time + [(-1.0, ({floor: 1.0}, 0.0))], 0.0, np.inf)
        if math.isfinite(options.memory_limit):
            terms = []
            for c, k in enumerate(ks):
                for what, coef in (("w", 1.0), ("a", flight[s, c])):
                    terms += [(coef, at(k + 1, what)), (-coef, at(k, what))]
            add(terms, -np.inf, 1.0)
    mtps = [i for i, u in enumerate(units) if u.kind == "mtp"]
    if mtps and units[-1].kind == "head":
        if options.mtp_apart_from_head:
            # the head's stage p-1 holds no MTP: each of its segments ends before j or starts after it
            for j in mtps:
                for k in range(stages - 1, segs, stages):
                    q = var(1.0)
                    add([(1.0, at(k, "pos")), (-(j + 1.0), ({q: 1.0}, 0.0))], 0.0, np.inf)
                    add([(1.0, at(k + 1, "pos")), (-(n - j), ({q: 1.0}, 0.0))], -np.inf, float(j))
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
        if res.x is None:
            why = "memory_limit" if math.isfinite(options.memory_limit) else "the MTP and non-empty-segment constraints"
            raise PlacementError(f"no placement of {n} units on {stages} stages x {chunks} chunks satisfies {why} "
                                 f"({res.message})")
        if prove and res.status != 0:
            raise PlacementError(f"placement solver stopped before proving optimality: {res.message}")
        return res

    cost = np.zeros(nv)
    cost[z] = 1.0
    slowest = solve(cost, bounds, {"time_limit": time_limit}, prove=True).x[z]
    # second pass, a tie-break: among the placements with that slowest stage, raise the fastest one, so that the
    # other stages do not keep whatever uneven split the first pass returned. Its best within a node budget will
    # do (a node budget, not a time limit, so that the answer does not depend on the machine's speed).
    upper_z = np.array(upper)
    upper_z[z] = slowest * (1 + 1e-9) + 1e-12
    cost = np.zeros(nv)
    cost[floor] = -1.0
    res = solve(cost, Bounds(np.zeros(nv), upper_z), {"node_limit": tie_break_nodes, "time_limit": time_limit},
                prove=False)
    x = np.round(res.x)
    cuts = []
    for k in range(segs + 1):
        expr, const = at(k, "pos")
        cuts.append(int(round(const + sum(c * x[j] for j, c in expr.items()))))
    return evaluate(units, stages, chunks, np.diff(cuts), flight, method="balanced (MILP)")


# ---- units of a TeleChat3 / DeepSeek-V3 style model from FLOPs and parameter counts ---------------------------------
def telechat_units(shape: ModelShape, layout: ParallelLayout, *, tokens: int, optimizer_shard: bool = True,
                   recompute: bool = False, weight_bytes: float = 6.0, optimizer_bytes: float = 12.0,
                   activation_bytes: float = 2.0, flops_per_second: float = 1.0,
                   options: PlacementOptions = PlacementOptions()) -> list[Unit]:
    """The model as a chain [embedding, dense layers, MoE layers, MTP, head]: per-micro-batch times from FLOPs
    (backward = 2 x forward, plus a forward under full recompute) and memory from parameter counts.

    tokens: tokens of one micro-batch (one sequence per data-parallel rank and micro-batch: seq_length). With
    sequence parallelism a device works on tokens/tp of every part, so all FLOPs are divided by tp.
    weight_bytes: weight + gradient per parameter (bf16 + fp32); optimizer_bytes: fp32 master and Adam moments,
    split over the data-parallel replicas of each parameter when `optimizer_shard` (ZeRO-1: dp*cp for dense
    parameters, the expert-data-parallel group for experts). Activations are an estimate per token and layer:
    34*h/tp values for attention, norms and residuals (Korthikanti et al., with flash attention) plus
    top_k*(h + 3*ffn)/tp inside the MoE FFN, `activation_bytes` each; full recompute keeps only the layer input.
    """
    h, v, tp = shape.hidden_size, shape.vocab_size, layout.tp
    dense_bytes = weight_bytes + optimizer_bytes / (layout.dp * layout.cp if optimizer_shard else 1)
    expert_bytes = weight_bytes + optimizer_bytes / (layout.edp if optimizer_shard else 1)
    a = attention_params(shape)
    attn_fwd = attention_projection_flops(shape) + attention_core_flops(shape, shape.seq_length)
    attn_params = a["replicated"] + a["sharded"] / tp + 2 * h
    moe_dense_params = attn_params + router_params(shape) + shared_expert_params(shape) / tp
    moe_mem = (moe_dense_params * dense_bytes
               + shape.num_routed_experts * expert_params(shape) / (layout.ep * layout.etp) * expert_bytes)
    vocab_mem = v * h / tp * dense_bytes
    per_token = tokens * activation_bytes / tp
    if recompute:
        base_act = moe_act = h * per_token
    else:
        base_act = 34 * h * per_token
        moe_act = base_act + shape.top_k * (h + 3 * shape.moe_intermediate) * per_token
    recompute_factor = 3.0 if recompute else 2.0

    def unit(name, kind, fwd_flops, memory, act, backward_factor=recompute_factor, layer=-1):
        fwd = fwd_flops * tokens / tp / flops_per_second
        return Unit(name, kind, fwd, backward_factor * fwd, memory, act, layer)

    # the lookup costs no FLOPs; its backward is a scatter-add of h values per token
    emb_flops = 2 * h * (2 if options.mtp_embedding_on_first_stage and shape.mtp_depth else 1)
    units = [unit("embedding", "embedding", emb_flops, vocab_mem, h * per_token, 1.0)]
    for i in range(shape.num_layers):
        if i < shape.first_k_dense:
            mem = (attn_params + dense_ffn_params(shape) / tp) * dense_bytes
            units.append(unit(f"L{i}", "dense", attn_fwd + 2 * dense_ffn_params(shape), mem, base_act, layer=i))
        else:
            units.append(unit(f"L{i}", "moe", attn_fwd + moe_ffn_flops(shape), moe_mem, moe_act, layer=i))
    head_act = 2 * v * per_token  # fp32 logits for the loss
    for d in range(shape.mtp_depth):
        mem = (3 * h + 2 * h * h / tp) * dense_bytes + moe_mem
        if options.mtp_apart_from_head:
            mem += vocab_mem  # its own copy of the shared output head
        if not options.mtp_embedding_on_first_stage:
            mem += vocab_mem  # its own copy of the shared embedding table
        flops = 2 * 2 * h * h + attn_fwd + moe_ffn_flops(shape) + head_flops(shape)
        units.append(unit(f"mtp{d}" if shape.mtp_depth > 1 else "mtp", "mtp", flops, mem, moe_act + head_act))
    units.append(unit("head", "head", head_flops(shape), vocab_mem + h * dense_bytes, head_act, 2.0))
    return units
