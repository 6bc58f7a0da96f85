"""The MindSpore binding for the 105b and 1t layouts: every layer placed once, stage counts, divisibility, the
layout check, MindFormers' own LayerSetting reading our offset back, and MindSpore's Pipeline applying it."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from parallel.pipeline.mindspore_binding import MINDFORMERS_NAMES, BindingError, bind
from parallel.pipeline.placement import PlacementOptions, balance, planner_units
from parallel.pipeline.schedules import build, validate

recipe_mod = pytest.importorskip("telechat_moe.recipe")
workload = pytest.importorskip("telechat_moe.workload")

LAYOUTS = {"105b": ("recipes/105b.yaml", "1f1b"), "1t": ("recipes/1t.yaml", "interleaved")}


def planned(name: str, options: PlacementOptions = PlacementOptions()):
    path, schedule = LAYOUTS[name]
    recipe = recipe_mod.load_recipe(path)
    shape, layout = recipe.model.to_model_shape(), recipe.layout
    in_flight = validate(build(schedule, layout.pp, layout.vpp, layout.micro_batch_num)).peak_in_flight_by_chunk
    w = workload.recipe_workload(recipe, "ascend910b")
    priced = workload.recipe_layout(recipe, w)
    options = dataclasses.replace(options, memory_limit=workload.memory_limit(recipe, w))
    return balance(planner_units(w, priced, options), layout.pp, layout.vpp, options, in_flight), schedule, layout, shape


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_config_places_every_layer_once(name):
    placement, schedule, layout, shape = planned(name)
    cfg = bind(placement, schedule, layout.micro_batch_num, layout)
    layers = [f"decoder.layers.{i}" for i in range(shape.num_layers)]
    assert set(cfg.stage_config) == set(layers) | {"embedding", "mtp", "decoder.final_layernorm", "output_layer"}
    assert cfg.pipeline_stages == layout.pp and set(cfg.stage_config.values()) == set(range(layout.pp))
    assert set(cfg.chunk_of.values()) == set(range(layout.vpp))
    assert cfg.micro_size == layout.micro_batch_num and cfg.micro_size % layout.pp == 0
    assert cfg.pipeline_interleave == (layout.vpp > 1)
    # forward order walks stages 0..p-1 once per chunk: (chunk, stage) never goes backwards along the layers
    walk = [(cfg.chunk_of[n], cfg.stage_config[n]) for n in ["embedding", *layers, "mtp", "output_layer"]]
    assert walk == sorted(walk)
    assert cfg.stage_config["embedding"] == 0 and cfg.stage_config["output_layer"] == layout.pp - 1


def _layer_setting(num_layers, offset, pp, vpp):
    """MindFormers' own layer-to-stage rule (LayerSetting) applied to an offset."""
    import mindspore as ms
    from mindformers.parallel_core.training_graph.transformer.utils import LayerSetting

    ms.set_auto_parallel_context(pipeline_stages=pp, pipeline_config={"pipeline_interleave": vpp > 1,
                                                                      "pipeline_scheduler": "1f1b"})
    try:
        cfg = SimpleNamespace(swap=SimpleNamespace(swap=False), recompute=False, pipeline_stage=pp,
                              gradient_aggregation_group=4)
        setting = LayerSetting(num_layers, offset, cfg, vpp)
        return [int(x) for x in setting.pp_ids], [int(x) for x in setting.interleave_ids]
    finally:
        ms.reset_auto_parallel_context()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mindformers_offset_reproduces_the_plan(name, monkeypatch, tmp_path):
    monkeypatch.setenv("LOG_MF_PATH", str(tmp_path))
    placement, schedule, layout, shape = planned(name)
    cfg = bind(placement, schedule, layout.micro_batch_num, layout)
    keys = cfg.mindformers
    assert keys["parallel_config"] == {"pipeline_stage": layout.pp, "micro_batch_num": layout.micro_batch_num}
    model = keys["model"]["model_config"]
    assert model["pp_interleave_num"] == layout.vpp
    offset = model["offset"] if layout.vpp > 1 else [model["offset"]]
    assert len(offset) == layout.vpp and all(len(row) == layout.pp for row in offset)
    assert sum(map(sum, offset)) == shape.num_layers % (layout.pp * layout.vpp)
    stages, chunks = _layer_setting(shape.num_layers, model["offset"], layout.pp, layout.vpp)
    for i in range(shape.num_layers):
        assert (stages[i], chunks[i]) == (cfg.stage_config[f"decoder.layers.{i}"], cfg.chunk_of[f"decoder.layers.{i}"])


def test_mtp_apart_is_refused_where_forward_order_contradicts_it():
    """MTP on stage 14 and the head on stage 15 (1t, v=2): TeleChatMoE runs lm_head before mtp.0 and MindFormers'
    GPTModel decoder.final_layernorm before mtp, so MindSpore would read MTP's stage as a third chunk; the binding
    names the option instead of producing that configuration. MTP with the head binds for both."""
    from telechat_moe.model import pipeline_cell_names

    apart, _, layout, _ = planned("1t", PlacementOptions(mtp_apart_from_head=True))
    assert apart.location("mtp") == (14, 1) and apart.location("head") == (15, 1)
    for names, before in ((pipeline_cell_names(), "lm_head"), (MINDFORMERS_NAMES, "decoder.final_layernorm")):
        with pytest.raises(BindingError, match=f"mtp_apart_from_head: .* runs after {before} \\(stage 15\\).*"
                                               f"chunk 2, the plan says chunk 1"):
            bind(apart, "overlapped", layout.micro_batch_num, layout, names=names)
        together, _, _, _ = planned("1t")
        cfg = bind(together, "overlapped", layout.micro_batch_num, layout, names=names)
        assert cfg.parallel_speed_up == {"pp_1f1b_overlap": "AlltoAll,AlltoAllV"}
        assert cfg.stage_config[names.mtp[0]] == cfg.stage_config[names.head[-1]] == 15


