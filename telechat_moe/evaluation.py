"""The held-out loss: the language-model loss on the first `training.eval_batches` held-out batches, computed in
pieces by the data-parallel ranks (and by the pipeline's last stage) and put together into the one-process value."""
from __future__ import annotations

from typing import Callable

from mindspore import nn

from data_sched.loader import BatchLoader
from telechat_moe.model import TeleChatMoE
from telechat_moe.recipe_schema import Recipe


class Evaluate(nn.Cell):
    def __init__(self, model: TeleChatMoE):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, labels, loss_mask, segment_ids, position_ids):
        return self.model(input_ids, labels, loss_mask, segment_ids, position_ids)[1]


def held_out_share(recipe: Recipe, held, dp_rank: int, ep: int, lm_loss: Callable[[dict, slice], float]) -> float:
    """This rank's part of the held-out loss, scaled so that the mean over ranks of the parts is the loss.
    `lm_loss(batch, rows)`: the LM loss of those rows of a batch on this rank (0 on a pipeline stage but the last)."""
    # The held-out batches of a one-process run; data-parallel rank r evaluates rows [r*B/dp, (r+1)*B/dp) of
    # each, weighted by its share of the rows (every row holds as many loss tokens), so the ranks' shares add
    # up to the one-process loss whether or not dp divides B.
    rows = min(len(held), recipe.training.global_batch_size)
    dp = recipe.parallel_config.data_parallel
    if ep > 1:      # the expert exchanges are collectives of equal shapes: as many rows on every rank
        rows -= rows % dp
    lo, hi = dp_rank * rows // dp, (dp_rank + 1) * rows // dp
    loader = BatchLoader(held, rows, recipe.seed)
    n = min(recipe.training.eval_batches, loader.batches_per_epoch)
    share = 0.0
    for i in range(n):
        if hi > lo:
            share += (hi - lo) / rows * lm_loss(loader.batch_at(0, i), slice(lo, hi))
    return share * dp / n
