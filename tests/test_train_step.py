"""One graph-mode training step of tiny.yaml on CPU: every parameter that should learn gets a gradient, and the
router's expert bias moves only by its update rule."""
from __future__ import annotations

import os

import numpy as np
import pytest

from telechat_moe.moe.router import expert_bias_delta
from telechat_moe.recipe import load_recipe


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from telechat_moe.trainer import Trainer, configure_mindspore
    recipe = load_recipe("tiny", [f"output_dir={tmp_path_factory.mktemp('step')}", "training.global_batch_size=4"])
    configure_mindspore(recipe)
    return Trainer(recipe, peak_flops=1e9)


def test_every_trainable_parameter_gets_a_nonzero_gradient(trainer):
    from mindspore import Tensor
    import mindspore as ms
    batch = trainer.loader.batch_at(0, 0)
    *_, grads = trainer.forward_backward(*trainer._tensors(batch, slice(None)), Tensor(1.0, ms.float32))
    names = [p.name for p in trainer.weights]
    assert len(grads) == len(names)
    dead = [n for n, g in zip(names, grads) if not np.any(g.asnumpy())]
    assert not dead, f"parameters without gradient: {dead}"
    assert all(np.all(np.isfinite(g.asnumpy())) for g in grads)


def test_expert_bias_is_not_trained_and_moves_by_its_rule(trainer):
    trainable = {p.name for p in trainer.weights}
    assert trainer.biases and not any(b.name in trainable for b in trainer.biases)
    before = [b.asnumpy().copy() for b in trainer.biases]
    weights_before = {p.name: p.asnumpy().copy() for p in trainer.weights}
    values, loads = trainer.train_step(trainer.loader.batch_at(0, 1))
    assert loads.shape == (len(trainer.biases), trainer.r.model.n_routed_experts)
    k, tokens = trainer.r.model.num_experts_per_tok, 4 * trainer.r.model.seq_length
    assert np.array_equal(loads.sum(-1), np.full(len(loads), k * tokens))  # dropless: each routed copy counted once
    delta = expert_bias_delta(loads, trainer.r.model.moe_router_bias_update_rate)
    for b, old, d in zip(trainer.biases, before, delta):
        np.testing.assert_array_equal(b.asnumpy(), old + d)
    assert any(np.any(delta != 0) for delta in delta)
    moved = [n for n, p in ((p.name, p) for p in trainer.weights) if np.any(p.asnumpy() != weights_before[n])]
    assert len(moved) == len(weights_before)           # the optimizer stepped every trainable parameter
    assert np.isfinite(values["loss"]) and values["grad_norm"] > 0


def test_gradient_accumulation_equals_one_big_micro_batch(trainer, tmp_path, monkeypatch):
    """micro_batch_num=2 (two half batches, gradients summed then scaled) takes the same step as one micro-batch
    of the whole batch; only the summation order differs. Adam's first moment is linear in the gradient, so it
    carries the gradient's tolerance; the weights move by at most lr per element in one step, whatever the
    gradient, so two runs cannot differ by more than 2 lr (elements whose gradient is near zero may flip sign)."""
    from precision.tolerance import chain_tolerance, relative_error
    from telechat_moe.checkpoint import load_checkpoint, save_checkpoint
    from telechat_moe.trainer import Trainer
    assert trainer.micro == 1 and trainer.step == 0
    start = save_checkpoint(tmp_path, 0, 0, trainer._all_params(), {"step": 0}, keep=1)
    batch = trainer.loader.batch_at(0, 2)
    # One micro-batch: the module's trainer (same recipe, micro_batch_num=1), whose state is the start. micro=2: a
    # fresh trainer on the same prepared data loads the start before its graphs compile, as --resume does.
    monkeypatch.setattr(Trainer, "_prepare_data", lambda self: trainer.data)
    two = Trainer(load_recipe("tiny", [f"output_dir={trainer.out}", "training.global_batch_size=4",
                                       "parallel_config.micro_batch_num=2"]), peak_flops=1e9)
    load_checkpoint(start, two._all_params())
    runs = []
    for t in (trainer, two):
        values, _ = t.train_step(batch)
        runs.append(({p.name: p.asnumpy().copy() for p in t._all_params()}, values))
    (a, va), (b, vb) = runs
    tol = chain_tolerance("float32", [2 * trainer.r.model.seq_length] * 2)
    assert relative_error(vb["loss"], va["loss"]) <= tol.rtol
    moments = [n for n in a if n.startswith("adam_m.")]
    assert moments
    worst = max(relative_error(b[n], a[n]) for n in moments)
    assert worst <= tol.rtol, worst
    lr = float(trainer.optimizer.learning_rate.asnumpy())
    for p in trainer.weights:
        assert np.max(np.abs(b[p.name] - a[p.name])) <= 2 * lr, p.name
    assert two.micro == 2