def test_forward_order_is_our_models():
    """The order the binding checks chunks against is the order TeleChatMoE's forward first runs those cells."""
    import numpy as np
    import mindspore as ms
    from telechat_moe.model import TeleChatMoE, pipeline_cell_names

    ms.set_context(mode=ms.PYNATIVE_MODE)  # forward pre-hooks run in PyNative only
    recipe = recipe_mod.load_recipe("tiny", ["model.num_hidden_layers=3", "model.seq_length=16",
                                             "model.max_position_embeddings=16"])
    model = TeleChatMoE(recipe.model)
    names = pipeline_cell_names()
    expected = names.forward_order(range(recipe.model.num_hidden_layers))
    seen: list[str] = []
    cells = dict(model.cells_and_names())
    for name in expected:
        cells[name].register_forward_pre_hook(lambda cell, args, name=name: seen.append(name))
    ids = np.arange(2 * 16, dtype=np.int32).reshape(2, 16) % recipe.model.vocab_size
    batch = (ids, np.roll(ids, -1, 1), np.ones(ids.shape, np.float32), np.zeros_like(ids),
             np.tile(np.arange(16, dtype=np.int32), (2, 1)))
    model(*(ms.Tensor(a) for a in batch))
    assert list(dict.fromkeys(seen)) == expected  # first runs, in order
    assert seen.count("embed_tokens") > 1 and seen.count("lm_head") > 1  # MTP reuses them after the head


def test_layout_mismatch_is_named():
    placement, schedule, layout, _ = planned("1t")
    with pytest.raises(BindingError, match="parallel_config.pipeline_stage"):
        bind(placement, schedule, layout.micro_batch_num, dataclasses.replace(layout, pp=8, dp=64))
    with pytest.raises(BindingError, match="parallel_config.micro_batch_num"):
        bind(placement, schedule, 40, dataclasses.replace(layout, micro_batch_num=40))  # 40 % 16 != 0
    with pytest.raises(BindingError, match="interleaved schedule needs a multiple of the 16 stages"):
        bind(placement, schedule, 40)
    with pytest.raises(BindingError, match="1f1b runs one chunk"):
        bind(placement, "1f1b", layout.micro_batch_num)
    with pytest.raises(BindingError, match="schedule"):
        bind(placement, "zb-v", layout.micro_batch_num)


def test_mindspore_applies_it():
    """MindSpore's own APIs take the configuration: the context accepts it and Pipeline sets each cell's stage."""
    import mindspore as ms
    from mindspore import nn

    placement, schedule, layout, shape = planned("105b")
    cfg = bind(placement, schedule, layout.micro_batch_num, layout)

    class Decoder(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([nn.Cell() for _ in range(shape.num_layers)])
            self.final_layernorm = nn.Cell()

    class GPT(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embedding, self.decoder, self.mtp, self.output_layer = nn.Cell(), Decoder(), nn.Cell(), nn.Cell()

    net = GPT()
    cfg.wrap(net)
    for name, cell in net.cells_and_names():
        if name in cfg.stage_config:
            assert cell.pipeline_stage == cfg.stage_config[name]
    ms.set_auto_parallel_context(**cfg.auto_parallel_context())
    try:
        assert ms.get_auto_parallel_context("pipeline_stages") == layout.pp
        assert ms.get_auto_parallel_context("pipeline_scheduler") == cfg.pipeline_scheduler
    finally:
        ms.reset_auto_parallel_context()
    del net.mtp  # a plan naming a cell the network lacks is refused by MindSpore itself
    with pytest.raises(KeyError, match="mtp"):
        cfg.wrap(net)


def test_binding_names_cells_that_exist_in_our_model():
    """The plan for a small pipelined tiny model names only cells that TeleChatMoE really has."""
    from telechat_moe.model import TeleChatMoE, pipeline_cell_names
    recipe = recipe_mod.load_recipe("tiny", ["parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=2"])
    shape, layout = recipe.model.to_model_shape(), recipe.layout
    in_flight = validate(build("1f1b", layout.pp, layout.vpp, layout.micro_batch_num)).peak_in_flight_by_chunk
    w = workload.recipe_workload(recipe, "cpu")
    priced = workload.recipe_layout(recipe, w)
    placement = balance(planner_units(w, priced), layout.pp, layout.vpp, PlacementOptions(), in_flight)
    cfg = bind(placement, "1f1b", layout.micro_batch_num, layout, names=pipeline_cell_names())
    cells = {name for name, _ in TeleChatMoE(recipe.model).cells_and_names()}
    assert set(cfg.stage_config) <= cells
    assert {f"layers.{i}" for i in range(shape.num_layers)} <= set(cfg.stage_config)
