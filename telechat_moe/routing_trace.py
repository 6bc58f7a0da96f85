"""Routing traces: the top-k experts each MoE layer's router of a TeleChatMoE model chooses on real batches, for
expert-parallel traffic accounting (parallel/ep/traffic.py, bench/ep_traffic.py).

`record_routing(model, batches)` runs the model's own pieces (embedding, RoPE tables, attention mask, each decoder
layer's attention block, post-attention norm, router and FFN block) up to every router, so the indices are the ones
the router computes in training (expert bias included). `trained_tiny_trace()` trains recipes/tiny.yaml in this
process for a few steps (or loads an earlier run's checkpoint) and records its routing on held-out batches.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn


class RouterChoices(nn.Cell):
    """-> (indices [b*s, k] int32 of each MoE decoder layer, in layer order) for (input_ids, segment_ids,
    position_ids); the same pieces as TeleChatMoE.hidden_states, stopping at each router."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def construct(self, input_ids, segment_ids, position_ids):
        m = self.model
        cos, sin = m.rope(position_ids)
        bias = m.attention_mask(segment_ids)
        h = m.embed(input_ids)
        chosen = ()
        for layer in m.layers:
            h = layer.attention_block(h, cos, sin, bias)
            if layer.is_moe:
                x = layer.post_attention_layernorm(h)
                b, s, d = x.shape
                chosen = chosen + (layer.mlp.gate(x.reshape(b * s, d), b)[0],)
            h = layer.ffn_block(h)[0]
        return chosen


def moe_layer_indices(model) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if layer.is_moe]


def record_routing(model, batches: Iterable, *, pynative: bool = True) -> dict[int, np.ndarray]:
    """{decoder layer index: int32 [N, k]}: the experts each MoE layer's router chose for every token of `batches`
    (dicts with int32 `input_ids` [b, s] and optionally `segment_ids` [b, s], as the trainer's loader yields them;
    documents default to one per row), tokens in (batch, row, position) order. Runs in PyNative mode unless
    `pynative` is False (then in the current mode, which compiles a graph per batch shape); the mode is restored."""
    from telechat_moe.batches import position_ids
    layers = moe_layer_indices(model)
    found: dict[int, list[np.ndarray]] = {i: [] for i in layers}
    if not layers:
        return {}
    probe = RouterChoices(model)
    probe.set_train(False)
    mode = ms.get_context("mode")
    if pynative:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        for batch in batches:
            ids = np.asarray(batch["input_ids"], np.int32)
            if ids.ndim != 2:
                raise ValueError(f"record_routing: input_ids must be [batch, seq], got shape {ids.shape}")
            segments = np.asarray(batch.get("segment_ids", np.zeros_like(ids)), np.int32)
            b, s = ids.shape
            out = probe(Tensor(ids), Tensor(segments), Tensor(position_ids(b, s)))
            for i, chosen in zip(layers, out):
                found[i].append(chosen.asnumpy().astype(np.int32))
    finally:
        if pynative:
            ms.set_context(mode=mode)
    k = model.cfg.num_experts_per_tok
    return {i: np.concatenate(v) if v else np.zeros((0, k), np.int32) for i, v in found.items()}


@dataclass
class RecordedTrace:
    """A model's routing on held-out batches and where it came from."""
    routing: dict[int, np.ndarray]          # decoder layer -> [N, k]
    num_experts: int
    top_k: int
    step: int                               # the training step of the weights
    source: str                             # "trained N steps in DIR" / "checkpoint DIR"
    seconds: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return next(iter(self.routing.values())).shape[0] if self.routing else 0


def _held_out_batches(trainer, batches: int) -> list[dict]:
    from data_sched.loader import BatchLoader
    held = trainer.data.held_out
    if held is None or len(held) == 0:
        raise ValueError("trained_tiny_trace: the recipe keeps no held-out samples (data.eval_fraction is 0)")
    rows = min(len(held), trainer.r.training.global_batch_size)
    loader = BatchLoader(held, rows, trainer.r.seed)
    return [loader.batch_at(0, i) for i in range(min(batches, loader.batches_per_epoch))]