def test_dynamic_loss_scale_backs_off_and_grows():
    from telechat_moe.gradients import LossScaler
    s = LossScaler(scale=1024.0, dynamic=True, window=3)
    s.update(False)
    assert s.scale == 512.0
    for _ in range(3):
        s.update(True)
    assert s.scale == 1024.0
    fixed = LossScaler.from_recipe(load_recipe("tiny", ["training.loss_scale=128"]))
    fixed.update(False)
    assert fixed.scale == 128.0 and not fixed.dynamic
    assert LossScaler.from_recipe(load_recipe("tiny", ["model.compute_dtype=float16"])).dynamic
    assert LossScaler.from_recipe(load_recipe("tiny")).scale == 1.0


def test_each_step_applies_adamw_at_the_scheduled_learning_rate(trainer):
    """Three steps through the one-graph training step, each checked against AdamW in NumPy at lr_at(step): the
    warmup changes the rate every step, so a graph that kept its first rate (what Parameter.set_data between calls
    gave) fails from the second step on by half the step size. The expected update is exact up to the rounding of
    the stored parameter, u * max|p|, which is compared with the step's size, lr."""
    import mindspore as ms
    from mindspore import Tensor
    from precision.tolerance import chain_tolerance, relative_error, tolerance
    o, opt = trainer.r.optimizer, trainer.optimizer
    b1, b2 = o.betas
    # The step graph's global norm against NumPy's of the gradients forward_backward gives for the same weights
    # and batch: each gradient's squares summed (K = its size), the sums added (K = the parameter count), a square
    # root. Measured errors are at most 1.7e-7, thousands of times below: the kernels sum blockwise, not in one
    # sequential run as the tolerance assumes.
    norm_tol = chain_tolerance("float32", [max(p.size for p in trainer.weights), len(trainer.weights), 1])
    for step in range(3):
        trainer.step = step
        lr = trainer.learning_rate(step)
        t = int(opt.global_step.asnumpy().reshape(-1)[0]) + 1
        before = [(p.asnumpy().copy(), m.asnumpy().copy(), v.asnumpy().copy())
                  for p, m, v in zip(trainer.weights, opt.exp_avg, opt.exp_avg_sq)]
        batch = trainer.loader.batch_at(0, 10 + step)
        *_, grads = trainer.forward_backward(*trainer._tensors(batch, slice(None)), Tensor(1.0, ms.float32))
        grads = [g.asnumpy().astype(np.float64) for g in grads]
        norm = np.sqrt(sum(float(np.sum(g * g)) for g in grads))
        grads = [g * o.grad_clip / max(norm, o.grad_clip) for g in grads]
        values, _ = trainer.train_step(batch)
        assert values["lr"] == lr and relative_error(values["grad_norm"], norm) <= norm_tol.rtol
        moved, expected, scale = [], [], 0.0
        for (p, m, v), g, after in zip(before, grads, trainer.weights):
            wd = o.weight_decay if p.ndim >= 2 else 0.0
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            step_expected = -lr * wd * p - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + o.eps)
            moved.append((after.asnumpy() - p).ravel())
            expected.append(step_expected.ravel())
            scale = max(scale, float(np.max(np.abs(p))))
        err = relative_error(np.concatenate(moved), np.concatenate(expected))
        assert err <= tolerance("float32").rtol * scale / lr, (step, lr, err)
    trainer.step = 0


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_steps_do_not_keep_their_gradients_alive(trainer):
    """Each step's gradients (54 MB on tiny) must be freed: handing them from one graph to another kept them alive
    in MindSpore 2.9 on CPU and OOM-killed the 200-step run. Fifteen steps after a warm-up may grow the resident
    set by less than three steps' worth of gradients."""
    for step in range(3):
        trainer.train_step(trainer.loader.batch_at(0, 20 + step))
    start = _resident_bytes()
    for step in range(15):
        trainer.train_step(trainer.loader.batch_at(0, 23 + step))
    gradient_bytes = sum(p.size * 4 for p in trainer.weights)
    assert _resident_bytes() - start < 3 * gradient_bytes, (_resident_bytes() - start) / 2 ** 20


