"""The mixed-integer program of `parallel.pipeline.placement.balance` (its docstring says what it minimises and how
the cuts are modelled), built once: its variables (cut positions and offsets, per-segment counts of each recompute
choice, the objectives' maxima, the memory's transient and presence indicators), its rows, and the linear
expressions of the prefix sums at each cut. `balance` solves it in passes and reads the placement back.

Variables and rows are made in one fixed order, so the same inputs give the same program, and HiGHS the same
placement.
"""
from __future__ import annotations

import math

import numpy as np

from parallel.pipeline.schedules import ChunkLayout

# A linear expression: (coefficient per variable, constant); a row: (coefficients, lower bound, upper bound).
Expr = tuple[dict[int, float], float]


class StageProgram:
    """`units`: the chain (placement.Unit); `profiles`: per stage the rows of micro-batches each chunk holds at once
    (placement._profiles); `runs`: (start, length) of the runs of identical units (placement._runs); `terms`: the
    step's (period, forward, backward) weights (placement.step_terms) when `options.micro_batches` is set."""

    def __init__(self, units: tuple, stages: int, chunks: int, options, profiles, runs, terms, tie_breaks: bool):
        self.units, self.stages, self.chunks, self.options = units, stages, chunks, options
        self.profiles, self.runs, self.tie_breaks = profiles, runs, tie_breaks
        self.n, self.segs = len(units), stages * chunks
        self.v_shape = options.chunk_layout is ChunkLayout.V
        self.where = [options.chunk_layout.stage_and_chunk(stages, k) for k in range(self.segs)]  # -> (stage, chunk)
        self.on_stage = [[options.chunk_layout.virtual_stage(stages, s, c) for c in range(chunks)]
                         for s in range(stages)]
        self.chosen = [r for r, (start, _) in enumerate(runs) if units[start].choices]  # runs picking a choice
        self.rows: list[tuple[dict[int, float], float, float]] = []
        self.integrality: list[int] = []
        self.upper: list[float] = []
        self.holding: dict[int, list[int]] = {}
        self.limited = math.isfinite(options.memory_limit)
        self._prefixes()
        self._cut_bounds()
        self._variables()
        self._cut_rows()
        self._segment_rows()
        if self.limited:
            self._transient_rows()
        self._stage_rows()
        self._mtp_rows()
        self._choice_rows()
        self._goal(terms)
        self.nv = len(self.upper)

    def var(self, up: float, integer: bool = True) -> int:
        self.integrality.append(int(integer))
        self.upper.append(up)
        return len(self.upper) - 1

    def _prefixes(self) -> None:
        units, n = self.units, self.n
        self.fixed = np.array([float(not u.choices) for u in units])  # chosen units' time and activations: counts
        # HiGHS works to absolute tolerances: scale times to at most 1 and memory to the limit
        self.t_scale = max(max(x.time for u in units for x in (u, *u.choices)), np.finfo(float).tiny)
        t = np.array([u.time for u in units]) * self.fixed / self.t_scale
        limit = self.options.memory_limit
        self.mem_scale = limit if math.isfinite(limit) else 1.0
        w = np.array([u.weight_memory for u in units]) / self.mem_scale
        a = np.array([u.activation_memory for u in units]) * self.fixed / self.mem_scale
        prefix = {name: np.concatenate([[0.0], np.cumsum(x)]) for name, x in (("t", t), ("w", w), ("a", a))}
        prefix["pos"] = np.arange(n + 1, dtype=float)
        prefix["layers"] = np.concatenate([[0.0], np.cumsum([u.kind in ("dense", "moe") for u in units])])
        for r in self.chosen:
            start, length = self.runs[r]
            prefix[r] = np.concatenate([[0.0], np.cumsum((np.arange(n) >= start) & (np.arange(n) < start + length))])
        self.prefix = prefix

    def _cut_bounds(self) -> None:
        """lo[k]..hi[k]: the positions cut k can take under the rows below (every segment holds a unit, and a layer
        with even chunks; the dense layers in the first segment; MTP in the head's), cut k starting segment k."""
        units, options, n, segs = self.units, self.options, self.n, self.segs
        layers = [i for i, u in enumerate(units) if u.kind in ("dense", "moe")]
        self.dense = [i for i, u in enumerate(units) if u.kind == "dense"]
        self.mtps = [i for i, u in enumerate(units) if u.kind == "mtp"]
        mtp_with_head = bool(self.mtps) and units[-1].kind == "head" and not options.mtp_apart_from_head
        lo, hi = np.arange(segs + 1), n - np.arange(segs, -1, -1)
        self.bare = bare = options.even_chunks and options.bare_ends
        for k in range(1, segs):
            if options.even_chunks and len(layers) >= segs - 2 * bare:
                before, after = k - bare, segs - k - bare  # the layers the segments before and after cut k hold
                if before > 0:
                    lo[k] = max(lo[k], layers[before - 1] + 1)
                if after > 0:
                    hi[k] = min(hi[k], layers[len(layers) - after])
            if options.dense_in_first_segment and self.dense:
                lo[k] = max(lo[k], self.dense[-1] + k)
            if mtp_with_head:
                hi[k] = min(hi[k], min(self.mtps) - (segs - 1 - k))
        self.lo, self.hi = lo, hi

    def _variables(self) -> None:
        """Per internal cut k and run r: in_run (binary), offset inside the run (integer). A cut whose positions
        all lie in one run with choices (its end included: the prefixes stay linear up to it) takes neither: its
        offset is the run's units counted in the segments before. With the planner's options every cut is such,
        and the program is the count program: per segment and choice a count, the counts of a run adding up to its
        length."""
        runs, lo, hi, segs = self.runs, self.lo, self.hi, self.segs
        self.cut_vars: dict[int, dict[int, tuple[int | None, int | None]]] = {}
        for k in range(1, segs):
            whole = [r for r in self.chosen if runs[r][0] <= lo[k] <= hi[k] <= sum(runs[r])]
            self.cut_vars[k] = ({whole[0]: (None, None)} if whole else
                                {r: (self.var(1.0), self.var(length - 1.0)) for r, (_, length) in enumerate(runs)})
        if self.tie_breaks:
            self.z = self.var(np.inf, integer=False)
            self.floor = self.var(np.inf, integer=False)  # the fastest stage's time, raised in the last pass
            self.largest = self.var(np.inf, integer=False)  # the slowest segment (chunk of a stage): second pass
        self.chunk_max = [] if self.v_shape else [self.var(np.inf, integer=False) for _ in range(self.chunks)]
        self.period = self.var(np.inf, integer=False)
        # per segment and run with choices: how many of the run's units in the segment take each choice
        self.picks = {(k, r): [self.var(float(runs[r][1])) for _ in self.units[runs[r][0]].choices]
                      for k in range(segs) for r in self.chosen if self.holds(k, r)}
        self.counted = {r for cut in self.cut_vars.values() for r, (_, offset) in cut.items() if offset is None}

    def holds(self, k: int, r: int) -> bool:
        """Whether segment k can hold units of run r."""
        start, length = self.runs[r]
        return start < self.hi[k + 1] and self.lo[k] < start + length

    def at(self, k: int, what) -> Expr:
        """prefix[what] at cut k as a linear expression."""
        segs, runs, picks = self.segs, self.runs, self.picks
        if k == 0:
            return {}, float(self.prefix[what][0])
        if k == segs:  # the end, less each counted run's units plus their counts (the same, by the rows on counts):
            acc, const = {}, float(self.prefix[what][self.n])  # then the last segment's differences cancel
            for r in self.counted:
                start, length = runs[r]
                slope = self.prefix[what][start + 1] - self.prefix[what][start]
                const -= slope * length
                acc.update({x: slope for j in range(segs) for x in picks.get((j, r), ())})
            return acc, const
        acc, const = {}, 0.0
        pre = self.prefix[what]
        for r, (in_run, offset) in self.cut_vars[k].items():
            start = runs[r][0]
            if in_run is None:
                const = float(pre[start])
            else:
                acc[in_run] = pre[start]
            for x in [offset] if offset is not None else [x for j in range(k) for x in picks.get((j, r), ())]:
                acc[x] = pre[start + 1] - pre[start]
        return acc, const

    def segment(self, k: int, what: str) -> list[tuple[float, Expr]]:
        """Segment k's time ('t') or activations ('a'): its fixed units' and its chosen counts'."""
        terms = [(1.0, self.at(k + 1, what)), (-1.0, self.at(k, what))]
        for r in self.chosen:
            for x, c in zip(self.picks.get((k, r), ()), self.units[self.runs[r][0]].choices):
                terms.append((c.time / self.t_scale if what == "t" else c.activation_memory / self.mem_scale,
                              ({x: 1.0}, 0.0)))
        return terms

    def add(self, terms: list[tuple[float, Expr]], low: float, up: float) -> None:
        acc: dict[int, float] = {}
        const = 0.0
        for coef, (expr, c0) in terms:
            for j, v in expr.items():
                acc[j] = acc.get(j, 0.0) + coef * v
            const += coef * c0
        acc = {j: v for j, v in acc.items() if v}
        if acc or not low <= const <= up:  # a difference of counted cuts may cancel out
            self.rows.append((acc, low - const, up - const))

    def containing(self, j: int) -> list[int]:
        """One binary per segment, 1 for the segment that holds unit j."""
        if j in self.holding:
            return self.holding[j]
        g = self.holding[j] = [self.var(1.0) for _ in range(self.segs)]
        self.rows.append(({x: 1.0 for x in g}, 1.0, 1.0))
        for k, x in enumerate(g):
            self.add([(1.0, self.at(k, "pos")), (self.n - j, ({x: 1.0}, 0.0))], -np.inf, float(self.n))  # starts
            self.add([(1.0, self.at(k + 1, "pos")), (-(j + 1.0), ({x: 1.0}, 0.0))], 0.0, np.inf)  # ends after j
        return g

    def _cut_rows(self) -> None:
        for k in range(1, self.segs):
            if None in (in_run for in_run, _ in self.cut_vars[k].values()):
                continue
            self.rows.append(({in_run: 1.0 for in_run, _ in self.cut_vars[k].values()}, 1.0, 1.0))
            for r, (in_run, offset) in self.cut_vars[k].items():
                self.rows.append(({offset: 1.0, in_run: -(self.runs[r][1] - 1.0)}, -np.inf, 0.0))

    def _segment_rows(self) -> None:
        """Every segment holds at least one unit, and at most its chunk's slowest time."""
        for k in range(self.segs):
            self.add([(1.0, self.at(k + 1, "pos")), (-1.0, self.at(k, "pos"))], 1.0, np.inf)
            if not self.v_shape:
                self.add(self.segment(k, "t") + [(-1.0, ({self.chunk_max[self.where[k][1]]: 1.0}, 0.0))], -np.inf,
                         0.0)
            if self.tie_breaks and self.chunks > 1:
                self.add(self.segment(k, "t") + [(-1.0, ({self.largest: 1.0}, 0.0))], -np.inf, 0.0)
        if not self.v_shape:
            self.rows.append(({self.period: 1.0, **{x: -1.0 for x in self.chunk_max}}, 0.0, 0.0))

    def _transient_rows(self) -> None:
        """A stage holds the largest transient of its units: tr_s >= transient of every run reaching stage s. The
        runs reaching a segment are those between the runs holding its first and last unit, so the run's first and
        last unit each get a segment indicator and the run covers segments from the one to the other. With choices
        a segment holds one of the units it can hold, and all those it must: its stage's transient is at least the
        least of the one and the largest of the others, and only a choice exceeding that takes a binary (per
        stage, as the count program: with the planner's options only full recompute's)."""
        units, runs, lo, hi, segs, mem_scale = self.units, self.runs, self.lo, self.hi, self.segs, self.mem_scale
        tau = np.array([u.transient for u in units]) / mem_scale
        least = np.array([min(x.transient for x in (u, *u.choices)) for u in units]) / mem_scale
        low = least.min()
        floors = [max(least[lo[k]:hi[k + 1]].min(), max(least[hi[k]:lo[k + 1]], default=low)) for k in range(segs)]
        tr_low = [max(floors[k] for k in self.on_stage[s]) if self.chosen else low for s in range(self.stages)]
        self.tr = tr = [self.var(np.inf, integer=False) for _ in range(self.stages)]
        for x, floor_s in zip(tr, tr_low):
            self.rows.append(({x: 1.0}, floor_s, np.inf))
        for r, (start, length) in enumerate(runs):
            if tau[start] <= low or r in self.chosen:
                continue
            first = self.containing(start)
            last = first if length == 1 else self.containing(start + length - 1)
            for k in range(segs):
                covers = {x: 1.0 for x in first[:k + 1]}
                for x in last[:k]:
                    covers[x] = covers.get(x, 0.0) - 1.0
                self.add([(1.0, ({tr[self.where[k][0]]: 1.0}, 0.0)), (-tau[start], (covers, 0.0))], 0.0, np.inf)
        for r in self.chosen:  # a choice present on a stage raises its transient
            for s in range(self.stages):
                ks = [k for k in self.on_stage[s] if (k, r) in self.picks]
                for i, c in enumerate(units[runs[r][0]].choices):
                    if ks and c.transient / mem_scale > tr_low[s]:
                        present = self.var(1.0)
                        self.rows.append(({**{self.picks[k, r][i]: 1.0 for k in ks}, present: -float(runs[r][1])},
                                          -np.inf, 0.0))
                        self.rows.append(({tr[s]: 1.0, present: -c.transient / mem_scale}, 0.0, np.inf))

    def _stage_rows(self) -> None:
        """Each stage's time under the period (DualPipeV), the slowest stage and above the fastest; its memory under
        the limit at every row of its held micro-batches."""
        for s in range(self.stages):
            ks = self.on_stage[s]  # in chunk order, as the profiles' columns
            stage_time = [term for k in ks for term in self.segment(k, "t")]
            if self.v_shape:
                self.add(stage_time + [(-1.0, ({self.period: 1.0}, 0.0))], -np.inf, 0.0)
            if self.tie_breaks:
                self.add(stage_time + [(-1.0, ({self.z: 1.0}, 0.0))], -np.inf, 0.0)
                self.add(stage_time + [(-1.0, ({self.floor: 1.0}, 0.0))], 0.0, np.inf)
            for held in self.profiles[s] if self.limited else ():
                terms = [(1.0, ({self.tr[s]: 1.0}, 0.0))]
                for c, k in enumerate(ks):
                    terms += [(1.0, self.at(k + 1, "w")), (-1.0, self.at(k, "w"))]
                    terms += [(held[c] * coef, expr) for coef, expr in self.segment(k, "a")]
                self.add(terms, -np.inf, 1.0)

    def _mtp_rows(self) -> None:
        units, mtps, segs = self.units, self.mtps, self.segs
        if mtps and units[-1].kind == "head":
            if self.options.mtp_apart_from_head:  # the head's stage p-1 holds no MTP
                for j in mtps:
                    g = self.containing(j)
                    for k in self.on_stage[self.where[segs - 1][0]]:
                        self.upper[g[k]] = 0.0
            elif segs > 1 and max(sum(self.runs[r]) for r in self.cut_vars[segs - 1]) > min(mtps):
                self.add([(1.0, self.at(segs - 1, "pos"))], -np.inf, float(min(mtps)))  # MTP in the last segment

    def _choice_rows(self) -> None:
        """The choices' counts, the dense layers in the first segment, the chunks of a stage within a layer."""
        options, runs, segs, at = self.options, self.runs, self.segs, self.at
        for (k, r), xs in self.picks.items():  # the counts of a segment's choices add up to its units of the run
            self.add([(1.0, at(k + 1, r)), (-1.0, at(k, r))] + [(-1.0, ({x: 1.0}, 0.0)) for x in xs], 0.0, 0.0)
        for r in self.counted:  # and those of a counted run to its length
            self.rows.append(({x: 1.0 for (_, q), xs in self.picks.items() if q == r for x in xs}, runs[r][1],
                              runs[r][1]))
        dense = self.dense
        if options.dense_in_first_segment and dense and segs > 1 and \
                min(runs[r][0] for r in self.cut_vars[1]) <= dense[-1]:
            self.add([(1.0, at(1, "pos"))], dense[-1] + 1.0, np.inf)
        if options.even_chunks:
            for s in range(self.stages):
                q = self.var(np.inf)  # the fewest layers of the stage's chunks (but an end's)
                for k in self.on_stage[s]:
                    layers = [(1.0, at(k + 1, "layers")), (-1.0, at(k, "layers"))]
                    end = self.bare and k in (0, segs - 1)
                    self.add(layers, 0.0 if end else 1.0, np.inf)
                    self.add(layers + [(-1.0, ({q: 1.0}, 0.0))], -np.inf if end or k == segs - 1 else 0.0, 1.0)

    def _goal(self, terms) -> None:
        """The first pass's objective: the period, or with micro_batches the step (step_terms' weights on the
        period, forward and backward work)."""
        self.goal = self.period
        if self.options.micro_batches:
            self.goal = self.var(np.inf, integer=False)
            on_period, on_fwd, on_bwd = terms

            def work(u) -> float:
                return (on_fwd * u.forward + on_bwd * u.backward) / self.t_scale

            picked = {x: -work(c) for (_, r), xs in self.picks.items()
                      for x, c in zip(xs, self.units[self.runs[r][0]].choices)}
            fixed_work = sum(work(u) for u, f in zip(self.units, self.fixed) if f)
            self.rows.append(({self.goal: 1.0, self.period: -on_period, **picked}, fixed_work, fixed_work))

    def matrix(self):
        """(the rows as a CSR matrix, their lower bounds, their upper bounds)."""
        from scipy.sparse import lil_matrix
        mat = lil_matrix((len(self.rows), self.nv))
        lo, hi = np.empty(len(self.rows)), np.empty(len(self.rows))
        for i, (acc, low, up) in enumerate(self.rows):
            for j, v in acc.items():
                mat[i, j] = v
            lo[i], hi[i] = low, up
        return mat.tocsr(), lo, hi

    def value(self, terms: list[tuple[float, Expr]], x: np.ndarray) -> float:
        return sum(coef * (c0 + sum(c * x[j] for j, c in expr.items())) for coef, (expr, c0) in terms)

    def cuts(self, x: np.ndarray) -> list[int]:
        """The cut positions of a solution whose integers are rounded."""
        out = []
        for k in range(self.segs + 1):
            expr, const = self.at(k, "pos")
            out.append(int(round(const + sum(c * x[j] for j, c in expr.items()))))
        return out
