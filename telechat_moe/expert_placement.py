"""Dynamic expert placement in the trainer (`expert_placement.interval > 0`, expert_parallel > 1).

Every step the global router load of this rank's MoE layers goes into a `LoadWindow` (by the experts' original
ids); each completed window feeds the `LoadPredictor`. Every `interval` steps, after the optimizer update and
before the checkpoint, each layer gets a `plan_migration` (parallel/ep/migration_plan.py: one copy per expert, the
slots of the EP ranks fixed, the moves priced over this machine's links with the cluster file, the expert time per
token from the model's FLOPs and the peak FLOP/s) on the forecast (before the first window: the load so far); an
accepted plan is applied by `parallel/ep/migrate.py` as a relabelling: the experts' weights and both Adam moments
move to their new EP ranks, the router's rows, bias and their moments are permuted alike, so the model computes the
same function with every expert on its new rank (the dispatchers send label e to rank e // (E/ep)).

`labels[router][label]` is the original id of the expert holding that label (identity at the start), kept in the
checkpoint's trainer state; tensor dumps put expert-indexed tensors back in original order with it, so a run that
migrated compares with one that did not. Group-limited routing (n_group > 1) is refused by the recipe check: it
groups experts by label.

With `spare_slots` R > 0 the plans may replicate hot experts (`plan_migration(replicas=True)`): each expert keeps
one home copy, placed and labelled as above (`parallel.ep.migrate.homes` picks which copy), and its other copies go
to spare slots, weights and Adam moments copied from the home copy, with the slot tables of
telechat_moe/moe/replicas.py telling the dispatchers where a label's copies are. `spares[router]` [ep, R] holds the
original ids of the spare slots' experts (-1: empty), kept in the trainer state; a resume at the same ep and R
rebuilds the replicas from it, at another the placement starts without replicas.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from mindspore import Tensor, ops

from parallel.ep.migrate import homes, moved_rows, permute_replicated, permuted_whole, relabelling
from parallel.ep.load import LoadPredictor, LoadWindow
from parallel.ep.migration_plan import MoveCost, plan_migration
from parallel.ep.placement import Placement, expert_flops_per_token
from parallel.optim.state import Overwrite
from telechat_moe.moe.replicas import slot_tables
from telechat_moe.optimizer_state import SlicedMoments
from telechat_moe.workload import device_cluster


@dataclass
class Decision:
    """One decision step over this rank's layers."""
    layers_moved: int = 0
    experts_moved: int = 0        # home copies that changed rank
    replicas_made: int = 0        # spare slots given another expert's copy
    bytes: float = 0.0            # weights and Adam moments sent: experts that changed rank, replicas made
    seconds: float = 0.0          # planning and moving, measured
    imbalance_before: float = 1.0  # max/mean EP-rank load on the forecast, mean over the layers
    imbalance_after: float = 1.0
    kept: list = field(default_factory=list)     # "router R: why" of each layer not re-placed