def _worst_gradient_error(trainer, model) -> float:
    """The largest relative error of `model`'s gradients (the trainer's weights loaded into it) against the trainer's
    on one batch."""
    import mindspore as ms
    from mindspore import Tensor
    from precision.tolerance import relative_error
    from telechat_moe.train_step import ForwardBackward
    ms.load_param_into_net(model, {p.name: p for p in trainer.model.get_parameters()}, strict_load=True)
    weights = ms.ParameterTuple([model.parameters_dict()[p.name] for p in trainer.weights])
    args = (*trainer._tensors(trainer.loader.batch_at(0, 3), slice(None)), Tensor(1.0, ms.float32))
    *_, expected = trainer.forward_backward(*args)
    *_, got = ForwardBackward(model, weights)(*args)
    return max(relative_error(g.asnumpy(), e.asnumpy()) for g, e in zip(got, expected))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_the_same_gradients(trainer, mode):
    """recompute_config reruns the attention core (selective) or whole layers (full) in the backward: the same
    operations on the same inputs, so the gradients agree to the rounding of one operation."""
    from precision.tolerance import tolerance
    from telechat_moe.model import TeleChatMoE
    model = TeleChatMoE(trainer.r.model)
    model.set_recompute(mode)
    worst = _worst_gradient_error(trainer, model)
    assert worst <= tolerance("float32").rtol, worst


def test_layers_compiled_once_give_the_gradients_of_layers_compiled_each(trainer):
    """The trainer's model compiles each kind of decoder layer once and inlines it into every layer of that kind
    (ReusedDecoderLayer, lazy_inline): a model compiling every layer's own graph gives the same gradients."""
    from precision.tolerance import tolerance
    from telechat_moe.model import ReusedDecoderLayer, TeleChatMoE
    assert all(isinstance(layer, ReusedDecoderLayer) for layer in trainer.model.layers)
    model = TeleChatMoE(trainer.r.model, reuse_layers=False)
    assert not any(isinstance(layer, ReusedDecoderLayer) for layer in model.layers)
    worst = _worst_gradient_error(trainer, model)
    assert worst <= tolerance("float32").rtol, worst


def test_a_model_without_mtp_trains(tmp_path):
    """num_nextn_predict_layers=0: the MTP loss is a zero tensor, the step runs and learns (it once crashed at step
    1 reading a Python float's value)."""
    from telechat_moe.trainer import Trainer, configure_mindspore
    recipe = load_recipe("tiny", [f"output_dir={tmp_path}", "training.global_batch_size=4",
                                  "model.num_nextn_predict_layers=0", "model.seq_length=64",
                                  "model.max_position_embeddings=64", "model.original_max_position_embeddings=64"])
    configure_mindspore(recipe)
    t = Trainer(recipe, peak_flops=1e9)
    assert not any(".mtp." in f".{p.name}" for p in t.weights)
    first = [t.train_step(t.loader.batch_at(0, i))[0] for i in range(3)]
    assert all(v["mtp_loss"] == 0.0 and np.isfinite(v["loss"]) for v in first)
    assert first[0]["loss"] == pytest.approx(first[0]["lm_loss"] + first[0]["aux_loss"], rel=1e-6)
