"""Dynamic expert placement in the trainer (`expert_placement.interval > 0`, expert_parallel > 1).

Every step the global router load of this rank's MoE layers goes into a `LoadWindow` (by the experts' original
ids); each completed window feeds the `LoadPredictor`. Every `interval` steps, after the optimizer update and
before the checkpoint, each layer gets a `plan_migration` (parallel/ep/placement.py: one copy per expert, the
slots of the EP ranks fixed, the moves priced over this machine's links with the cluster file, the expert time per
token from the model's FLOPs and the peak FLOP/s) on the forecast (before the first window: the load so far); an
accepted plan is applied by `parallel/ep/migrate.py` as a relabelling: the experts' weights and both Adam moments
move to their new EP ranks, the router's rows, bias and their moments are permuted alike, so the model computes the
same function with every expert on its new rank (the dispatchers send label e to rank e // (E/ep)).

`labels[router][label]` is the original id of the expert holding that label (identity at the start), kept in the
checkpoint's trainer state; tensor dumps put expert-indexed tensors back in original order with it, so a run that
migrated compares with one that did not. Group-limited routing (n_group > 1) is refused by the recipe check: it
groups experts by label.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from mindspore import ParameterTuple, Tensor, nn, ops

from parallel.ep.migrate import moved_rows, permute_replicated, permute_sharded, relabelling
from parallel.ep.placement import LoadPredictor, LoadWindow, MoveCost, Placement, expert_flops_per_token, \
    plan_migration


class Overwrite(nn.Cell):
    """New values into parameters inside a graph: Parameter.set_data between calls of the graphs that use a
    parameter was not seen by them on MindSpore 2.9 (see TrainStep), an assignment inside a graph is."""

    def __init__(self, params: list):
        super().__init__(auto_prefix=False)
        self.params = ParameterTuple(params)

    def construct(self, *values):
        for i in range(len(self.params)):
            ops.assign(self.params[i], values[i])
        return values[0]


@dataclass
class Decision:
    """One decision step over this rank's layers."""
    layers_moved: int = 0
    experts_moved: int = 0
    bytes: float = 0.0            # weights and Adam moments of the experts that changed rank
    seconds: float = 0.0          # planning and moving, measured
    imbalance_before: float = 1.0  # max/mean EP-rank load on the forecast, mean over the layers
    imbalance_after: float = 1.0


class ExpertMigrator:
    """See the module docstring. `routers`: this rank's router indices (rows of the step's load), `mlps` their MoE
    cells; `transport`: the EP group's; `index`: this rank's place in it."""

    def __init__(self, recipe, routers: list[int], mlps: list, optimizer, transport, index: int,
                 ranks_per_node: int, peak_flops: float):
        cfg, x = recipe.model, recipe.expert_placement
        self.config, self.routers, self.transport, self.index = x, routers, transport, index
        self.experts, self.ep = cfg.n_routed_experts, recipe.layout.ep
        self.per = self.experts // self.ep
        self.dpn = ranks_per_node
        self.window = LoadWindow(len(routers), self.experts, x.window)
        self.predictor = LoadPredictor()
        self.forecasts = 0
        self.labels = np.tile(np.arange(self.experts), (len(routers), 1))
        expert_params = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        cluster = "ascend910b" if recipe.context.device_target == "Ascend" else "cpu"
        self.cost = MoveCost.from_cluster(cluster, expert_params)
        self.seconds_per_token = expert_flops_per_token(cfg.hidden_size, cfg.moe_intermediate_size) / peak_flops
        moments = {id(p): (m, v) for p, m, v in zip(optimizer.parameters, optimizer.exp_avg, optimizer.exp_avg_sq)}
        self.replicated, self.sharded, self.writers, self.indexed = [], [], [], {}
        for r, mlp in enumerate(mlps):
            whole = [mlp.gate.weight, mlp.gate.expert_bias]
            split = [mlp.experts.w1, mlp.experts.w2]
            for p in whole[:1] + split:       # the bias has no moments: it is not trained
                self.indexed[p.name] = r
            whole += [m for p in whole[:1] for m in moments[id(p)]]
            split += [m for p in split for m in moments[id(p)]]
            self.replicated.append(whole)
            self.sharded.append(split)
            self.writers.append(Overwrite(whole + split))
        self.total = Decision()   # over the run: layers and experts moved, bytes, seconds

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

    def imbalance(self, loads: np.ndarray) -> float:
        """max/mean EP-rank load of this step's loads [all routers, E] (labels: rank = label // per), mean over
        this rank's layers."""
        ranks = loads[self.routers].reshape(len(self.routers), self.ep, self.per).sum(-1)
        return float(np.mean(ranks.max(1) / np.maximum(ranks.mean(1), 1e-12)))

    # -- decisions --
    def due(self, step: int) -> bool:
        return bool(self.config.interval) and step % self.config.interval == 0 and self.window.size > 0

    def decide(self) -> Decision:
        """Plan every layer's migration on the forecast and apply the accepted ones (every rank of the EP group
        calls it at the same step: the plans are functions of the global load, alike on every rank)."""
        start = time.perf_counter()
        forecast = self.predictor.predict() if self.forecasts else self.window.mean() * self.config.window
        t = self.config.threshold
        out = Decision()
        before, after = [], []
        for r in range(len(self.routers)):
            current = Placement.from_slots(self.labels[r].reshape(self.ep, self.per), self.dpn, forecast[r])
            plan = plan_migration(current, forecast[r], cost=self.cost, seconds_per_token=self.seconds_per_token,
                                  replicas=False, threshold_intra=t, threshold_inter=t)
            before.append(plan.current.imbalance)
            after.append(plan.placement.imbalance)
            if not plan.accepted:
                continue
            perm = relabelling(self.labels[r], plan.placement.slot_expert)
            self._apply(r, perm)
            self.labels[r] = plan.placement.slot_expert.reshape(-1)
            moved = moved_rows(perm, self.ep)
            out.layers_moved += 1
            out.experts_moved += moved
            out.bytes += moved * self.cost.expert_bytes
        out.imbalance_before, out.imbalance_after = float(np.mean(before)), float(np.mean(after))
        out.seconds = time.perf_counter() - start
        for name in ("layers_moved", "experts_moved", "bytes", "seconds"):
            setattr(self.total, name, getattr(self.total, name) + getattr(out, name))
        return out

    def _apply(self, r: int, perm: np.ndarray) -> None:
        values = [permute_replicated(p.asnumpy(), perm) for p in self.replicated[r]]
        values += [permute_sharded(self.transport, p.asnumpy(), perm, self.index) for p in self.sharded[r]]
        self.writers[r](*[Tensor(v) for v in values]).asnumpy()

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
        return {str(row): self.labels[r].tolist() for r, row in enumerate(self.routers)}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's labels of this rank's routers (a checkpoint of a run that never migrated has none)."""
        for r, row in enumerate(self.routers):
            if str(row) in state:
                self.labels[r] = np.asarray(state[str(row)], np.int64)
