"""parallel/layout.py: the layout rules give the same answer on scalars and on NumPy arrays, ParallelLayout's
errors name the degree (and read in a caller's names), and the groups cover the world once."""
import itertools

import numpy as np
import pytest

from parallel.layout import (Axis, LayoutError, ParallelLayout, check_model_fit, experts_fold_over_dense,
                             experts_split, fills_world, global_batch_splits, heads_split, interleave_fills_stages,
                             interleave_has_stages, kv_heads_split, layers_fill_chunks, micro_batches_fill_stages,
                             sequence_parallel_has_tp, tp_within_node)
from parallel.planner.model_shape import TELECHAT3_36B
from tests.test_planner_model_shape import TELECHAT3_105B

S = TELECHAT3_105B
RULES = {  # rule: its arguments as (name, values)
    fills_world: dict(dp=(1, 2, 3), tp=(1, 2, 8), cp=(1, 2), pp=(1, 4), world_size=(8, 16)),
    experts_fold_over_dense: dict(dp=(1, 2, 3), cp=(1, 2), tp=(1, 2, 8), ep=(1, 2, 4, 5), etp=(1, 2)),
    micro_batches_fill_stages: dict(pp=(1, 2, 4, 8), m=(1, 3, 4, 8)),
    interleave_has_stages: dict(pp=(1, 2), vpp=(1, 2, 3)),
    interleave_fills_stages: dict(pp=(1, 2, 4), vpp=(1, 2), m=(2, 3, 4, 6, 8)),
    sequence_parallel_has_tp: dict(sp=(False, True), tp=(1, 2)),
    tp_within_node: dict(tp=(1, 8, 16), devices_per_node=(8, 16)),
    global_batch_splits: dict(global_batch=(48, 128), dp=(1, 3, 8), mbs=(1, 2, 3)),
}
SHAPE_RULES = {heads_split: dict(tp=(1, 3, 8, 64)), experts_split: dict(ep=(1, 5, 64, 384)),
               layers_fill_chunks: dict(pp=(1, 8, 16), vpp=(1, 3, 8))}


@pytest.mark.parametrize("rule", list(RULES) + list(SHAPE_RULES), ids=lambda r: r.__name__)
def test_rules_agree_on_scalars_and_arrays(rule):
    args = RULES.get(rule) or SHAPE_RULES[rule]
    combos = list(itertools.product(*args.values()))
    lead = () if rule in RULES else (S,)
    scalar = [bool(rule(*lead, **dict(zip(args, c)))) for c in combos]
    arrays = rule(*lead, **{k: np.array([c[i] for c in combos]) for i, k in enumerate(args)})
    assert list(np.asarray(arrays, dtype=bool)) == scalar
    assert 0 < sum(scalar) < len(scalar) or rule in (sequence_parallel_has_tp, interleave_has_stages)


@pytest.mark.parametrize("kwargs, field, own, named", [
    (dict(dp=2, ep=4), "ep", "ep: ep*etp = 4 must divide dp*cp*tp = 2",
     "expert_parallel*expert_model_parallel = 4 must divide data_parallel*context_parallel*model_parallel = 2"),
    (dict(pp=4, micro_batch_num=2), "micro_batch_num",
     "micro_batch_num: 2 micro-batches cannot fill 4 pipeline stages (need at least 4)", None),
    (dict(vpp=2), "vpp", "vpp: virtual pipeline chunks need pp > 1",
     "virtual pipeline chunks need pipeline_stage > 1"),
    (dict(pp=2, vpp=2, micro_batch_num=3), "micro_batch_num",
     "micro_batch_num: interleaved 1F1B needs micro_batch_num (3) divisible by pp (2)",
     "interleaved 1F1B needs micro_batch_num (3) divisible by pipeline_stage (2)"),
    (dict(sp=True), "sp", "sp: sequence parallelism needs tp > 1", "sequence parallelism needs model_parallel > 1"),
    (dict(etp=0), "etp", "etp: expected a positive integer, got 0", None),
])
def test_errors_name_the_degree(kwargs, field, own, named):
    names = {"dp": "data_parallel", "tp": "model_parallel", "pp": "pipeline_stage", "ep": "expert_parallel",
             "etp": "expert_model_parallel", "cp": "context_parallel"}
    with pytest.raises(LayoutError) as e:
        ParallelLayout(**kwargs).validate()
    assert e.value.field == field and str(e.value) == own
    assert e.value.reason(names) == (named or own.split(": ", 1)[1])


