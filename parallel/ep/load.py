"""Expert load statistics for dynamic expert placement (parallel/ep/placement.py): per layer and expert, the token
counts of the last `window` steps (`LoadWindow`, with its heatmap), and a forecast of the next window's load from
the windows seen (`LoadPredictor`). Pure NumPy."""
from __future__ import annotations

from pathlib import Path

import numpy as np


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
