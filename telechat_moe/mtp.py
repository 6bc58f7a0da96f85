"""Multi-token prediction, depth 1 (DeepSeek-V3): from the main model's last hidden state at position i and the
embedding of token i+1, one extra decoder block predicts token i+2 through the shared output head.
The projection sees [embedding | hidden], the order of DeepSeek's checkpoints, Megatron and vLLM."""
from __future__ import annotations

from mindspore import nn, ops

from telechat_moe.config import ModelConfig
from telechat_moe.layers import Linear, RMSNorm, ms_dtype


class MTPBlock(nn.Cell):
    def __init__(self, cfg: ModelConfig, block: nn.Cell):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, cfg.initializer_range, ms_dtype(cfg.compute_dtype))
        self.block = block
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def construct(self, hidden, next_embeds, cos, sin, mask):
        h = self.eh_proj(ops.cat((self.enorm(next_embeds), self.hnorm(hidden)), -1))
        h, aux, z, load = self.block(h, cos, sin, mask)
        return self.norm(h), aux, z, load
