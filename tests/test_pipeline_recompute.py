"""Full recompute under the pipeline executor (PyNative autograd over compiled chunks) reruns a layer's matmuls as
graph mode does: MLA splits its projections with plain slices there (mla.sliced), because a cell with a bprop of
its own (mla.split_last) keeps its input for the backward and so stops recompute at the matmul that made it.
Counted with MindSpore's profiler, as bench/pipeline_work.py counts a training step's matmuls."""
from __future__ import annotations

import json

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from parallel.pipeline.executor import _backward, _cells, _grad_flag, _leaf, _PyNative
from telechat_moe.mla import sliced, split_last
from telechat_moe.model import TeleChatMoE
from telechat_moe.recipe import load_recipe

WIDTH = 24


class SplitBlock(nn.Cell):
    """A matmul whose output is split; the backward reads the pieces' downstream values, so a full recompute must
    rerun the first matmul."""

    def __init__(self, split):
        super().__init__()
        self.split = split
        self.a = nn.Dense(WIDTH, WIDTH, has_bias=False)
        self.b = nn.Dense(16, WIDTH, has_bias=False)
        self.c = nn.Dense(8, WIDTH, has_bias=False)

    def construct(self, x):
        p, q = self.split(self.a(x), 16)
        return ops.tanh(self.b(ops.tanh(p))) + ops.tanh(self.c(q)) + x


class Chunk(nn.Cell):
    def __init__(self, split):
        super().__init__()
        self.block = SplitBlock(split)
        self.block.recompute()

    def construct(self, x, target):
        y = self.block(x)
        return y, ((y - target) ** 2).mean(), ops.stop_gradient(y.sum())


def executed_matmuls(split, folder) -> tuple[int, np.ndarray]:
    """(MatMul kernels of one forward + backward of the chunk as the executor runs it, the input's gradient)."""
    from mindspore.profiler import ProfilerActivity
    ms.set_seed(0)
    chunk = Chunk(split)
    compiled = _cells()[0](chunk)
    x = Tensor(np.random.default_rng(0).standard_normal((4, WIDTH)).astype(np.float32))
    target = Tensor(np.zeros((4, WIDTH), np.float32))

    def step():
        with _PyNative():
            leaf = _leaf(x)
            _grad_flag(True)
            y, loss, _ = compiled(leaf, target)
            _grad_flag(False)
            dx, dw = _backward([(y, None), (loss, Tensor(np.float32(1.0)))], leaf, chunk.trainable_params())
            return dx.asnumpy(), [g.asnumpy() for g in dw]

    step()                  # compiled outside the profiled window
    prof = ms.profiler.profile(activities=[ProfilerActivity.CPU],
                               on_trace_ready=ms.profiler.tensorboard_trace_handler(str(folder)))
    prof.start()
    dx, _ = step()
    prof.stop()
    count = 0
    for trace in folder.rglob("trace_view.json"):
        events = json.loads(trace.read_text())
        ops_pid = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                   and e["args"]["name"] == "CPU OP"}
        count += sum(e.get("ph") == "X" and e.get("pid") in ops_pid and "MatMul" in e["name"] for e in events)
    return count, dx


def test_sliced_lets_full_recompute_rerun_the_matmul_before_the_split(tmp_path):
    plain, dx_plain = executed_matmuls(sliced, tmp_path / "sliced")
    own_bprop, dx_own = executed_matmuls(split_last, tmp_path / "split_last")
    # forward 3 + backward 6 (three weight gradients, three input gradients) = 9 without recompute; full recompute
    # reruns all three forward matmuls with sliced, only two with split_last
    assert plain == 12
    assert own_bprop == 11
    np.testing.assert_array_equal(dx_plain, dx_own)


def test_full_recompute_switches_every_attention_to_sliced():
    model = TeleChatMoE(load_recipe("tiny", ["model.num_hidden_layers=2"]).model)
    attentions = [layer.self_attn for layer in model.layers] + [block.block.self_attn for block in model.mtp]
    assert all(a.split is split_last for a in attentions)
    model.set_recompute("full")
    assert all(a.split is sliced for a in attentions)
