"""The distributed optimizer's library (parallel/optim/): the bucket plan (routes never mixed, buckets closed at the
bucket size, padding to the group size, every element of every parameter held by exactly one rank of its group),
and in one process (groups of one rank) the graph-mode gradient reduction and AdamW against torch.optim.AdamW's
arithmetic in float64 (precision.reference_ops.adamw), bucketed equal to unbucketed bit for bit, the CPU kernel
against MindSpore's AdamWeightDecay (the Ascend path), float16 working weights from a float32 master, the skip of a
step that is not finite, and the state by parameter (checkpoint pieces, whole states) round-tripping. Across
processes the reduce-scatter / all-gather path is what tests/test_data_parallel.py and the other msrun tests train
with (recipes/base.yaml: optimizer_shard true)."""
from __future__ import annotations

import numpy as np
import pytest

from parallel.optim.buckets import BucketPlan, Route
from precision import reference_ops as ref
from precision.tolerance import relative_error, tolerance

DENSE, NORMS, EXPERT = Route("dp", weight_decay=0.1), Route("dp"), Route("edp", norm_sum="ep", weight_decay=0.1)


def test_plan_keeps_routes_apart_closes_buckets_and_pads_to_the_group():
    sizes = [6, 5, 7, 3, 100, 1]
    routes = [DENSE, NORMS, DENSE, EXPERT, DENSE, NORMS]
    plan = BucketPlan.of(sizes, routes, {"dp": 4, "edp": 2}, bucket_size=10)
    assert [b.params for b in plan.buckets] == [(0, 2), (4,), (1, 5), (3,)]
    assert [b.padded for b in plan.buckets] == [16, 100, 8, 4]
    # reductions issued as the backward completes the buckets: the one whose first parameter comes last first
    assert plan.backward_order() == (1, 3, 2, 0)
    assert all(len({routes[p] for p in b.params}) == 1 for b in plan.buckets)
    assert [b.params for b in BucketPlan.of(sizes, routes, {"dp": 4, "edp": 2}, 0).buckets] == [(0, 2, 4), (1, 5), (3,)]
    # every element of every parameter is held by exactly one rank of its group
    held = [np.zeros(s, int) for s in sizes]
    for dp_rank in range(4):
        for edp_rank in range(2):
            for piece in plan.pieces({"dp": dp_rank, "edp": edp_rank}):
                held[piece.param][piece.start:piece.start + piece.length] += 1
                assert piece.offset + piece.length <= plan.buckets[piece.bucket].shard_size
    # each dense element counted once per edp rank (2), each expert element once per dp rank (4)
    assert all((h == (4 if routes[i].shard == "edp" else 2)).all() for i, h in enumerate(held))
    assert plan.shard_elements() == 4 + 25 + 2 + 2


def _graph():
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE)


def _single_groups():
    from parallel.comm.groups import Group
    from parallel.comm.transport import SelfTransport
    return {name: SelfTransport(Group("", (0,), 0)) for name in ("dp", "edp", "ep", "tp")}


SHAPES = [(4, 6), (6,), (3, 2, 5), (7,), (40, 3)]
ROUTES = [DENSE, NORMS, EXPERT, NORMS, DENSE]


