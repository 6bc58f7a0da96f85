"""One training step of the real model on the same global batch, balancing off vs reorder: same total loss and
summed gradients, within the shared fp32 tolerance (only the grouping into micro-batches and ranks changes)."""
from __future__ import annotations

import numpy as np
import pytest

from data_sched.attention_balance import balance_global_batch
from data_sched.attention_cost import CostModel
from data_sched.packing import doc_lens_to_segment_ids, pack_documents
from precision.tolerance import assert_close, chain_tolerance

SEQ, DP, MB = 32, 2, 2
G = 8   # 2 samples per micro-batch


@pytest.fixture(scope="module")
def step():
    import mindspore as ms
    from mindspore import ParameterTuple, Tensor

    from telechat_moe.model import TeleChatMoE
    from telechat_moe.recipe import load_recipe
    from telechat_moe.train_step import ForwardBackward

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ms.set_seed(0)
    recipe = load_recipe("tiny", [f"model.seq_length={SEQ}", f"model.max_position_embeddings={SEQ}",
                                  f"model.original_max_position_embeddings={SEQ}", "model.vocab_size=256",
                                  "model.num_hidden_layers=2", "model.hidden_size=64"])
    model = TeleChatMoE(recipe.model, "CPU")
    fb = ForwardBackward(model, ParameterTuple(model.trainable_params()))

    def run(input_ids, labels, segment_ids):
        """Sum over micro-batches (rows of 2) of (total loss, gradients), as the trainer accumulates them."""
        total, grads = 0.0, None
        b = input_ids.shape[0]
        pos = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (2, SEQ)).copy()
        for lo in range(0, b, 2):
            out = fb(Tensor(input_ids[lo:lo + 2]), Tensor(labels[lo:lo + 2]), Tensor(np.ones((2, SEQ), np.float32)),
                     Tensor(segment_ids[lo:lo + 2]), Tensor(pos), Tensor(1.0, ms.float32))
            total += float(out[0].asnumpy())
            g = [x.asnumpy().astype(np.float64) for x in out[-1]]
            grads = g if grads is None else [a + c for a, c in zip(grads, g)]
        return total, grads
    return run, recipe.model


def test_reordered_global_batch_gives_the_same_loss_and_gradients(step):
    run, cfg = step
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(2.0, 1.2, 200).astype(int) + 1, 3 * SEQ)
    docs = [rng.integers(4, cfg.vocab_size, n).astype(np.int32) for n in lengths]
    packed = pack_documents(docs, SEQ, eod_id=2)
    doc_lens = packed.doc_lens_list()[:G]
    tokens = packed.tokens[:G]
    plan = balance_global_batch(doc_lens, "reorder", DP, MB, CostModel(a=1.0, b=0.0), seed=3)
    order = plan.source_order()
    assert not np.array_equal(order, np.arange(G)), "the test batch should actually be reordered"
    assert plan.slot_costs_after.max() < plan.slot_costs_before.max()

    def segments(lens_list):
        return np.stack([doc_lens_to_segment_ids(x, SEQ) for x in lens_list])

    loss_off, grads_off = run(tokens[:, :-1], tokens[:, 1:], segments(doc_lens))
    inputs, labels = plan.apply(tokens)
    loss_on, grads_on = run(inputs, labels, segments([plan.doc_lens(j) for j in range(G)]))
    # Each micro-batch's loss is a mean over its tokens: a chain of SEQ-long and G*SEQ-long reductions.
    tol = chain_tolerance("float32", ks=(cfg.hidden_size, SEQ, G * SEQ))
    assert_close(loss_on, loss_off, tol, "total loss")
    for i, (a, b) in enumerate(zip(grads_on, grads_off)):
        assert_close(a, b, tol, f"gradient {i}")