def trained_tiny_trace(steps: int = 60, *, output_dir: str | Path | None = None, eval_batches: int = 8,
                       recipe: str = "tiny", overrides: Iterable[str] = (),
                       log: Callable[[str], None] = print) -> RecordedTrace:
    """The routing of recipes/tiny.yaml (or `recipe`) on up to `eval_batches` held-out batches of its global batch.

    Without `output_dir`: trains `steps` steps in this process (MindSpore configured from the recipe: graph mode on
    CPU) into a temporary output folder, removed afterwards. With `output_dir` (an earlier run's output folder):
    loads its latest checkpoint and its tokenizer instead, trains nothing and writes nothing there. `overrides`:
    --set style assignments applied to the recipe either way (the model shape must match a loaded checkpoint)."""
    from telechat_moe.recipe import load_recipe
    from telechat_moe.trainer import Trainer, configure_mindspore
    seconds = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="telechat_routing_trace_") as tmp:
        out = Path(output_dir) if output_dir is not None else Path(tmp)
        sets = [*overrides, f"output_dir={out}", "training.eval_interval=0", "training.save_interval=0",
                "training.log_interval=10"]
        if output_dir is None:
            sets.append(f"training.train_steps={steps}")
        resolved = out / "logs" / "recipe.yaml"      # an earlier run's own recipe, if it wrote one
        r = load_recipe(str(resolved) if output_dir is not None and resolved.is_file() else recipe, sets)
        configure_mindspore(r)
        trainer = Trainer(r, peak_flops=1e9)          # peak only scales the logged MFU
        seconds["setup"] = time.perf_counter() - start
        if output_dir is None:
            log(f"[trace] training {recipe} for {steps} steps in {out}")
            t0 = time.perf_counter()
            summary = trainer.fit()
            seconds["train"] = time.perf_counter() - t0
            held = summary.get("eval_lm_loss")
            source = f"trained {trainer.step} steps" + (f", held-out lm_loss {held:.3f}" if held is not None else "")
        else:
            if not trainer.resume():
                raise FileNotFoundError(f"{out}: no checkpoint to load (expected {out}/checkpoints/rank_0/step_*)")
            source = f"checkpoint in {out} (step {trainer.step})"
        t0 = time.perf_counter()
        batches = _held_out_batches(trainer, eval_batches)
        routing = record_routing(trainer.model, batches)
        seconds["record"] = time.perf_counter() - t0
        cfg = trainer.r.model
        log(f"[trace] recorded {len(routing)} MoE layers x {next(iter(routing.values())).shape[0]} held-out tokens "
            f"({seconds['record']:.1f}s)")
        return RecordedTrace(routing, cfg.n_routed_experts, cfg.num_experts_per_tok, trainer.step, source, seconds)


def scale_routing(indices: np.ndarray, num_experts: int, experts: int, top_k: int, rng) -> np.ndarray:
    """A trace of `num_experts` experts routed top-k0 ([N, k0]) as one of `experts` routed `top_k`: expert e of the
    trace stands for the group [e*g, (e+1)*g) of g = experts / num_experts experts, and each of a token's k0 choices
    becomes top_k / k0 distinct experts of its group, drawn uniformly (`rng`). The trace's skew over its experts
    is kept as skew over the groups (and so over the ranks holding them); inside a group the load is even."""
    n, k0 = indices.shape
    if experts % num_experts or top_k % k0:
        raise ValueError(f"scale_routing: {experts} experts top-{top_k} is not a whole multiple of the trace's "
                         f"{num_experts} experts top-{k0}")
    group, per = experts // num_experts, top_k // k0
    if per > group:
        raise ValueError(f"scale_routing: {per} experts per choice, but a group holds {group}")
    # per (token, choice): `per` distinct members of the group, the smallest of random keys (sampling without
    # replacement)
    members = np.argsort(rng.random((n, k0, group)), axis=-1)[..., :per]
    return (indices[..., None] * group + members).reshape(n, top_k).astype(np.int32)