def _step_cell(arrays, bucket_size: int, fused: bool, dtype=None, clip: float = 0.0, micro: bool = False):
    import mindspore as ms
    from mindspore import Parameter, nn, ops, Tensor
    from parallel.optim.distributed import ShardedAdamW, ShardedGradients

    params = [Parameter(Tensor(a).astype(dtype or ms.float32), name=f"w{i}") for i, a in enumerate(arrays)]
    plan = BucketPlan.of([a.size for a in arrays], ROUTES, {"dp": 1, "edp": 1}, bucket_size)
    groups = _single_groups()
    prepare = ShardedGradients(plan, groups, dp=1, clip=clip, accumulate=micro)
    opt = ShardedAdamW(params, plan, groups, 1e-3, (0.9, 0.95), 1e-8, fused=fused)

    class Step(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.prepare, self.opt = prepare, opt

        def construct(self, grads, grad_scale, lr):
            ops.assign(self.opt.learning_rate, lr)
            shards, factor, norm, finite = self.prepare(grads, grad_scale)
            return ops.depend(norm, self.opt(shards, factor, finite)), finite

    return Step(), prepare, opt


@pytest.mark.parametrize("bucket_size", [10])
def test_one_process_step_is_torch_adamw(bucket_size):
    import mindspore as ms
    from mindspore import Tensor
    _graph()
    rng = np.random.default_rng(bucket_size)
    arrays = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in SHAPES]
    step, _, opt = _step_cell(arrays, bucket_size, fused=True, clip=5.0)
    ref_p = [a.astype(np.float64) for a in arrays]
    ref_m = [(np.zeros_like(p), np.zeros_like(p)) for p in ref_p]
    for t, (lr, scale) in enumerate([(1e-3, 0.5), (2e-3, 1.0), (1e-3, 0.25)], start=1):
        grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
        norm, finite = step(tuple(Tensor(g) for g in grads), Tensor(scale, ms.float32), Tensor(lr, ms.float32))
        assert bool(finite.asnumpy())
        want_norm = scale * np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
        assert abs(float(norm.asnumpy()) - want_norm) <= 1e-5 * want_norm
        factor = scale * 5.0 / max(want_norm, 5.0)        # clipped to a norm of 5
        for i, g in enumerate(grads):
            ref_p[i], *ref_m[i] = ref.adamw(ref_p[i], g.astype(np.float64) * factor, *ref_m[i], lr=lr, beta1=0.9,
                                            beta2=0.95, eps=1e-8, weight_decay=ROUTES[i].weight_decay, step=t)
    for i, p in enumerate(opt.parameters):
        assert relative_error(p.asnumpy() - arrays[i], ref_p[i] - arrays[i]) <= 8 * tolerance("float32").rtol / 1e-3


def _run(arrays, grads_per_step, **kw):
    import mindspore as ms
    from mindspore import Tensor
    step, prepare, opt = _step_cell(arrays, **kw)
    for grads in grads_per_step:
        step(tuple(Tensor(g) for g in grads), Tensor(1.0, ms.float32), Tensor(1e-2, ms.float32))
    return [p.asnumpy() for p in opt.parameters], opt


def test_bucketed_equals_unbucketed_and_the_kernels_equal_the_ops_path():
    _graph()
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(3)]
    exact_one, _ = _run(arrays, grads, bucket_size=0, fused=True)
    exact_many, _ = _run(arrays, grads, bucket_size=1, fused=True)
    assert all(np.array_equal(a, b) for a, b in zip(exact_one, exact_many))
    plain, _ = _run(arrays, grads, bucket_size=10, fused=False)
    assert all(relative_error(a - w, b - w) <= 1e-4 for a, b, w in zip(exact_one, plain, arrays))


def test_slice_kernel_steps_only_its_range_of_the_bucket():
    import mindspore as ms
    from mindspore import Parameter, ParameterTuple, Tensor, nn
    from dvm_fusion.adamw import adamw_hyper, adamw_slice_update_cpu
    _graph()
    rng = np.random.default_rng(11)
    sizes = [5, 300_000, 7, 600_000]
    arrays = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    lo, length = 3, 600_003                       # from inside the first to inside the last, over two threads

    class Step(nn.Cell):
        def __init__(self):
            super().__init__()
            self.p = ParameterTuple([Parameter(Tensor(a), name=f"p{i}") for i, a in enumerate(arrays)])
            self.m = Parameter(Tensor(np.zeros(length, np.float32)), name="m")
            self.v = Parameter(Tensor(np.zeros(length, np.float32)), name="v")

        def construct(self, g, hyper):
            return adamw_slice_update_cpu(self.p, self.m, self.v, g, hyper, Tensor([0.1], ms.float32),
                                          Tensor([lo], ms.int64))

    step = Step()
    g = rng.standard_normal(length).astype(np.float32)
    f32 = ms.float32
    hyper = adamw_hyper(*(Tensor(x, f32) for x in (1e-2, 0.9, 0.95, 1e-8, 0.5, 0.1, np.sqrt(0.05), 2)), Tensor(True))
    assert float(step(Tensor(g), hyper).asnumpy()[0]) == 0.0
    flat = np.concatenate(arrays).astype(np.float64)
    want, m, v = ref.adamw(flat[lo:lo + length], g.astype(np.float64) * 0.5, np.zeros(length), np.zeros(length),
                           lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1)
    got = np.concatenate([p.asnumpy() for p in step.p])
    assert np.array_equal(got[:lo], flat[:lo].astype(np.float32))
    assert np.array_equal(got[lo + length:], flat[lo + length:].astype(np.float32))
    # the step taken against the expected one: exact up to the rounding of the stored parameter
    scale = float(np.abs(flat).max()) / 1e-2
    assert relative_error(got[lo:lo + length] - flat[lo:lo + length], want - flat[lo:lo + length]) \
        <= 4 * tolerance("float32").rtol * scale
    assert relative_error(step.m.asnumpy(), m) <= 4 * tolerance("float32").rtol


