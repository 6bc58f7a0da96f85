"""The communication layer in one process: group membership and naming from a ParallelLayout, and the native
(Ascend/GPU) transport's calls checked against the installed MindSpore's primitives (it cannot run here)."""
from __future__ import annotations

import inspect

import pytest
from mindspore import ops

from parallel.comm import ProcessGroups, transport
from parallel.comm.groups import Group
from parallel.layout import Axis, LayoutError, ParallelLayout


def test_expert_groups_two_levels():
    layout = ParallelLayout(dp=8, ep=8, devices_per_node=4).validate(8)
    g = ProcessGroups(layout, 5, create=False)
    assert g.axis(Axis.EP).ranks == tuple(range(8))
    assert g.ep_in_node().ranks == (4, 5, 6, 7) and g.ep_in_node().index == 1
    assert g.ep_across_nodes().ranks == (1, 5) and g.ep_across_nodes().index == 1
    assert g.pair(2).ranks == (2, 5)
    assert g.axis(Axis.EDP).size == 1 and g.axis(Axis.EDP).name == ""      # a group of one: nothing to create
    # ep=4 inside dp=8: two EP groups; their names differ, members agree on them
    small = ParallelLayout(dp=8, ep=4, devices_per_node=2).validate(8)
    names = {ProcessGroups(small, r, create=False).axis(Axis.EP).name for r in range(8)}
    assert len(names) == 2
    assert ProcessGroups(small, 6, create=False).ep_across_nodes().ranks == (4, 6)


def test_hierarchical_needs_as_many_ep_ranks_in_every_node():
    layout = ParallelLayout(dp=6, ep=6, devices_per_node=4).validate(6)
    with pytest.raises(LayoutError, match="as many EP ranks in every node"):
        ProcessGroups(layout, 0, create=False).ep_across_nodes()


