"""Decoder layers compiled once per kind (telechat_moe.model.ReusedDecoderLayer): layers share a graph exactly when
every constant their graphs read is equal; their gradients against layers compiled each: test_train_step.py."""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor

from telechat_moe.model import TeleChatMoE, constants_digest
from telechat_moe.recipe import load_recipe


def _tiny():
    return TeleChatMoE(load_recipe("tiny", ["model.num_hidden_layers=3"]).model)


def test_the_dense_layer_and_the_moe_layers_each_share_one_graph():
    model = _tiny()
    layers = [*model.layers, *(block.block for block in model.mtp)]
    keys = [layer.graph_key for layer in layers]
    assert [layer.is_moe for layer in layers] == [False, True, True, True]
    assert keys[1] == keys[2] == keys[3] != keys[0]
    # MindSpore reuses a parsed graph by this string: equal keys, one graph
    assert layers[1].cell_init_args == layers[3].cell_init_args != layers[0].cell_init_args


def test_a_layer_differing_by_any_constant_gets_a_graph_of_its_own():
    layers = list(_tiny().layers)
    first, second = layers[1], layers[2]
    assert constants_digest(first) == constants_digest(second)
    second.mlp.top_k += 1                                   # a Python constant of a sub-cell
    assert constants_digest(first) != constants_digest(second)
    second.mlp.top_k -= 1
    second.zero = Tensor(1.0, ms.float32)                    # a constant tensor, by its value
    assert constants_digest(first) != constants_digest(second)
    second.zero = Tensor(np.float32(0.0))
    assert constants_digest(first) == constants_digest(second)
    # parameters are the graph's inputs: their values never split a graph
    second.mlp.gate.weight.set_data(Tensor(np.zeros(second.mlp.gate.weight.shape, np.float32)))
    assert constants_digest(first) == constants_digest(second)
