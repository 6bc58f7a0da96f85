"""The hand-written grouped-matmul kernel (forward and its backward) against a float64 per-expert reference, with
empty groups, uneven sizes and padding rows; its library's build; and the Ascend binding's contract (cumulative
group_list)."""
from __future__ import annotations

import numpy as np
import pytest

from precision.tolerance import assert_close, tolerance


def reference(x, w, sizes):
    out, start = [], 0
    for e, n in enumerate(sizes):
        out.append(x[start:start + n].astype(np.float64) @ w[e].astype(np.float64))
        start += n
    return np.concatenate(out)


# the last two are large enough for OpenBLAS to thread its GEMMs
@pytest.mark.parametrize("sizes", [[3, 0, 5, 2], [0, 0, 10, 0], [1, 1, 1, 7], [300, 0, 1517, 211], [0, 2500, 0, 3]])
def test_grouped_matmul_forward_and_backward_match_reference(sizes):
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn
    from dvm_fusion.grouped_matmul import KERNEL_CLOCK, grouped_matmul_cpu
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(0)
    n, k, m, pad = sum(sizes), 48, 24, 2  # rows past the groups: an expert-parallel receive buffer's padding
    x = rng.standard_normal((n + pad, k)).astype(np.float32)
    w = rng.standard_normal((len(sizes), k, m)).astype(np.float32)
    dy = rng.standard_normal((n + pad, m)).astype(np.float32)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(w), name="w")

        def construct(self, x, g, dy):
            return (grouped_matmul_cpu(x, self.w, g) * dy).sum()

    net = Net()
    grad = ms.value_and_grad(net, grad_position=0, weights=net.trainable_params())
    g = Tensor(np.array(sizes, np.int32))
    KERNEL_CLOCK.take()
    _, (dx, (dw,)) = grad(Tensor(x), g, Tensor(dy))
    dw.asnumpy()
    assert KERNEL_CLOCK.take() > 0 and KERNEL_CLOCK.take() == 0, "the kernels' time is counted, once"
    y = grouped_matmul_cpu(Tensor(x), Tensor(w), g).asnumpy()
    assert_close(y[:n], reference(x, w, sizes), tolerance("float32", k), "forward")
    dx_ref = np.concatenate([dy[a:a + s].astype(np.float64) @ w[e].T.astype(np.float64)
                             for e, (a, s) in enumerate(zip(np.cumsum([0] + sizes[:-1]), sizes))])
    assert_close(dx.asnumpy()[:n], dx_ref, tolerance("float32", m), "dx")
    assert not np.any(y[n:]) and not np.any(dx.asnumpy()[n:]), "padding rows come out zero"
    starts = np.cumsum([0] + sizes[:-1])
    dw_ref = np.stack([x[a:a + s].T.astype(np.float64) @ dy[a:a + s] for a, s in zip(starts, sizes)])
    assert_close(dw.asnumpy(), dw_ref, tolerance("float32", max(sizes)), "dw")
    for e, s in enumerate(sizes):
        if s == 0:
            assert not np.any(dw.asnumpy()[e]), "an expert that saw no token gets no gradient"


def test_groups_past_the_rows_stop_the_kernel_instead_of_writing_past_its_buffer():
    import mindspore as ms
    from mindspore import Tensor
    from dvm_fusion.grouped_matmul import grouped_matmul_cpu
    ms.set_context(mode=ms.GRAPH_MODE)
    x, w = Tensor(np.ones((4, 8), np.float32)), Tensor(np.ones((2, 8, 3), np.float32))
    with pytest.raises(RuntimeError, match="function\\(GroupedMatmul\\) is 3"):
        grouped_matmul_cpu(x, w, Tensor(np.array([3, 3], np.int32))).asnumpy()


def test_kernel_library_is_built_once_per_source_and_compiler_and_needs_g_plus_plus(tmp_path, monkeypatch):
    from dvm_fusion import native
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = native.library("grouped_matmul")
    assert built.parent == tmp_path / "telechat_moe" / "kernels" and built.stat().st_size > 0
    stamp = built.stat().st_mtime_ns
    assert native.library("grouped_matmul") == built and built.stat().st_mtime_ns == stamp
    assert [p.name for p in built.parent.glob("*.tmp")] == []
    path, version = native.compiler()
    monkeypatch.setattr(native, "compiler", lambda: (path, version + " (another build)"))
    other = native.library("grouped_matmul")    # another compiler: another library, beside the first
    assert other != built and other.parent == built.parent and built.exists()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh"))
    monkeypatch.setattr(native, "compiler", lambda: ("", ""))
    with pytest.raises(native.KernelBuildError, match="grouped_matmul.cc: building the CPU kernels needs g\\+\\+"):
        native.library("grouped_matmul")


def test_kernel_choice_follows_the_device():
    from dvm_fusion.grouped_matmul import grouped_matmul_ascend, grouped_matmul_cpu, grouped_matmul_for
    assert grouped_matmul_for("CPU") is grouped_matmul_cpu
    assert grouped_matmul_for("Ascend") is grouped_matmul_ascend


@pytest.mark.parametrize("sizes", [[3, 0, 5, 2], [0, 0, 10, 0]])
def test_ascend_binding_hands_grouped_matmul_its_documented_arguments(sizes, monkeypatch):
    """MindSpore's GroupedMatmul runs on Ascend only, so its kernel is stood in for by the documented semantics
    (split_item=3: one x and one y split by rows; group_type=0: groups along M; group_list: int64 cumulative row
    ends, so group e is rows group_list[e-1]..group_list[e]). The binding must hand it exactly those, and with them
    give what the CPU kernel gives, empty groups included."""
    import mindspore as ms
    from mindspore import Tensor, ops
    from dvm_fusion.grouped_matmul import grouped_matmul_ascend, grouped_matmul_cpu
    ms.set_context(mode=ms.PYNATIVE_MODE)
    calls = []

    def documented(xs, ws, *, group_list, split_item, group_type):
        calls.append((split_item, group_type))
        (x,), (w,) = [t.asnumpy() for t in xs], [t.asnumpy() for t in ws]
        ends = group_list.asnumpy()
        assert group_list.dtype == ms.int64 and len(ends) == w.shape[0] and ends[-1] == x.shape[0]
        assert np.all(np.diff(ends) >= 0), "group_list must hold cumulative ends, not sizes"
        starts = np.concatenate([[0], ends[:-1]])
        return [Tensor(np.concatenate([x[a:b] @ w[e] for e, (a, b) in enumerate(zip(starts, ends))]))]

    monkeypatch.setattr(ops.auto_generate, "grouped_matmul", documented)
    rng = np.random.default_rng(1)
    x = Tensor(rng.standard_normal((sum(sizes), 16)).astype(np.float32))
    w = Tensor(rng.standard_normal((len(sizes), 16, 8)).astype(np.float32))
    g = Tensor(np.array(sizes, np.int32))
    got = grouped_matmul_ascend(x, w, g).asnumpy()
    assert calls == [(3, 0)]
    assert_close(got, grouped_matmul_cpu(x, w, g).asnumpy(), tolerance("float32", 16))
