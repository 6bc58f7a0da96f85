"""A pipeline plan as MindFormers' recipe keys (parallel/pipeline/mindformers_export.py) and the planner command
that writes them (`python -m telechat_moe.plan --export-mindformers`): the keys of hand-made placements, MindFormers
1.9's own converter and LayerSetting reading them back into the plan's stage and chunk of every layer (the tiny,
105b and 1t recipes too), the plans it refuses, and the command's one-line errors."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from parallel.layout import ParallelLayout
from parallel.pipeline.mindformers_export import ExportError, export
from parallel.pipeline.placement import Unit, evaluate
from telechat_moe.plan import main, parse_layout, recipe_placement
from telechat_moe.recipe import find_recipe, load_recipe
from telechat_moe.workload import recipe_layout, recipe_workload


def chain(layers: int) -> list[Unit]:
    """The model's units in order: embedding, a dense layer, MoE layers, MTP, head."""
    return ([Unit("embedding", "embedding", 1.0, 1.0)]
            + [Unit(f"L{i}", "dense" if i == 0 else "moe", 1.0, 2.0, layer=i) for i in range(layers)]
            + [Unit("mtp", "mtp", 1.0, 2.0), Unit("head", "head", 1.0, 1.0)])


def placed(units: list[Unit], stages: int, chunks: int, sizes) -> tuple:
    return evaluate(units, stages, chunks, sizes), sum(u.kind in ("dense", "moe") for u in units)


def layers_where(placement) -> list[tuple[int, int]]:
    """(stage, chunk) of each decoder layer in the plan."""
    return [placement.location(u.name) for u in placement.units if u.kind in ("dense", "moe")]


def mindformers_places(keys: dict, num_layers: int, monkeypatch) -> list[tuple[int, int]]:
    """(stage, chunk) of each decoder layer as MindFormers 1.9 builds them from the keys: the `parallel` section into
    MindSpore's auto-parallel context (as its ParallelOperator does), model_config with parallel_config through its
    converter into a TransformerConfig, and LayerSetting as TransformerBlock makes it (use_legacy: False, as in its
    TeleChat3-MoE recipe)."""
    import mindspore as ms
    from mindformers.parallel_core.training_graph.transformer import utils
    from mindformers.parallel_core.transformer_config_utils import convert_to_transformer_config

    monkeypatch.setattr(utils, "is_legacy_model", lambda: False)
    ms.set_auto_parallel_context(pipeline_stages=keys["parallel_config"]["pipeline_stage"], **keys["parallel"])
    try:
        config = convert_to_transformer_config({"num_hidden_layers": num_layers, "hidden_size": 64,
                                                "num_attention_heads": 4, **keys["model"]["model_config"],
                                                "parallel_config": dict(keys["parallel_config"])})
        setting = utils.LayerSetting(config.num_layers, config.offset, config,
                                     config.virtual_pipeline_model_parallel_size)
        return [(int(s), int(c)) for s, c in zip(setting.pp_ids, setting.interleave_ids)]
    finally:
        ms.reset_auto_parallel_context()


