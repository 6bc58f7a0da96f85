"""Replay executor: gradients of a schedule run micro-batch by micro-batch equal plain training on the batch.

Tolerance (precision/tolerance.py): a gradient entry sums one product per token of the batch in every layer it
passes; the pipeline changes only where the micro-batch partial sums are added, so each layer contributes the
rounding of a batch-token reduction: chain_tolerance(float32, [tokens] * layers).
"""
from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import Tensor, nn, ops  # noqa: E402

from parallel.pipeline.replay import Accumulator, ReplayError, replay  # noqa: E402
from parallel.pipeline.schedules import Kind, build  # noqa: E402
from precision.tolerance import assert_close, chain_tolerance, relative_error  # noqa: E402
from telechat_moe.pipeline_chunks import HeadAndLoss, LayerChunk, replay_microbatches  # noqa: E402


@pytest.fixture(autouse=True)
def pynative():
    # synchronous op dispatch: on a busy 2-core machine the asynchronous dispatch threads make each op ~30x slower
    ms.set_context(mode=ms.PYNATIVE_MODE, pynative_synchronize=True)
    ms.set_device("CPU")
    yield
    ms.set_context(pynative_synchronize=False)


# ---- a stack of dense blocks -----------------------------------------------------------------------------------------
class Block(nn.Cell):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Dense(d, 2 * d), nn.Dense(2 * d, d)

    def construct(self, acts, side):
        (x,) = acts
        return (x + self.down(ops.tanh(self.up(x))),)


class Head(nn.Cell):
    def __init__(self, d: int, classes: int):
        super().__init__()
        self.out = nn.Dense(d, classes)

    def construct(self, acts, side):
        return ops.cross_entropy(self.out(acts[0]), side[0])


def dense_setup(n_chunks: int, m: int, rows: int = 3, d: int = 16):
    ms.set_seed(1)
    rng = np.random.default_rng(1)
    chunks, head = nn.CellList([Block(d) for _ in range(n_chunks)]), Head(d, 5)
    x = rng.standard_normal((m * rows, d)).astype(np.float32)
    y = rng.integers(0, 5, m * rows).astype(np.int32)
    mbs = [((Tensor(x[i * rows:(i + 1) * rows]),), (Tensor(y[i * rows:(i + 1) * rows]),)) for i in range(m)]
    params = list(chunks.trainable_params()) + list(head.trainable_params())

    def plain(xb, yb):
        acts = (xb,)
        for c in chunks:
            acts = c(acts, (yb,))
        return head(acts, (yb,))

    loss, grads = ms.value_and_grad(plain, None, weights=params)(Tensor(x), Tensor(y))
    return chunks, head, mbs, params, float(loss.asnumpy()), [g.asnumpy() for g in grads], m * rows


@pytest.mark.parametrize("name,p,v,m", [("1f1b", 4, 1, 8), ("interleaved", 2, 2, 4), ("interleaved", 2, 3, 6),
                                        ("overlapped", 2, 2, 4), ("gpipe", 3, 1, 3), ("dualpipev", 2, 2, 4),
                                        ("dualpipev", 3, 2, 7)])
def test_dense_stack_gradients_equal_plain_training(name, p, v, m):
    sched = build(name, p, v, m)
    chunks, head, mbs, params, loss, grads, tokens = dense_setup(p * v, m)
    got = replay(sched, list(chunks), head, mbs)
    tol = chain_tolerance("float32", [tokens] * (p * v + 1))
    assert got.loss == pytest.approx(loss, rel=tol.rtol)
    assert len(got.grads) == len(params)
    for w, g in zip(params, grads):
        assert_close(got.grads[w.name], g, tol, name=w.name)
    # it ran exactly the schedule, in each stage's order
    for s in range(p):
        assert [a for t, a in got.trace if t == s] == list(sched.actions[s])


def test_a_wrong_scale_is_caught():
    """The PP risk the alignment tools look for: summing micro-batch gradients without the 1/m."""
    sched = build("interleaved", 2, 2, 4)
    chunks, head, mbs, params, _, grads, tokens = dense_setup(4, 4)

    class Summed(nn.Cell):  # a loss that forgets the mean over micro-batches
        def __init__(self):
            super().__init__()
            self.head = head

        def construct(self, acts, side):
            return self.head(acts, side) * 4

    got = replay(sched, list(chunks), Summed(), mbs)
    with pytest.raises(AssertionError, match="exceeds tolerance"):
        assert_close(got.grads[params[0].name], grads[0], chain_tolerance("float32", [tokens] * 5))