def test_native_transport_calls_match_the_installed_primitives(monkeypatch):
    """Every MindSpore primitive the Ascend/GPU transport builds, with the keyword arguments it passes, exists with
    those parameter names in the installed package."""
    made = []

    def recorder(name):
        real = getattr(ops, name)
        params = inspect.signature(real.__init__).parameters

        def make(*args, **kwargs):
            made.append(name)
            unknown = set(kwargs) - set(params)
            assert not unknown, f"ops.{name} has no parameter(s) {unknown}; it takes {list(params)[1:]}"
            assert len(args) <= len(params) - 1
            return lambda *a, **k: (None,)
        return make

    for name in ("AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "Broadcast", "Send", "Receive"):
        monkeypatch.setattr(transport.ops, name, recorder(name))
    t = transport.NativeTransport(Group("hccl_group_0", (0, 1), 1))
    t.broadcast(None, 0)
    t.send(None)
    t.recv((2, 3), None)
    assert sorted(set(made)) == sorted(["AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "Broadcast", "Send",
                                        "Receive"])


def test_native_uneven_all_to_all_binds_the_installed_alltoallv(monkeypatch):
    """The Ascend transport's all_to_all_v: MindSpore's AlltoAllV built with parameters its installed signature has
    (block_size: the elements of one row), called as MindFormers' dropless dispatcher calls it (a flat input, counts
    of rows as int64 moved to the host by MoveTo), its flat output shaped back into
    rows. AlltoAllV and MoveTo have no CPU kernel: stand-ins record the calls (a group of one gets back what it
    sent); MoveTo's documented inputs are (input, to, blocking)."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor

    params = set(inspect.signature(ops.AlltoAllV.__init__).parameters) - {"self"}
    calls = []

    class StandIn:
        def __init__(self, **kwargs):
            assert set(kwargs) <= params, f"ops.AlltoAllV takes {params}, got {set(kwargs)}"
            self.kwargs = kwargs

        def __call__(self, flat, send, recv):
            calls.append((self.kwargs, flat.shape, send, recv))
            return flat

    moved = []

    class MoveTo:
        def __call__(self, x, to, blocking):
            moved.append((to, blocking))
            return x

    assert not set(inspect.signature(ops.MoveTo.__init__).parameters) - {"self"}
    for name in ("AllReduce", "AllGather", "ReduceScatter", "AlltoAll"):
        monkeypatch.setattr(transport.ops, name, lambda *a, **k: None)
    monkeypatch.setattr(transport.ops, "AlltoAllV", StandIn)
    monkeypatch.setattr(transport.ops, "MoveTo", MoveTo)
    t = transport.NativeTransport(Group("hccl_group_0", (0, 1), 0))
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    y = t.all_to_all_v(Tensor(x), Tensor(np.array([2, 3], np.int32)), Tensor(np.array([4, 1], np.int32)))
    assert np.array_equal(y.asnumpy(), x)
    (kwargs, shape, send, recv), = calls
    assert kwargs == {"group": "hccl_group_0", "block_size": 3} and shape == (15,)
    assert send.dtype == recv.dtype == ms.int64
    assert send.asnumpy().tolist() == [2, 3] and recv.asnumpy().tolist() == [4, 1]
    assert moved == [("CPU", True)] * 2


class _Doubling:
    """A stand-in transport for one rank of a 2-rank tp group: the values are not a real group's, the shapes are."""
    def __init__(self):
        self.group = Group("tp_0_2_abcdef012345", (0, 1), 0)

    def all_reduce(self, x):
        return x * 2

    def all_gather(self, x):
        return ops.concat((x, x), 0)

    def reduce_scatter(self, x):
        return x[:x.shape[0] // 2]


def test_counting_transport_counts_each_collective_each_time_a_graph_runs():
    """parallel/comm/counters.py: inside a compiled graph, each collective call counts its kind, group and the bytes
    entering it every time the graph runs, the backward's (the Cells' bprop) too; the values are the inner
    transport's; transport_for wraps only while counting is on, and never a group of one rank."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn
    from parallel.comm.collectives import AllReduce, GatherFromGroup
    from parallel.comm.counters import COUNTERS, CountingTransport, by_kind, counting
    from parallel.comm.transport import SelfTransport, transport_for

    counted = CountingTransport(_Doubling())

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = ms.Parameter(Tensor(np.ones((4, 3), np.float32)))
            self.sum, self.gather = AllReduce(counted), GatherFromGroup(counted)

        def construct(self, x):
            return (self.gather(self.sum(ops.matmul(x, self.w))) ** 2).sum()

    net = Net()
    step = ms.jit(ms.value_and_grad(net, None, net.trainable_params()))
    x = Tensor(np.ones((2, 4), np.float32))
    COUNTERS.take()
    for _ in range(2):
        loss, grads = step(x)
        [g.asnumpy() for g in grads]         # every collective of the run feeds the gradients
        records = COUNTERS.take()
        assert float(loss.asnumpy()) == 4 * 3 * 8 ** 2      # [4, 3] gathered, each 4 doubled
        # forward: all-reduce of [2, 3] and all-gather of [2, 3]; backward: reduce-scatter of [4, 3], all-reduce [2, 3]
        assert {(r["kind"], r["group"], r["size"], r["calls"], r["bytes"]) for r in records} == {
            ("all_reduce", "tp", 2, 2, 48), ("all_gather", "tp", 2, 1, 24), ("reduce_scatter", "tp", 2, 1, 48)}
        assert by_kind(records) == {"all_reduce": 48, "reduce_scatter": 48, "all_gather": 24, "all_to_all": 0,
                                    "broadcast": 0, "p2p": 0}
    pair = Group("p2p_0_2_abcdef012345", (0, 1), 0)
    assert not isinstance(transport_for(pair, "CPU"), CountingTransport)
    counting(True)
    try:
        assert isinstance(transport_for(pair, "CPU"), CountingTransport)
        assert isinstance(transport_for(Group("", (0,), 0), "CPU"), SelfTransport)
    finally:
        counting(False)
