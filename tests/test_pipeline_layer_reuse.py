"""Under pp x ep a chunk of two layers or more gets a compiled graph per layer (pipeline_step.reuse_layers): such a
chunk with two MoE layers of one shared graph met the other layer's data-dependent exchange size in its backward
(docs/pipeline.md); elsewhere context.lazy_inline decides."""
from __future__ import annotations

import pytest

from telechat_moe.pipeline_step import StagePlan, reuse_layers
from telechat_moe.recipe import load_recipe

PP = ["parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=4"]
EP = ["parallel_config.data_parallel=2", "parallel_config.expert_parallel=2"]


def plan(*bounds) -> StagePlan:
    return StagePlan(tuple(bounds), 2, len(bounds) // 2, 0, "")


@pytest.mark.parametrize("sets,bounds,reused", [
    ([], None, True), (EP, None, True),
    (PP, ((0, 3), (3, 4)), True),                           # no exchange
    (PP + EP, ((0, 3), (3, 4)), False),                     # three layers on stage 0
    (PP + EP, ((0, 0), (0, 1), (1, 2), (2, 3), (3, 4), (4, 4)), True),   # one layer a chunk, MTP alone at the end
    (PP + EP, ((0, 1), (1, 2), (2, 3), (3, 4)), False),     # the last chunk: layer 3 and MTP's block
    (PP + EP + ["context.lazy_inline=false"], ((0, 0), (0, 1), (1, 2), (2, 3), (3, 4), (4, 4)), False)])
def test_layers_share_a_graph_unless_a_chunk_holds_two_under_expert_parallelism(sets, bounds, reused):
    assert reuse_layers(load_recipe("tiny", sets), bounds and plan(*bounds)) is reused
