"""Fault injection on the real TeleChatMoE: one training step run plainly and through single-process emulations
of TP, SP and EP, through the pipeline replay executor for PP (1F1B and interleaved schedules), and across two
msrun processes for DP; each correct path agreeing with the plain step and each deliberately broken one caught
by precision.compare at the right layer and with the right category, also with the other emulations active.

Run as a script (by msrun) this file is the data-parallel worker.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import mindspore as ms
import pytest
from mindspore import Tensor, nn, ops

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # as an msrun script, only tests/ is on the path
    sys.path.insert(0, str(ROOT))

from parallel.layout import ParallelLayout  # noqa: E402
from parallel.pipeline.replay import Accumulator  # noqa: E402
from parallel.pipeline.schedules import build  # noqa: E402
from precision.capture import ForwardCapture, Target, grad_records, layer_of, optimizer_records  # noqa: E402
from precision.compare import compare_runs  # noqa: E402
from precision.dump import DumpWriter, TensorRecord, config_hash, layout_meta  # noqa: E402
from precision.harness import align  # noqa: E402
from tests.helpers import free_port  # noqa: E402
from precision.parallel_emulation import (ExpertParallelDispatcher, RowParallelLinear,  # noqa: E402
                                          all_gather_batch, all_reduce_mean, pipeline_step,
                                          sequence_shard_positions, sharded_rope_tables, swap_cell)
from precision.signatures import Risk  # noqa: E402
from telechat_moe.config import ModelConfig  # noqa: E402
from telechat_moe.model import TeleChatMoE  # noqa: E402
from telechat_moe.optim import build_adamw  # noqa: E402
from telechat_moe.pipeline_chunks import HeadAndLoss, LayerChunk, replay_microbatches  # noqa: E402

BATCH, SEQ, TP, SP_SHARDS, EP, MICRO = 2, 8, 2, 2, 2, 2
PP, PP_FAULTY_STAGE = 2, 0
# schedule -> (chunks per stage, bounds): chunk k holds decoder layers [bounds[k], bounds[k+1]) (chunk 0 also the
# embedding, the last one the head) and runs on stage k % PP
PIPELINES = {"1f1b": (1, (0, 2, 3)), "interleaved": (2, (0, 1, 2, 3, 3))}


def tiny_config() -> ModelConfig:
    return ModelConfig(vocab_size=64, seq_length=SEQ, max_position_embeddings=SEQ, original_max_position_embeddings=SEQ,
                       hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=48,
                       q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                       first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=16, num_nextn_predict_layers=0, initializer_range=0.1)


def make_batch(rows: int = BATCH, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 64, (rows, SEQ)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    return (ids, labels, np.ones((rows, SEQ), np.float32), np.zeros((rows, SEQ), np.int32),
            np.tile(np.arange(SEQ, dtype=np.int32), (rows, 1)))


def initial_weights(cfg: ModelConfig) -> dict[str, np.ndarray]:
    ms.set_seed(0)
    return {p.name: p.asnumpy().copy() for p in TeleChatMoE(cfg).get_parameters()}


def build_model(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> TeleChatMoE:
    model = TeleChatMoE(cfg)
    for p in model.get_parameters():
        p.set_data(Tensor(weights[p.name]))
    return model


def capture_targets(cfg: ModelConfig) -> dict[str, Target]:
    """Per layer: attention output, router weights, FFN/MoE output, layer output; then the final norm. Only
    tensors in token order: a tensor in dispatch order would differ between layouts by its order alone."""
    targets = {}
    for i in range(cfg.num_hidden_layers):
        targets[f"layers.{i}.self_attn"] = Target("mla_attention", "bsh")
        if cfg.is_moe_layer(i):
            targets[f"layers.{i}.mlp.gate"] = Target("router", "tk", output_index=1)
            targets[f"layers.{i}.mlp"] = Target("moe", "bsh", output_index=0)
        else:
            targets[f"layers.{i}.mlp"] = Target("swiglu_ffn", "bsh")
        targets[f"layers.{i}"] = Target("decoder_layer", "bsh", output_index=0)
    targets["norm"] = Target("rmsnorm", "bsh")
    return targets


def train_step(model: TeleChatMoE, batch, schedule=None, accumulator=None, reduce_grads=None, gather=None):
    """One step: forward records, loss, gradients and AdamW states, as TensorRecords. With a pipeline
    `schedule`, the loss and gradients come from the replay executor (its micro-batches' gradients summed by
    `accumulator`); `reduce_grads(names, grads)` and `gather(array)` are the data-parallel hooks."""
    cfg = model.cfg
    params = model.trainable_params()
    names = [p.name for p in params]
    with ForwardCapture(model, capture_targets(cfg)) as capture:
        if schedule is None:
            loss, grads = ms.value_and_grad(lambda *x: model(*x)[0], None, params)(*(Tensor(x) for x in batch))
            loss = float(loss)
        else:
            bounds = PIPELINES[schedule.name][1]
            chunks = [LayerChunk(model, bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1)]
            result = pipeline_step(schedule, chunks, HeadAndLoss(model),
                                   replay_microbatches(model, batch, schedule.microbatches), capture, accumulator)
            loss, grads = result.loss, [Tensor(result.grads[n]) for n in names]
    if reduce_grads:
        grads, loss = reduce_grads(names, grads, loss)
    optimizer = build_adamw(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # the optimizer holds its parameters by group (decayed first); dumps keep the model's parameter order
    position = {p.name: i for i, p in enumerate(optimizer.parameters)}
    optimizer(tuple(grads[names.index(p.name)] for p in optimizer.parameters), Tensor(1.0, ms.float32), Tensor(True))
    forward = capture.records()
    if gather:
        forward = [TensorRecord(r.name, r.kind, gather(r.value), r.layer, r.operator, r.k, r.dims) for r in forward]
    # The states are the moments. The parameters after the step are not compared: AdamW's update
    # m / (sqrt(v) + eps) is close to sign(g), so where a gradient is near zero its float32 noise flips the
    # update by up to 2 * lr (precision/TOLERANCES.md).
    states = {"exp_avg": [optimizer.exp_avg[position[n]].asnumpy() for n in names],
              "exp_avg_sq": [optimizer.exp_avg_sq[position[n]].asnumpy() for n in names]}
    return (forward + [TensorRecord("loss", "loss", np.array(loss, np.float32), None, "cross_entropy")]
            + grad_records(names, grads) + optimizer_records(states, names))


# ---- emulations and their faults -------------------------------------------------------------------------
class AveragedPartialSums(RowParallelLinear):
    """FAULT: the TP all-reduce averages the partial products instead of summing them."""

    def all_reduce(self, partials):
        return super().all_reduce(partials) / self.tp


class ShardedRopeAttention(nn.Cell):
    """The model's attention with RoPE tables taken shard by shard at the shards' positions (SP/CP ranks)."""

    def __init__(self, attention, cos_table, sin_table, shard_positions):
        super().__init__(auto_prefix=False)
        self.attention = attention
        self.cos_table, self.sin_table = cos_table, sin_table
        self.shard_positions = shard_positions

    def construct(self, x, cos, sin, bias):
        b, s, _ = x.shape
        c, t = sharded_rope_tables(self.cos_table, self.sin_table, self.shard_positions)
        shape = (b, 1, s, c.shape[-1])
        return self.attention(x, ops.broadcast_to(c.reshape(1, 1, s, -1), shape),
                              ops.broadcast_to(t.reshape(1, 1, s, -1), shape), bias)


class WeightsInTokenOrder(ExpertParallelDispatcher):
    """FAULT: combine weights applied in token order to rows that are in dispatch order."""

    def weights_in_dispatch_order(self, weights, order):
        return weights.reshape(-1)


def apply_tp(model, faulty_layer=None):
    cfg = model.cfg
    for i in range(cfg.num_hidden_layers):
        mlp = "mlp.shared_experts.down_proj" if cfg.is_moe_layer(i) else "mlp.down_proj"
        for path in ("self_attn.o_proj", mlp):
            full = f"layers.{i}.{path}"
            weight = dict(model.cells_and_names())[full].weight
            kind = AveragedPartialSums if (i == faulty_layer and path == "self_attn.o_proj") else RowParallelLinear
            swap_cell(model, full, kind(weight, TP))


def apply_sp(model, faulty_layer=None):
    positions = sequence_shard_positions(SEQ, SP_SHARDS)
    for i in range(model.cfg.num_hidden_layers):
        shard_positions = list(positions)
        if i == faulty_layer:  # FAULT: the second shard uses its local positions, without its offset
            shard_positions[1] = positions[1] - positions[1][0]
        attention = model.layers[i].self_attn
        swap_cell(model, f"layers.{i}.self_attn",
                  ShardedRopeAttention(attention, model.cos, model.sin, shard_positions))


def apply_ep(model, faulty_layer=None):
    cfg = model.cfg
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            kind = WeightsInTokenOrder if i == faulty_layer else ExpertParallelDispatcher
            model.layers[i].mlp.dispatcher = kind(cfg.n_routed_experts, cfg.num_experts_per_tok, EP)


class DividedTwice(Accumulator):
    """FAULT: one stage divides each micro-batch gradient by the micro-batch count, on top of the 1/m that the
    mean loss already brought into the backward."""

    def __init__(self, stage: int, microbatches: int):
        super().__init__()
        self.stage, self.microbatches = stage, microbatches

    def add(self, stage, name, grad):
        super().add(stage, name, grad / self.microbatches if stage == self.stage else grad)


LAYOUTS = {"plain": ParallelLayout(), "tp": ParallelLayout(tp=TP), "sp": ParallelLayout(tp=TP, sp=True),
           "ep": ParallelLayout(dp=EP, ep=EP), "1f1b": ParallelLayout(pp=PP, micro_batch_num=MICRO),
           "interleaved": ParallelLayout(pp=PP, vpp=2, micro_batch_num=MICRO),
           "all": ParallelLayout(tp=TP, sp=True, ep=EP, pp=PP, micro_batch_num=MICRO),
           "combined": ParallelLayout(tp=TP, sp=True, ep=EP, pp=PP, vpp=2, micro_batch_num=2 * MICRO),
           "dp": ParallelLayout(dp=2)}


def meta(cfg, layout_name):
    return {"model_config_hash": config_hash(cfg), "layout": layout_meta(LAYOUTS[layout_name].validate())}


CELL_EMULATIONS = {"tp": apply_tp, "sp": apply_sp, "ep": apply_ep}


def make_step(cfg, weights, batch, changes=(), faulty_layer=None, schedule="1f1b"):
    """A step callable with the named emulations applied ('tp', 'sp', 'ep', and 'pp': the pipeline `schedule`
    over PP stages, one micro-batch per batch row), each broken in `faulty_layer` when its name ends in '!' (for
    'pp!', the accumulation of stage PP_FAULTY_STAGE, whatever layers it holds)."""
    def step():
        model = build_model(cfg, weights)
        for change in changes:
            if change.rstrip("!") in CELL_EMULATIONS:
                CELL_EMULATIONS[change.rstrip("!")](model, faulty_layer if change.endswith("!") else None)
        if not any(c.startswith("pp") for c in changes):
            return train_step(model, batch)
        m = len(batch[0])
        faulty = DividedTwice(PP_FAULTY_STAGE, m) if "pp!" in changes else None
        return train_step(model, batch, build(schedule, PP, PIPELINES[schedule][0], m), faulty)
    return step


# ---- tests ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup():
    # synchronous op dispatch: on a busy 2-core machine the asynchronous dispatch threads slow each small op down
    ms.set_context(mode=ms.PYNATIVE_MODE, pynative_synchronize=True)
    cfg = tiny_config()
    yield cfg, initial_weights(cfg), make_batch()
    ms.set_context(pynative_synchronize=False)


@pytest.fixture(scope="module")
def reference_dump(setup, tmp_path_factory):
    cfg, weights, batch = setup
    root = tmp_path_factory.mktemp("reference")
    DumpWriter(root, meta(cfg, "plain")).write(0, make_step(cfg, weights, batch)())
    return root


def test_identical_runs_and_correct_emulations_agree(setup, reference_dump, tmp_path):
    cfg, weights, batch = setup
    same = align(reference_dump, make_step(cfg, weights, batch), tmp_path / "same", meta(cfg, "plain"),
                 meta(cfg, "plain"))
    assert same.first is None and all(r.max_rel_error == 0 for r in same.rows)
    emulated = align(reference_dump, make_step(cfg, weights, batch, ("tp", "sp", "ep", "pp")), tmp_path / "all",
                     meta(cfg, "plain"), meta(cfg, "all"))
    assert emulated.first is None, emulated.diagnosis
    assert max(r.max_rel_error for r in emulated.rows) > 0  # the emulations really computed differently


def assert_localised(report, name, layer, risk):
    assert report.first is not None, "not caught"
    assert (report.first.entry.name, report.first.entry.layer) == (name, layer), report.diagnosis
    assert report.diagnosis.risk is risk, report.diagnosis.evidence


@pytest.mark.parametrize("change,layout,layer,name,risk", [
    ("tp!", "tp", 1, "layers.1.self_attn", Risk.TP),
    ("sp!", "sp", 2, "layers.2.self_attn", Risk.SP),
    ("ep!", "ep", 2, "layers.2.mlp", Risk.EP),
])
def test_fault_is_localised(setup, reference_dump, tmp_path, change, layout, layer, name, risk):
    cfg, weights, batch = setup
    report = align(reference_dump, make_step(cfg, weights, batch, (change,), faulty_layer=layer), tmp_path,
                   meta(cfg, "plain"), meta(cfg, layout))
    assert_localised(report, name, layer, risk)


# The faulty stage's last layer is the first gradient the comparison meets walking backwards: layer 1 when stage
# 0 holds layers 0-1 (1F1B), layer 2 when it holds chunks 0 and 2 = layers 0 and 2 (interleaved).
@pytest.mark.parametrize("schedule,layer", [("1f1b", 1), ("interleaved", 2)])
def test_pipeline_accumulation_fault_is_localised(setup, reference_dump, tmp_path, schedule, layer):
    cfg, weights, batch = setup
    report = align(reference_dump, make_step(cfg, weights, batch, ("pp!",), schedule=schedule), tmp_path,
                   meta(cfg, "plain"), meta(cfg, schedule))
    assert_localised(report, f"grad.layers.{layer}.mlp.shared_experts.down_proj.weight", layer, Risk.PP)


def test_pipeline_fault_among_all_emulations(setup, tmp_path):
    """TP, SP and EP emulated while 4 micro-batches go through the interleaved pipeline (2 stages x 2 chunks)
    whose stage 0 divides twice: the error every emulation adds is drift, the PP fault is still named PP (a
    factor of 1/micro_batch_num, which no degree of 2 explains) at stage 0's last layer."""
    cfg, weights, _ = setup
    batch = make_batch(2 * MICRO)
    report = align(make_step(cfg, weights, batch), make_step(cfg, weights, batch, ("tp", "sp", "ep", "pp!"),
                                                             schedule="interleaved"),
                   tmp_path, meta(cfg, "plain"), meta(cfg, "combined"))
    assert_localised(report, "grad.layers.2.mlp.shared_experts.down_proj.weight", 2, Risk.PP)
    assert any(r.max_rel_error > 0 for r in report.rows if r.entry.kind == "forward")  # emulations were active