class ExpertMigrator:
    """See the module docstring. `routers`: this rank's router indices (rows of the step's load), `mlps` their MoE
    cells; `transport`: the EP group's; `index`: this rank's place in it."""

    def __init__(self, recipe, routers: list[int], mlps: list, optimizer, transport, index: int,
                 ranks_per_node: int, peak_flops: float):
        cfg, x = recipe.model, recipe.expert_placement
        self.config, self.routers, self.transport, self.index = x, routers, transport, index
        self.experts, self.ep, self.spare = cfg.n_routed_experts, recipe.layout.ep, x.spare_slots
        self.per = self.experts // self.ep
        self.dpn = ranks_per_node
        self.window = LoadWindow(len(routers), self.experts, x.window)
        self.predictor = LoadPredictor()
        self.forecasts = 0
        self.labels = np.tile(np.arange(self.experts), (len(routers), 1))
        self.spares = np.full((len(routers), self.ep, self.spare), -1)
        self.tables = [slot_tables(self.experts, self.ep, s) for s in self.spares]
        expert_params = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        self.cost = MoveCost.from_cluster(device_cluster(recipe), expert_params)
        self.seconds_per_token = expert_flops_per_token(cfg.hidden_size, cfg.moe_intermediate_size) / peak_flops
        # a weight's Adam moments: Parameters of the replicated optimizer, or (weight, kind) entries of the
        # distributed one's slices (with its float32 master below float32 weights, moved alike), read and written
        # through telechat_moe/optimizer_state.py
        self.moments = SlicedMoments(optimizer) if hasattr(optimizer, "plan") else None
        moments = {id(p): (m, v) for p, m, v in zip(optimizer.parameters, optimizer.exp_avg, optimizer.exp_avg_sq)} \
            if self.moments is None else {id(p): tuple((p, kind) for kind in self.moments.kinds)
                                          for p in optimizer.parameters}
        self.replicated, self.sharded, self.writers, self.sliced, self.indexed = [], [], [], [], {}
        for r, mlp in enumerate(mlps):
            whole = [mlp.gate.weight, mlp.gate.expert_bias]
            split = [mlp.experts.w1, mlp.experts.w2]
            for p in whole[:1] + split:       # the bias has no moments: it is not trained
                self.indexed[p.name] = r
            whole += [m for p in whole[:1] for m in moments[id(p)]]
            split += [m for p in split for m in moments[id(p)]]
            # each spare tensor beside the home tensor it copies rows of, then the slot tables
            spare = ([mlp.experts.w1_spare, mlp.experts.w2_spare] + [m for p in (mlp.experts.w1_spare,
                     mlp.experts.w2_spare) for m in moments[id(p)]]) if self.spare else []
            tables = [mlp.slots.copies, mlp.slots.targets, mlp.slots.slot_label] if self.spare else []
            self.replicated.append(whole)
            self.sharded.append(split)
            targets = whole + split + spare + tables
            self.writers.append(Overwrite([t for t in targets if not isinstance(t, tuple)]))
            self.sliced.append([(i, t) for i, t in enumerate(targets) if isinstance(t, tuple)])
        self.total = Decision()   # over the run: layers and experts moved, replicas, bytes, seconds

    # -- the load --
    def observe(self, loads: np.ndarray, step: int) -> None:
        """loads [all routers, E]: step's global load per label."""
        original = np.zeros((len(self.routers), self.experts))
        for r, row in enumerate(self.routers):
            original[r, self.labels[r]] = loads[row]
        if self.window.append(original, step):
            self.predictor.observe(self.window.total())
            self.forecasts += 1

    def over_ranks(self, value: float) -> np.ndarray:
        """A float of every EP rank, in the group's order (one all-gather)."""
        return self.transport.all_gather(Tensor(np.array([value], np.float32))).asnumpy()

    def imbalance(self, loads: np.ndarray) -> np.ndarray:
        """max/mean EP-rank load of this step's loads [all routers, E] (by label; a replicated expert's load split
        evenly between its copies, as the dispatchers split it), per router of this rank."""
        out = []
        for r, row in enumerate(self.routers):
            copies, _, slot_label = self.tables[r]
            per_copy = np.append(loads[row] / copies, 0.0)          # label E: an empty spare slot
            ranks = per_copy[slot_label].reshape(self.ep, -1).sum(1)
            out.append(ranks.max() / max(ranks.mean(), 1e-12))
        return np.array(out)

    # -- decisions --
    def due(self, step: int) -> bool:
        return bool(self.config.interval) and step % self.config.interval == 0 and self.window.size > 0

    def decide(self) -> Decision:
        """Plan every layer's migration on the forecast and apply the accepted ones (every rank of the EP group
        calls it at the same step: the plans are functions of the global load, alike on every rank)."""
        start = time.perf_counter()
        forecast = self.predictor.predict() if self.forecasts else self.window.mean() * self.config.window
        out = Decision()
        before, after = [], []
        for r in range(len(self.routers)):
            plan = self._plan(self.slots(r), forecast[r], self.spare > 0)
            placed = homes(plan.placement.slot_expert, self.per) if plan.accepted else None
            if plan.accepted and placed is None:
                # a rank left with fewer than E/ep experts has no home for each: plan the home slots alone, and
                # drop the replicas
                plan = self._plan(self.slots(r)[:, :self.per], forecast[r], False)
                placed = homes(plan.placement.slot_expert, self.per) if plan.accepted else None
            before.append(plan.current.imbalance)
            after.append(plan.placement.imbalance)
            if placed is None:
                out.kept.append(f"router {self.routers[r]}: {plan.reason}")
                continue
            home, spare = placed[0], np.full((self.ep, self.spare), -1)
            spare[:, :placed[1].shape[1]] = placed[1]
            perm = relabelling(self.labels[r], home)
            made = int(np.count_nonzero((spare >= 0) & (spare != self.spares[r])))
            self._apply(r, perm, spare)
            self.labels[r] = home.reshape(-1)
            moved = moved_rows(perm, self.ep)
            out.layers_moved += 1
            out.experts_moved += moved
            out.replicas_made += made
            out.bytes += (moved + made) * self.cost.expert_bytes
        out.imbalance_before, out.imbalance_after = float(np.mean(before)), float(np.mean(after))
        out.seconds = time.perf_counter() - start
        for name in ("layers_moved", "experts_moved", "replicas_made", "bytes", "seconds"):
            setattr(self.total, name, getattr(self.total, name) + getattr(out, name))
        return out

    def slots(self, r: int) -> np.ndarray:
        """[ep, E/ep + R]: the original id of the expert in each slot (home slots, then spare; -1: empty)."""
        return np.concatenate((self.labels[r].reshape(self.ep, self.per), self.spares[r]), 1)

    def _plan(self, slots: np.ndarray, forecast: np.ndarray, replicas: bool):
        t = self.config.threshold
        return plan_migration(Placement.from_slots(slots, self.dpn, forecast), forecast, cost=self.cost,
                              seconds_per_token=self.seconds_per_token, replicas=replicas, threshold_intra=t,
                              threshold_inter=t)

    def _apply(self, r: int, perm: np.ndarray, spare: np.ndarray) -> None:
        """Relabel by `perm` and fill the spare slots with copies of `spare` [ep, R] (original ids, -1: empty)."""
        values = [permute_replicated(self._read(p), perm) for p in self.replicated[r]]
        mine = slice(self.index * self.per, (self.index + 1) * self.per)
        wholes = [permuted_whole(self.transport, self._read(p), perm) for p in self.sharded[r]]
        values += [w[mine] for w in wholes]
        if self.spare:
            label_of = np.empty(self.experts, np.int64)
            label_of[self.labels[r][perm]] = np.arange(self.experts)     # the new labels' experts
            spare_labels = np.where(spare >= 0, label_of[np.maximum(spare, 0)], -1)
            held = spare_labels[self.index]
            values += [np.where((held >= 0).reshape((-1,) + (1,) * (w.ndim - 1)), w[np.maximum(held, 0)], 0)
                       .astype(w.dtype) for w in wholes]
            self.tables[r] = slot_tables(self.experts, self.ep, spare_labels)
            values += list(self.tables[r])
            self.spares[r] = spare
        self._write(r, values)

    def _read(self, entry) -> np.ndarray:
        return entry.asnumpy() if self.moments is None or not isinstance(entry, tuple) else self.moments.read(*entry)

    def _write(self, r: int, values: list) -> None:
        """Layer r's tensors := `values`: Parameters through an assignment in a graph, the distributed optimizer's
        state into its slices."""
        sliced = dict(self.sliced[r])
        self.writers[r](*[Tensor(v) for i, v in enumerate(values) if i not in sliced]).asnumpy()
        for i, (weight, kind) in sliced.items():
            self.moments.write(weight, kind, values[i])

    # -- names, state --
    def original_order(self, name: str, value: np.ndarray) -> np.ndarray:
        """A whole expert-indexed tensor (weights, router rows, their moments; by parameter name) with its rows in
        the experts' original order; anything else as it is."""
        r = self.indexed.get(name)
        if r is None:
            return value
        out = np.empty_like(value)
        out[self.labels[r]] = value
        return out

    def state_dict(self) -> dict:
        """The labels (any layout can take them) and the spare slots' experts (this ep and R only)."""
        out = {"expert_labels": {str(row): self.labels[r].tolist() for r, row in enumerate(self.routers)}}
        if self.spare:
            out["expert_spares"] = {str(row): self.spares[r].tolist() for r, row in enumerate(self.routers)}
        return out

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's trainer state (of a run that never migrated: no labels, identity). Its replicas, when it
        was saved at this ep with as many spare slots, copied again from their home experts (collective: every
        rank of the EP group calls it)."""
        labels, spares = state.get("expert_labels") or {}, state.get("expert_spares") or {}
        for r, row in enumerate(self.routers):
            if str(row) in labels:
                self.labels[r] = np.asarray(labels[str(row)], np.int64)
            saved = np.asarray(spares.get(str(row), []), np.int64)
            if self.spare and saved.shape == self.spares[r].shape:
                self._apply(r, np.arange(self.experts), saved)