def test_float16_weights_follow_the_float32_master():
    import mindspore as ms
    _graph()
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(2)]
    half, opt = _run(arrays, grads, bucket_size=0, fused=True, dtype=ms.float16)
    full, _ = _run([a.astype(np.float16).astype(np.float32) for a in arrays], grads, bucket_size=0, fused=True)
    from parallel.optim.state import whole_states
    master = whole_states(opt)["master"]
    assert all(p.dtype == np.float16 for p in half)
    assert all(np.array_equal(m, f) for m, f in zip(master, full))         # the master stepped in float32
    assert all(np.array_equal(h, f.astype(np.float16)) for h, f in zip(half, full))


def test_a_step_that_is_not_finite_changes_nothing_and_state_round_trips():
    import mindspore as ms
    from mindspore import Tensor
    from parallel.optim.state import load_pieces, local_pieces, whole_states
    _graph()
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    step, _, opt = _step_cell(arrays, 10, fused=True)
    step(tuple(Tensor(rng.standard_normal(s).astype(np.float32)) for s in SHAPES), Tensor(1.0, ms.float32),
         Tensor(1e-2, ms.float32))
    before = whole_states(opt)
    weights = [p.asnumpy().copy() for p in opt.parameters]
    bad = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    bad[2][0, 0, 0] = np.inf
    _, finite = step(tuple(Tensor(g) for g in bad), Tensor(1.0, ms.float32), Tensor(1e-2, ms.float32))
    assert not bool(finite.asnumpy())
    assert all(np.array_equal(p.asnumpy(), w) for p, w in zip(opt.parameters, weights))
    assert int(opt.global_step.asnumpy()[0]) == 1
    pieces = local_pieces(opt)
    assert sorted(p.param for p, _ in pieces) == list(range(len(SHAPES)))
    load_pieces(opt, {p.param: {k: np.zeros_like(v) for k, v in s.items()} for p, s in pieces})
    assert all(not s.any() for s in whole_states(opt)["adam_m"])
    load_pieces(opt, {p.param: s for p, s in pieces})
    after = whole_states(opt)
    assert all(np.array_equal(a, b) for k in after for a, b in zip(after[k], before[k]))


def test_micro_batches_accumulate_in_float32_buffers():
    import mindspore as ms
    from mindspore import Tensor, nn
    _graph()
    rng = np.random.default_rng(9)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    g1, g2 = ([rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(2))
    step, prepare, opt = _step_cell(arrays, 10, fused=True, micro=True)

    class Add(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.prepare = prepare

        def construct(self, grads):
            return self.prepare.accumulate(grads)

    Add()(tuple(Tensor(g) for g in g1))
    step(tuple(Tensor(g) for g in g2), Tensor(1.0, ms.float32), Tensor(1e-2, ms.float32))
    summed, _ = _run(arrays, [[a + b for a, b in zip(g1, g2)]], bucket_size=10, fused=True)
    assert all(np.array_equal(p.asnumpy(), s) for p, s in zip(opt.parameters, summed))
    assert all(not b.asnumpy().any() for b in prepare.grad_buffers)