@pytest.mark.parametrize("name,stage_of", [("interleaved", [0, 1, 0, 1]), ("dualpipev", [0, 1, 1, 0])])
def test_each_gradient_is_accumulated_on_the_stage_of_its_chunk(name, stage_of):
    """The accumulation hook sees every backward's gradients once per micro-batch, on the stage that holds the
    chunk (`stage_of[k]` for virtual stage k: c*p + s interleaved, a V for DualPipeV, whose stage 0 holds the first
    and the last chunk); the head's weights live with the last chunk."""
    sched = build(name, 2, 2, 4)
    chunks, head, mbs, params, *_ = dense_setup(4, 4)
    seen: dict[str, list[int]] = {}

    class Recording(Accumulator):
        def add(self, stage, name, grad):
            seen.setdefault(name, []).append(stage)
            super().add(stage, name, grad)

    got = replay(sched, list(chunks), head, mbs, Recording())
    assert set(got.grads) == set(seen) == {w.name for w in params}
    for w in params:
        k = int(w.name.split(".")[0]) if w.name[0].isdigit() else 3
        assert seen[w.name] == [stage_of[k]] * 4, w.name


def test_peak_stored_follows_the_schedule():
    sched = build("1f1b", 4, 1, 8)
    chunks, head, mbs, *_ = dense_setup(4, 8)
    assert replay(sched, list(chunks), head, mbs).peak_stored == (4, 3, 2, 1)
    chunks, head, mbs, *_ = dense_setup(4, 4)
    assert replay(build("dualpipev", 2, 2, 4), list(chunks), head, mbs).peak_stored == (5, 5)  # 2p + 1 each


def test_mismatched_inputs():
    chunks, head, mbs, *_ = dense_setup(4, 4)
    with pytest.raises(ReplayError, match="chunks"):
        replay(build("interleaved", 2, 2, 4), list(chunks)[:3], head, mbs)
    with pytest.raises(ReplayError, match="microbatches"):
        replay(build("interleaved", 2, 2, 4), list(chunks), head, mbs[:2])
    with pytest.raises(ReplayError, match="named"):
        replay(build("1f1b", 2, 1, 4), [Block(16), Block(16)], head, mbs)  # two unnamed copies of "up.weight"


# ---- the TeleChat-MoE model ------------------------------------------------------------------------------------------
def tiny_model():
    from telechat_moe.config import ModelConfig
    from telechat_moe.model import TeleChatMoE

    cfg = ModelConfig(vocab_size=64, seq_length=16, max_position_embeddings=16, original_max_position_embeddings=16,
                      hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=48,
                      q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                      first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, routed_scaling_factor=2.0,
                      initializer_range=0.05, num_nextn_predict_layers=1, mtp_loss_factor=0.3,
                      moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    ms.set_seed(3)
    return TeleChatMoE(cfg)


def model_batch(model, m: int, rows: int):
    rng = np.random.default_rng(5)
    s, vocab = model.cfg.seq_length, model.cfg.vocab_size
    ids = rng.integers(0, vocab, (m * rows, s)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    mask = np.ones_like(ids, dtype=np.float32)
    segments = np.repeat(np.array([[0] * (s // 2) + [1] * (s - s // 2)]), m * rows, 0).astype(np.int32)  # 2 docs
    positions = np.concatenate([np.arange(s // 2), np.arange(s - s // 2)])[None].repeat(m * rows, 0).astype(np.int32)
    batch = (ids, labels, mask, segments, positions)
    return tuple(Tensor(a) for a in batch), replay_microbatches(model, batch, m)


def test_telechat_moe_gradients_equal_plain_training():
    """1F1B on 4 stages, interleaved, overlapped and DualPipeV on 2 stages x 2 chunks (one decoder layer per chunk;
    for overlapped an empty last chunk: that stage holds only head, MTP and loss; DualPipeV puts embedding, head, MTP
    and loss on stage 0), against one plain value_and_grad of the model's own construct on the whole batch."""
    model = tiny_model()
    m, rows = 4, 2
    full, mbs = model_batch(model, m, rows)
    params = model.trainable_params()
    loss, grads = ms.value_and_grad(lambda *x: model(*x)[0], None, weights=params)(*full)
    learned = [(w, g.asnumpy()) for w, g in zip(params, grads) if np.any(g.asnumpy())]
    assert len(learned) > 0.8 * len(params)
    tokens = m * rows * model.cfg.seq_length
    tol = chain_tolerance("float32", [tokens] * (model.cfg.num_hidden_layers + 2))

    for name, p, v, bounds in (("1f1b", 4, 1, [0, 1, 2, 3, 4]), ("interleaved", 2, 2, [0, 1, 2, 3, 4]),
                               ("overlapped", 2, 2, [0, 1, 2, 4, 4]), ("dualpipev", 2, 2, [0, 1, 2, 3, 4])):
        chunks = [LayerChunk(model, bounds[k], bounds[k + 1]) for k in range(p * v)]
        got = replay(build(name, p, v, m), chunks, HeadAndLoss(model), mbs)
        assert got.loss == pytest.approx(float(loss.asnumpy()), rel=tol.rtol)
        for w, g in learned:
            assert_close(got.grads[w.name], g, tol, name=f"{name}: {w.name}")
        worst = max(relative_error(got.grads[w.name], g) for w, g in learned)
        print(f"{name} p={p} v={v}: worst gradient relative error {worst:.2e} (tolerance {tol.rtol:.2e})")
        # the embedding feeds chunk 0 and the MTP block after the last chunk: its gradient sums both
        assert "embed_tokens.weight" in got.grads
        assert sum(a.kind is Kind.F for _, a in got.trace) == m * p * v
