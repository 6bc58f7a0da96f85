"""TeleChat3-MoE: a DeepSeek-V3-like decoder. Embedding -> [MLA + (dense FFN | MoE)] x L -> norm -> head, plus MTP.

`construct` returns the losses separately (total, LM, MTP, aux, z) and the per-MoE-layer expert load, so the
trainer can log them and update the expert bias outside the gradient. Layers sit in one CellList and
`run_layers(h, start, end)` runs any contiguous slice of them, which is what a pipeline chunk is.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from dvm_fusion.grouped_matmul import grouped_matmul_for
from telechat_moe.config import ModelConfig
from telechat_moe.layers import Embedding, Linear, RMSNorm, SwiGLU, logsumexp, ms_dtype
from telechat_moe.mla import MultiLatentAttention, attention_bias, rope_tables
from telechat_moe.moe.dispatch import ExpertParallel
from telechat_moe.moe.layer import ROUTING_STATS, MoELayer
from telechat_moe.mtp import MTPBlock


def pipeline_cell_names():
    """Where each pipeline unit lives in TeleChatMoE, for the pipeline binding (which knows no model)."""
    from parallel.pipeline.mindspore_binding import CellNames
    return CellNames(embedding=("embed_tokens",), layer="layers.{i}", mtp=("mtp.0",), head=("norm", "lm_head"))


class DecoderLayer(nn.Cell):
    def __init__(self, cfg: ModelConfig, index: int, grouped_matmul, device_target: str = "CPU",
                 ep: ExpertParallel = ExpertParallel()):
        super().__init__()
        self.is_moe = cfg.is_moe_layer(index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MultiLatentAttention(cfg, device_target)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_moe:
            self.mlp = MoELayer(cfg, grouped_matmul, index, ep)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range,
                              ms_dtype(cfg.compute_dtype))
        self.zero = Tensor(0.0, ms.float32)
        self.no_load = Tensor(np.zeros(cfg.n_routed_experts + ROUTING_STATS, np.float32))

    def construct(self, x, cos, sin, mask):
        """-> (hidden, aux loss, z loss, routing statistics: expert load and dispatch traffic); dense layers
        report zero losses and statistics."""
        return self.ffn_block(self.attention_block(x, cos, sin, mask))

    # the two residual sublayers, apart so that tensor dumps can hold the stream between them
    def attention_block(self, x, cos, sin, mask):
        return x + self.self_attn(self.input_layernorm(x), cos, sin, mask).astype(x.dtype)

    def ffn_block(self, x):
        if self.is_moe:
            y, aux, z, load = self.mlp(self.post_attention_layernorm(x))
            return x + y.astype(x.dtype), aux, z, load
        return x + self.mlp(self.post_attention_layernorm(x)).astype(x.dtype), self.zero, self.zero, self.no_load


class TeleChatMoE(nn.Cell):
    def __init__(self, cfg: ModelConfig, device_target: str = "CPU", ep: ExpertParallel = ExpertParallel()):
        """`ep`: this rank's share of the routed experts and its exchanges (the default: every expert here)."""
        super().__init__()
        self.cfg = cfg
        gmm = grouped_matmul_for(device_target)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.initializer_range)
        self.layers = nn.CellList([DecoderLayer(cfg, i, gmm, device_target, ep) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The head computes in float32 (logits feed the softmax) and runs as its own cell, so a pipeline plan
        # that gives lm_head a stage moves its matmul there, not only its weight.
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, cfg.initializer_range, ms.float32)
        self.mtp = nn.CellList([MTPBlock(cfg, DecoderLayer(cfg, cfg.num_hidden_layers + d, gmm, device_target, ep))
                                for d in range(cfg.num_nextn_predict_layers)])
        length = max(cfg.seq_length, cfg.max_position_embeddings)
        cos, sin = rope_tables(cfg, length)
        self.cos, self.sin = Tensor(cos), Tensor(sin)
        self.causal = Tensor(np.tril(np.ones((cfg.seq_length, cfg.seq_length), dtype=np.bool_)))
        self.head_matmul = ops.MatMul(transpose_b=True)

    def set_recompute(self, mode: str) -> None:
        """Activation recomputation (recompute_config): `full` keeps each decoder layer's input only and reruns
        the layer in the backward; `selective` reruns the attention core only. Gradients are unchanged."""
        if mode not in ("none", "selective", "full"):
            raise ValueError(f"recompute: expected none, selective or full, got {mode!r}")
        for layer in list(self.layers) + [block.block for block in self.mtp]:
            if mode == "full":
                layer.recompute()
            elif mode == "selective":
                layer.self_attn.core.recompute()

    # ---- pieces -------------------------------------------------------------------------------------
    def embed(self, input_ids):
        return self.embed_tokens(input_ids)

    def attention_mask(self, segment_ids):
        """What the attention kernel needs to keep documents apart: segment ids (varlen) or an additive bias."""
        if self.cfg.attention_kernel == "varlen":
            return segment_ids
        return attention_bias(segment_ids, self.causal)

    def rope(self, position_ids):
        cos = ops.expand_dims(ops.gather(self.cos, position_ids, 0), 1)
        sin = ops.expand_dims(ops.gather(self.sin, position_ids, 0), 1)
        return cos, sin

    def run_layers(self, h, cos, sin, bias, start: int, end: int):
        aux, z, loads = 0.0, 0.0, []
        for i in range(start, end):
            h, a, zz, load = self.layers[i](h, cos, sin, bias)
            aux, z = aux + a, z + zz
            if self.layers[i].is_moe:
                loads.append(load)
        return h, aux, z, loads

    def logits(self, h):
        """[batch*seq, vocab] float32 logits."""
        b, s, d = h.shape
        if self.lm_head is not None:
            return self.lm_head(h.astype(ms.float32)).reshape(b * s, -1)
        return self.head_matmul(h.reshape(b * s, d).astype(ms.float32), self.embed_tokens.weight)

    @staticmethod
    def cross_entropy(logits, labels, mask):
        """Mean over masked-in positions of -log softmax(logits)[label], in float32."""
        labels = labels.reshape(-1, 1)
        nll = logsumexp(logits, -1) - ops.gather_elements(logits, 1, labels).squeeze(-1)
        mask = mask.reshape(-1).astype(ms.float32)
        return (nll * mask).sum() / ops.maximum(mask.sum(), 1.0)

    # ---- forward ------------------------------------------------------------------------------------
    def hidden_states(self, input_ids, segment_ids, position_ids):
        cos, sin = self.rope(position_ids)
        bias = self.attention_mask(segment_ids)
        h, aux, z, loads = self.run_layers(self.embed(input_ids), cos, sin, bias, 0, self.cfg.num_hidden_layers)
        return h, aux, z, loads, (cos, sin, bias)

    def layer_outputs(self, input_ids, segment_ids, position_ids):
        """The embedding, each decoder layer's residual stream after its attention and after its FFN, and the final
        norm, in forward order (for tensor dumps)."""
        cos, sin = self.rope(position_ids)
        bias = self.attention_mask(segment_ids)
        h = self.embed(input_ids)
        outs = [h]
        for layer in self.layers:
            h = layer.attention_block(h, cos, sin, bias)
            outs.append(h)
            h = layer.ffn_block(h)[0]
            outs.append(h)
        outs.append(self.norm(h))
        return tuple(outs)

    def head_losses(self, h, labels, loss_mask, cos, sin, bias, aux, z, loads):
        """Everything after the decoder layers: final norm, head, MTP blocks, and the losses."""
        lm_loss = self.cross_entropy(self.logits(self.norm(h)), labels, loss_mask)
        mtp_loss = ops.zeros((), ms.float32)   # a tensor also without MTP blocks: the step reads every loss's value
        next_ids, mtp_mask = labels, loss_mask
        for block in self.mtp:
            # Depth d sees the embedding of token i+d and predicts token i+d+1; the last d positions have no target.
            mtp_labels = ops.cat((next_ids[:, 1:], next_ids[:, -1:]), 1)
            mtp_mask = ops.cat((mtp_mask[:, 1:], ops.zeros_like(mtp_mask[:, -1:])), 1)
            h, a, zz, load = block(h, self.embed(next_ids), cos, sin, bias)
            aux, z = aux + a, z + zz
            loads.append(load)
            mtp_loss = mtp_loss + self.cross_entropy(self.logits(h), mtp_labels, mtp_mask)
            next_ids = mtp_labels
        if self.mtp:
            mtp_loss = mtp_loss / len(self.mtp)
        total = lm_loss + self.cfg.mtp_loss_factor * mtp_loss + aux + z
        return total, lm_loss, mtp_loss, aux, z, ops.stack(loads)

    def construct(self, input_ids, labels, loss_mask, segment_ids, position_ids):
        h, aux, z, loads, (cos, sin, bias) = self.hidden_states(input_ids, segment_ids, position_ids)
        return self.head_losses(h, labels, loss_mask, cos, sin, bias, aux, z, loads)
