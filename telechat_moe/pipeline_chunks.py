"""TeleChatMoE cut into pipeline chunks for the replay executor (parallel/pipeline/replay.py): decoder-layer chunks,
the tail after the last layer, and a batch cut into micro-batches of the chunks' form. The replay tests and the
alignment harness's PP path run the model through these, so both check the same cut."""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops

from telechat_moe.moe.layer import ROUTING_STATS


class LayerChunk(nn.Cell):
    """Decoder layers [start, end) of the model; chunk 0 also embeds. Activations: (hidden, aux, z)."""

    def __init__(self, model, start: int, end: int):
        super().__init__(auto_prefix=False)
        self.model, self.start, self.end = model, start, end

    def construct(self, acts, side):
        _, _, cos, sin, bias = side
        if self.start == 0:
            h, aux, z = self.model.embed(acts[0]), ops.zeros((), ms.float32), ops.zeros((), ms.float32)
        else:
            h, aux, z = acts
        h, a, zz, _ = self.model.run_layers(h, cos, sin, bias, self.start, self.end)
        return h, aux + a, z + zz


class HeadAndLoss(nn.Cell):
    """The model's own tail after the decoder layers (final norm, head, MTP), returning the total loss."""

    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, acts, side):
        h, aux, z = acts
        labels, mask, cos, sin, bias = side
        # head_losses stacks the routing statistics, which no loss reads: one zero row keeps a model without MTP
        # stackable
        no_load = ops.zeros(self.model.cfg.n_routed_experts + ROUTING_STATS, ms.float32)
        return self.model.head_losses(h, labels, mask, cos, sin, bias, aux, z, [no_load])[0]


def replay_microbatches(model, batch, m: int) -> list[tuple]:
    """The model's batch arrays (ids, labels, loss mask, segments, positions) cut into m micro-batches of
    LayerChunk's form: (ids,) for chunk 0, (labels, mask, cos, sin, attention mask) on the side."""
    rows = len(batch[0]) // m
    mbs = []
    for i in range(m):
        ids, labels, mask, segments, positions = (Tensor(a[i * rows:(i + 1) * rows]) for a in batch)
        cos, sin = model.rope(positions)
        mbs.append(((ids,), (labels, mask, cos, sin, model.attention_mask(segments))))
    return mbs