def test_world_size_and_model_fit():
    with pytest.raises(LayoutError) as e:
        ParallelLayout(dp=2, tp=2).validate(8)
    assert e.value.field == "world_size" and str(e.value) == "world_size: dp*tp*cp*pp = 2*2*1*1 = 4, but the " \
                                                              "device count is 8"
    assert ParallelLayout(dp=2, tp=2, sp=True).validate(4).world_size == 4
    check_model_fit(S, tp=8, pp=8, vpp=1, ep=4, devices_per_node=8)
    for kwargs, field, text in ((dict(tp=3), "tp", "tp=3 does not divide the 32 attention heads"),
                                (dict(ep=5), "ep", "ep=5 does not divide the 192 routed experts"),
                                (dict(pp=16, vpp=3), "pp",
                                 "pp*vpp = 48 chunks for only 45 layers and the embedding and head"),
                                (dict(tp=16), "tp", "tp=16 spans more than one node of 8 devices")):
        with pytest.raises(LayoutError) as e:
            check_model_fit(S, **{**dict(tp=1, pp=1, vpp=1, ep=1, devices_per_node=8), **kwargs})
        assert e.value.field == field and e.value.reason() == text


def test_gqa_kv_heads_and_dense_experts_fit():
    """GQA's 8 KV heads split over tp (or tp is a multiple of them); MLA has none to split; a dense model has no
    experts to split: ep = etp = 1. Scalars and arrays agree, and check_model_fit names the degree at fault."""
    tps = (1, 2, 4, 6, 8, 12, 16)
    assert [bool(kv_heads_split(TELECHAT3_36B, tp)) for tp in tps] == [True, True, True, False, True, False, True]
    assert list(kv_heads_split(TELECHAT3_36B, np.array(tps))) == [bool(kv_heads_split(TELECHAT3_36B, t)) for t in tps]
    assert all(kv_heads_split(S, tp) for tp in tps)  # MLA
    pairs = [(1, 1), (8, 1), (1, 2), (2, 2)]
    assert [bool(experts_split(TELECHAT3_36B, ep, etp)) for ep, etp in pairs] == [True, False, False, False]
    assert list(experts_split(TELECHAT3_36B, *map(np.array, zip(*pairs)))) == [True, False, False, False]
    assert experts_split(S, 64, 2)
    base = dict(tp=1, pp=1, vpp=1, ep=1, devices_per_node=8)
    for kwargs, field, text in (
            (dict(tp=6), "tp", "tp=6 neither divides the 8 KV heads nor is a multiple of them"),
            (dict(ep=8), "ep", "ep=8,etp=1: a dense model has no routed experts to split; give ep=1,etp=1"),
            (dict(etp=2), "etp", "ep=1,etp=2: a dense model has no routed experts to split; give ep=1,etp=1")):
        with pytest.raises(LayoutError) as e:
            check_model_fit(TELECHAT3_36B, **{**base, **kwargs})
        assert e.value.field == field and e.value.reason() == text
    check_model_fit(TELECHAT3_36B, **{**base, "tp": 8})


def test_groups_cover_the_world_once():
    lay = ParallelLayout(dp=4, tp=2, pp=2, ep=4, etp=2, micro_batch_num=2).validate(16)
    for axis in Axis:
        groups = lay.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(16))
        assert {len(g) for g in groups} == {lay.degree(axis)}