# 10 layers; segment k = chunk k // p of stage k % p; the layers per segment are the sizes less the other units
HAND_MADE = {
    "1f1b p=4": (4, 1, (4, 3, 2, 4), "1f1b", 8, {
        "parallel_config": {"pipeline_stage": 4, "micro_batch_num": 8},
        "parallel": {"pipeline_config": {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"}},
        "model": {"model_config": {"offset": [1, 1, 0, 0], "pp_interleave_num": 1}}}),
    "interleaved p=2 v=2": (2, 2, (3, 2, 4, 4), "interleaved", 4, {
        "parallel_config": {"pipeline_stage": 2, "micro_batch_num": 4},
        "parallel": {"pipeline_config": {"pipeline_interleave": True, "pipeline_scheduler": "1f1b"}},
        "model": {"model_config": {"offset": [[0, 0], [2, 0]], "pp_interleave_num": 2}}}),
    "gpipe p=2": (2, 1, (1 + 6, 4 + 2), "gpipe", 2, {
        "parallel_config": {"pipeline_stage": 2, "micro_batch_num": 2},
        "parallel": {"pipeline_config": {"pipeline_interleave": True, "pipeline_scheduler": "gpipe"}},
        "model": {"model_config": {"offset": [1, -1], "pp_interleave_num": 1}}}),
}


@pytest.mark.parametrize("name", list(HAND_MADE))
def test_keys_of_hand_made_placements(name, monkeypatch):
    stages, chunks, sizes, schedule, m, expected = HAND_MADE[name]
    placement, layers = placed(chain(10), stages, chunks, sizes)
    layout = ParallelLayout(dp=2, pp=stages, vpp=chunks, micro_batch_num=m)
    keys = export(placement, schedule, m, layout).recipe_keys()
    assert keys == expected
    assert mindformers_places(keys, layers, monkeypatch) == layers_where(placement)


def test_the_recipes_own_layouts_through_the_command(tmp_path, capsys, monkeypatch):
    """105b's recipe degrees as 1F1B (p=4, no virtual stages) and tiny on 2 devices with pp=2: the file the command
    writes holds the keys of the trainer's placement, and MindFormers reads every layer back onto the plan's stage.
    (105b's own interleaved layout: as 1t's, below.)"""
    for name, args in (("105b", ["--evaluate", "tp=2,pp=4,ep=64,m=4"]), ("tiny", ["--devices", "2", "--evaluate",
                                                                              "pp=2"])):
        out = tmp_path / f"{name}.yaml"
        assert main(["--recipe", name, *args, "--export-mindformers", str(out)]) == 0
        assert capsys.readouterr().out.endswith(f"wrote MindFormers' pipeline keys to {out}\n")
        keys = yaml.safe_load(out.read_text())
        recipe = load_recipe(name)
        w = recipe_workload(recipe, "ascend910b", 2 if name == "tiny" else None)
        layout = parse_layout(args[-1], w, recipe)
        placement = recipe_placement(recipe, w, layout)
        assert keys == export(placement, "1f1b", layout.micro_batch_num).recipe_keys()
        assert keys["parallel_config"] == {"pipeline_stage": layout.pp, "micro_batch_num": layout.micro_batch_num}
        assert keys["parallel"] == {"pipeline_config": {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"}}
        offset = keys["model"]["model_config"]["offset"]
        assert keys["model"]["model_config"]["pp_interleave_num"] == 1 and len(offset) == layout.pp
        assert sum(offset) == recipe.model.num_hidden_layers % layout.pp
        assert mindformers_places(keys, recipe.model.num_hidden_layers, monkeypatch) == layers_where(placement)
        assert "offset: [" in out.read_text()  # a flow list, as MindFormers' recipes write it


def test_1t_interleaved(monkeypatch):
    """1t at p=16, v=2: offset [2][16], read back by MindFormers chunk by chunk. (At tp=8, ep=256 and the flat
    exchange: the recipe's own tp=4, ep=32 hierarchical layout leaves the head's chunk without a decoder layer,
    which MindFormers' offset cannot hold: its export is refused, docs/expert-exchange.md.)"""
    recipe = load_recipe("1t", ["parallel_config.model_parallel=8", "parallel_config.data_parallel=32",
                                "parallel_config.expert_parallel=256", "parallel_config.micro_batch_num=64",
                                "model.moe_token_dispatcher_type=alltoall"])
    w = recipe_workload(recipe, "ascend910b")
    layout = recipe_layout(recipe, w)
    placement = recipe_placement(recipe, w, layout)
    keys = export(placement, "interleaved", layout.micro_batch_num, layout).recipe_keys()
    model = keys["model"]["model_config"]
    assert model["pp_interleave_num"] == 2 and [len(row) for row in model["offset"]] == [16, 16]
    assert keys["parallel"]["pipeline_config"] == {"pipeline_interleave": True, "pipeline_scheduler": "1f1b"}
    assert mindformers_places(keys, recipe.model.num_hidden_layers, monkeypatch) == layers_where(placement)


P4, _ = placed(chain(10), 4, 1, (4, 3, 2, 4))
V2, _ = placed(chain(10), 2, 2, (3, 2, 4, 4))
LAYOUT4 = ParallelLayout(dp=2, pp=4, micro_batch_num=8)


@pytest.mark.parametrize("plan, schedule, m, layout, expect", [
    (V2, "overlapped", 4, None, "schedule: MindFormers' recipe keys cannot express 'overlapped'"),
    (P4, "zb-v", 8, None, "schedule: expected one of"),
    (V2, "1f1b", 4, None, "schedule: 1f1b runs one chunk per stage, the placement has 2"),
    (placed(chain(10), 1, 1, (13,))[0], "1f1b", 8, None, "parallel_config.pipeline_stage: the plan has 1 stage"),
    (P4, "1f1b", 3, None, "parallel_config.micro_batch_num: 3 micro-batches cannot fill 4 stages"),
    (V2, "interleaved", 5, None, "parallel_config.micro_batch_num: the interleaved schedule needs a multiple of"),
    (P4, "1f1b", 8, dataclasses.replace(LAYOUT4, pp=2, dp=4), "parallel_config.pipeline_stage: the layout says 2"),
    (P4, "1f1b", 8, dataclasses.replace(LAYOUT4, vpp=2), "parallel_config.pp_interleave_num: the layout says 2"),
    (P4, "1f1b", 8, dataclasses.replace(LAYOUT4, micro_batch_num=12), "parallel_config.micro_batch_num: the layout"),
    (P4, "1f1b", 8, dataclasses.replace(LAYOUT4, ep=3), "parallel_config.expert_parallel: expert_parallel*"),
    (placed(chain(10), 4, 1, (3, 3, 6, 1))[0], "1f1b", 8, None,
     "model_config.offset: mtp is on stage 2, chunk 0; MindFormers puts the head and MTP on the last"),
    (placed(chain(10), 4, 1, (0, 5, 4, 4))[0], "1f1b", 8, None, "model_config.offset: the embedding is on stage 1"),
    (placed(chain(10), 4, 1, (6, 5, 0, 2))[0], "1f1b", 8, None,
     "model_config.offset: stage 2, chunk 0 holds no decoder layer"),
    (placed(chain(10), 4, 1, (5, 3, 3, 2))[0], "1f1b", 8, None,
     "model_config.offset: stage 3, chunk 0 holds no decoder layer; MindFormers needs one in every segment but "
     "the first"),
])
def test_plans_mindformers_cannot_express_are_refused(plan, schedule, m, layout, expect):
    with pytest.raises(ExportError) as e:
        export(plan, schedule, m, layout)
    assert str(e.value).startswith(expect) and "\n" not in str(e.value)


def test_an_embedding_only_first_segment_is_expressed(monkeypatch):
    """LayerSetting lets the first segment hold no layer (offset -base there), the embedding alone on stage 0."""
    placement, layers = placed(chain(10), 4, 1, (1, 4, 4, 4))
    keys = export(placement, "1f1b", 4).recipe_keys()
    assert keys["model"]["model_config"]["offset"] == [-2, 2, 2, 0]
    assert mindformers_places(keys, layers, monkeypatch) == layers_where(placement)


@pytest.fixture
def small_memory_105b(tmp_path):
    """105b with 4 GB per device, where no placement fits."""
    path = tmp_path / "small.yaml"
    path.write_text(f"base: {find_recipe('105b').resolve()}\ncontext:\n  max_device_memory_gb: 4\n")
    return str(path)


@pytest.mark.parametrize("args, expect", [
    (["--recipe", "tiny"], "parallel_config.pipeline_stage: the plan has 1 stage"),
    (["--recipe", "tiny", "--devices", "2", "--evaluate", "pp=2,vpp=2"],
     "model_config.offset: stage 1, chunk 1 holds no decoder layer"),
    (["--recipe", "105b", "--devices", "512"], "--export-mindformers: the recipe's layout is for 256 devices"),
    (["--recipe", "105b", "--global-batch", "96"], "a global batch divisible by 128; give the layout with --evaluate"),
    (["--recipe", None], "satisfies memory_limit"),
])
def test_command_bad_input_is_one_line_exit_2_and_no_file(args, expect, tmp_path, capsys, small_memory_105b):
    out = tmp_path / "out.yaml"
    out.write_text("precious: true\n")
    args = [a or small_memory_105b for a in args]
    assert main([*args, "--export-mindformers", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("telechat_moe.plan: ") and expect in err, err
    assert out.read_text() == "precious: true\n"


def test_command_refuses_to_overwrite_its_recipe(capsys):
    assert main(["--recipe", "105b", "--export-mindformers", "recipes/105b.yaml"]) == 2
    assert capsys.readouterr().err == ("telechat_moe.plan: --export-mindformers: refusing to overwrite the input "
                                       "recipe; name a new file\n")
