"""The gradient norm's fused sum of squares (dvm_fusion/square_sums.py): the CPU kernel and the composition Ascend
uses against float64, over tensors of mixed shapes, sizes past the kernel's blocks and a half-precision input."""
from __future__ import annotations

import numpy as np

from precision.tolerance import assert_close, tolerance


def test_square_sums_of_many_tensors_match_float64():
    import mindspore as ms
    from mindspore import Tensor, nn
    from dvm_fusion.square_sums import square_sums_cpu, square_sums_for, square_sums_reference
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(0)
    shapes = [(3, 5), (7,), (256, 768), (16, 64, 96), (1,), (33, 17), (4097,)]
    arrays = [rng.standard_normal(s).astype(np.float32) * (i + 1) for i, s in enumerate(shapes)]
    expected = np.array([np.sum(a.astype(np.float64) ** 2) for a in arrays])

    class Sums(nn.Cell):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def construct(self, *tensors):
            return self.fn(tensors)

    tensors = [Tensor(a) for a in arrays]
    for fn in (square_sums_cpu, square_sums_reference):
        got = Sums(fn)(*tensors).asnumpy()
        assert got.dtype == np.float32 and got.shape == (len(arrays),)
        assert_close(got, expected, tolerance("float32", max(a.size for a in arrays)), fn.__name__)
    half = Sums(square_sums_cpu)(Tensor(arrays[0]).astype(ms.float16), tensors[1]).asnumpy()
    assert_close(half, expected[:2], tolerance("float16", 15), "float16 input")
    assert square_sums_for("CPU") is square_sums_cpu and square_sums_for("Ascend") is square_sums_reference