# ---- DP: two processes under msrun -------------------------------------------------------------------------
DP_FAULTY_LAYER = 1


def _dp_worker(workdir: str) -> None:
    """msrun worker: the rank's half of the batch, gradients all-reduced (or, in the faulty run, layer 1's
    gradients left local: a parameter missing from the reducer), forward tensors gathered to the whole batch."""
    from mindspore.communication import get_group_size, get_rank, init
    ms.set_context(mode=ms.PYNATIVE_MODE)
    init()
    rank, world = get_rank(), get_group_size()
    cfg, work = tiny_config(), Path(workdir)
    weights = dict(np.load(work / "weights.npz"))
    rows = BATCH // world
    batch = tuple(x[rank * rows:(rank + 1) * rows] for x in make_batch())

    def reducer(skip_layer):
        def reduce(names, grads, loss):
            reduced = all_reduce_mean(grads, world)
            grads = [g if skip_layer is not None and layer_of(n) == skip_layer else r
                     for n, g, r in zip(names, grads, reduced)]
            return grads, float(all_reduce_mean([Tensor(np.float32(loss))], world)[0].asnumpy())
        return reduce

    for label, skip in (("correct", None), ("fault", DP_FAULTY_LAYER)):
        records = train_step(build_model(cfg, weights), batch, reduce_grads=reducer(skip), gather=all_gather_batch)
        DumpWriter(work / label, meta(cfg, "dp"), rank=rank).write(0, records)


def test_dp_under_msrun(setup, reference_dump, tmp_path):
    cfg, weights, _ = setup
    np.savez(tmp_path / "weights.npz", **weights)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "msrun"), "--worker_num=2", "--local_worker_num=2",
         f"--master_port={free_port()}", "--join=True", f"--log_dir={tmp_path / 'logs'}", "--cluster_time_out=90",
         __file__, str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    logs = "".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("worker_*.log")))
    assert proc.returncode == 0, logs or proc.stderr[-3000:]
    assert compare_runs(reference_dump, tmp_path / "correct").first is None
    report = compare_runs(reference_dump, tmp_path / "fault")
    assert report.first is not None and report.first.entry.layer == DP_FAULTY_LAYER
    assert report.first.entry.kind == "grad" and report.diagnosis.risk is Risk.DP
    assert "mean matches run A" in report.diagnosis.evidence


if __name__ == "__main__":
    _dp_worker(sys.argv[1])
