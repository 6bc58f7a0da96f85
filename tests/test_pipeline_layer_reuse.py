"""Under pp x ep the decoder layers get a compiled graph each (pipeline_step.reuse_layers): a chunk with two MoE
layers of one shared graph met the other layer's data-dependent exchange size in its backward (docs/pipeline.md);
elsewhere context.lazy_inline decides."""
from __future__ import annotations

import pytest

from telechat_moe.pipeline_step import reuse_layers
from telechat_moe.recipe import load_recipe

PP = ["parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=4"]
EP = ["parallel_config.data_parallel=2", "parallel_config.expert_parallel=2"]


@pytest.mark.parametrize("sets,reused", [([], True), (PP, True), (EP, True), (PP + EP, False),
                                         (PP + ["context.lazy_inline=false"], False)])
def test_layers_share_a_graph_unless_pipeline_and_expert_parallel(sets, reused):
    assert reuse_layers(load_recipe("tiny", sets)) is reused
