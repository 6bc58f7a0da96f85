"""The compute dtype is a recipe setting: float16 compute (router, norms and softmax stay float32) gives the float32
loss within the tolerance of a float16 chain, on the same weights."""
from __future__ import annotations

import numpy as np

from precision.tolerance import chain_tolerance, relative_error
from telechat_moe.recipe import load_recipe

SMALL = ["model.seq_length=32", "model.max_position_embeddings=32", "model.original_max_position_embeddings=32",
         "model.hidden_size=64", "model.num_attention_heads=2", "model.vocab_size=256", "model.num_hidden_layers=2"]


def test_float16_compute_matches_float32():
    import mindspore as ms
    from mindspore import Tensor
    from telechat_moe.model import TeleChatMoE
    from telechat_moe.batches import position_ids
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(3)
    cfg32 = load_recipe("tiny", SMALL).model
    cfg16 = load_recipe("tiny", SMALL + ["model.compute_dtype=float16"]).model
    m32, m16 = TeleChatMoE(cfg32), TeleChatMoE(cfg16)
    ms.load_param_into_net(m16, {p.name: p for p in m32.get_parameters()})
    rng = np.random.default_rng(0)
    b, s = 2, cfg32.seq_length
    tokens = rng.integers(0, cfg32.vocab_size, (b, s + 1)).astype(np.int32)
    args = (Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]), Tensor(np.ones((b, s), np.float32)),
            Tensor(np.zeros((b, s), np.int32)), Tensor(position_ids(b, s)))
    out32, out16 = m32(*args), m16(*args)
    # LM loss through: q/kv latents, attention, 3 MoE layers and the head; each matmul accumulates <= 4*hidden terms.
    ks = [cfg32.hidden_size] * (4 * cfg32.num_hidden_layers) + [cfg32.vocab_size]
    tol = chain_tolerance("float16", ks)
    err = relative_error(out16[1].asnumpy(), out32[1].asnumpy())
    print(f"float16 vs float32 LM loss relative error {err:.2e} (tolerance {tol.rtol:.2e})")
    assert out16[1].dtype == ms.float32          # losses are computed in float32 whatever the compute dtype
    assert np.isfinite(out16[0].asnumpy()) and err <= tol.rtol
