"""What the trainer watches of its routed experts each step and logs: under dynamic expert placement
(telechat_moe/expert_placement.py) the global load handed to the migrator, the max/mean EP-rank load, the expert
kernels' time per EP rank, each migration's line and the load heatmaps; under expert parallelism the bytes the
step's expert all-to-alls moved."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from parallel.ep.traffic import STEP_MULTIPLIER, token_bytes
from telechat_moe.dry_run import DTYPE_BYTES
from telechat_moe.expert_placement import ExpertMigrator
from telechat_moe.metrics import StepLogger, info


class PlacementMonitor:
    """The dynamic placement's part in a step. `router_rows`: the routers this rank builds (train_step.routed_layers);
    the heatmaps go to `out`/logs/expert_load on the main rank."""

    def __init__(self, migrator: ExpertMigrator, router_rows: list[int], logger: StepLogger, out: Path, main: bool):
        self.migrator, self.router_rows, self.logger, self.out, self.main = migrator, router_rows, logger, out, main
        self.load_imbalance = None      # this step's max/mean EP-rank load per router
        self.expert_seconds = None      # this step's expert kernel seconds per EP rank

    def observe(self, loads: np.ndarray, step: int, kernel_seconds: float) -> None:
        """The step's global load per router, and this rank's seconds in the routed experts' kernels."""
        self.migrator.observe(loads, step)
        self.load_imbalance = self.migrator.imbalance(loads)
        self.expert_seconds = self.migrator.over_ranks(kernel_seconds)

    def migrate(self, step: int) -> None:
        """The experts re-placed after this step's update, before its checkpoint (telechat_moe/expert_placement.py)."""
        d = self.migrator.decide()
        self.heatmaps(step)
        info(f"[experts] step {step}: {d.layers_moved} of {len(self.router_rows)} layers re-placed, "
             f"{d.experts_moved} experts moved, {d.replicas_made} replicas made ({d.bytes / 2 ** 20:.2f} MiB of "
             f"weights and Adam moments), forecast "
             f"max/mean EP-rank load {d.imbalance_before:.3f} -> {d.imbalance_after:.3f}, {d.seconds * 1e3:.0f} ms"
             + "".join(f"; kept {why}" for why in d.kept), self.main)

    def scalars(self) -> dict:
        total, seconds, error = self.migrator.total, self.expert_seconds, self.migrator.predictor.error()
        out = {"expert_max_mean_load": float(self.load_imbalance.mean()),
               **{f"expert_max_mean_load_router_{row}": float(x) for row, x in zip(self.router_rows,
                                                                                    self.load_imbalance)},
               "experts_moved": float(total.experts_moved),
               "expert_replicas_made": float(total.replicas_made),
               "expert_bytes_moved": total.bytes, "expert_migration_s": total.seconds,
               # the routed experts' kernel time of the slowest EP rank and the mean (every rank waits for the
               # slowest in the combine); which rank that was
               "expert_kernel_max_s": float(seconds.max()), "expert_kernel_mean_s": float(seconds.mean()),
               "expert_kernel_slowest_rank": float(np.argmax(seconds))}
        if error is not None:       # the last window's forecast against the load that came (relative L1)
            out["expert_forecast_error"] = error
        return out

    def heatmaps(self, step: int) -> None:
        """Each of this rank's routers' expert x step load over the kept window: a PNG (the latest) and a
        TensorBoard image at this step."""
        if not self.main:
            return
        folder = self.out / "logs" / "expert_load"
        folder.mkdir(parents=True, exist_ok=True)
        for r, row in enumerate(self.router_rows):
            path = self.migrator.window.heatmap_png(folder / f"router_{row}.png", r)
            self.logger.image(f"expert_load/router_{row}", path, step)


def traffic_scalars(model, ep: int, traffic: np.ndarray, copies: float) -> dict:
    """Bytes the step's expert all-to-alls moved across and inside nodes, for the flat and the hierarchical
    scheme, from every rank's routing (dispatch and combine, forward and backward); the rows the dispatches sent
    (ep_rows_sent: the routed copies and one pad row per member and exchange; the hierarchical form's rows across
    nodes are (token, node) pairs) beside the routed copies. `model`: the recipe's model section; `traffic`: the
    step's four routed-copy counts and the rows sent, summed over ranks; `copies`: the routed copies sent."""
    if ep == 1:
        return {}
    per_copy = token_bytes(model.hidden_size, DTYPE_BYTES[model.compute_dtype]) * STEP_MULTIPLIER
    names = ("ep_inter_node_bytes_flat", "ep_intra_node_bytes_flat", "ep_inter_node_bytes_hierarchical",
             "ep_intra_node_bytes_hierarchical")
    return {**{name: float(c) * per_copy for name, c in zip(names, traffic)}, "ep_rows_sent": float(traffic[4]),
            "ep_routed_copies": float(copies)}
