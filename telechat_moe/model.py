"""TeleChat3-MoE: a DeepSeek-V3-like decoder. Embedding -> [MLA + (dense FFN | MoE)] x L -> norm -> head, plus MTP.

`construct` returns the losses separately (total, LM, MTP, aux, z) and the per-MoE-layer expert load, so the
trainer can log them and update the expert bias outside the gradient. Layers sit in one CellList and
`run_layers(h, start, end)` runs any contiguous slice of them, which is what a pipeline chunk is.

Built for one rank of a layout: `ep` says which routed experts it holds, `tp` its tensor-parallel group. Over tp > 1
the embedding and the output head are split over the vocabulary (vocab-parallel cross-entropy: no rank holds a
full row of logits), attention over heads, the FFNs over their columns (parallel/tp); under sequence parallelism
the residual stream between the regions is this rank's sequence shard [b, s/tp, h]. Over cp (parallel/cp) the inputs
are the whole sequences and the rank computes its positions of them (`embed` and `rope` take them, attention gathers
the keys and values, `head_losses` sums each loss's parts over the group).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from dvm_fusion.grouped_matmul import grouped_matmul_for
from dvm_fusion.rowwise import CrossEntropyCPU
from telechat_moe.config import ModelConfig
from parallel.cp import ContextParallel, ShardSequence, SumOverContext
from parallel.tp import VocabParallelCrossEntropy, VocabParallelEmbedding
from parallel.tp.mappings import TensorParallel
from telechat_moe.layers import Embedding, RMSNorm, SwiGLU, column_linear, ms_dtype, weight_seed
from telechat_moe.mla import MultiLatentAttention, attention_bias, rope_tables, sliced
from telechat_moe.moe.dispatch import ExpertParallel
from telechat_moe.moe.layer import ROUTING_STATS, MoELayer
from telechat_moe.mtp import MTPBlock


# Replicated weights inside a tensor-parallel region: each rank's gradient is its share (its heads, its tokens)
INSIDE_REGIONS = (".self_attn.q_a_proj.", ".self_attn.q_a_layernorm.", ".self_attn.kv_a_proj_with_mqa.",
                  ".self_attn.kv_a_layernorm.", ".mlp.gate.")


class DecoderLayer(nn.Cell):
    def __init__(self, cfg: ModelConfig, index: int, grouped_matmul, device_target: str = "CPU",
                 ep: ExpertParallel = ExpertParallel(), tp: TensorParallel = TensorParallel(), seed: int = 0,
                 name: str = "", cp: ContextParallel = ContextParallel()):
        """`name`: the layer's parameter prefix (layers.3, mtp.0.block), which seeds its weights."""
        super().__init__()
        name = name or f"layers.{index}"
        self.is_moe = cfg.is_moe_layer(index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device_target)
        self.self_attn = MultiLatentAttention(cfg, device_target, seed, f"{name}.self_attn", tp, cp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device_target)
        if self.is_moe:
            self.mlp = MoELayer(cfg, grouped_matmul, index, ep, tp, seed, f"{name}.mlp", device_target,
                                cp.tokens(tp) if cp.cp > 1 else None)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range,
                              ms_dtype(cfg.compute_dtype), seed, f"{name}.mlp", tp, device_target)
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


def constants_digest(cell: nn.Cell) -> str:
    """A digest of every value `cell`'s graph reads as a constant: the attributes of it and its sub-cells but
    parameters (graph inputs) and MindSpore's creation stamps, tensors by their bytes. Layers with equal digests
    build the same graph."""
    digest = hashlib.sha256()
    for path, sub in cell.cells_and_names():
        for name, value in sorted(vars(sub).items()):
            if name in ("_params", "_cells", "_create_time") or isinstance(value, (Parameter, nn.Cell)):
                continue
            if isinstance(value, Tensor):
                value = (value.shape, value.dtype, hashlib.sha256(value.asnumpy().tobytes()).hexdigest())
            digest.update(f"{path}.{name}={value!r};".encode())
    return digest.hexdigest()


class ReusedDecoderLayer(DecoderLayer):
    """A DecoderLayer whose graph MindSpore parses, infers and differentiates once for all layers of equal
    constants (the dense ones, the MoE ones, MTP's), then inlines into each (lazy_inline, policy "front": the
    backend gets the same flat graph as without it). Compiling small's step took 21 s of its first step, most of it
    in the frontend, which otherwise walks every layer's copy of the same graph. Keyed by `constants_digest`, so a
    layer that differs by any constant (none does today, tests/test_layer_reuse.py) gets a graph of its own."""

    @ms.lazy_inline(policy="front", attrs="graph_key")
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.graph_key = constants_digest(self)


class AbsentLayer(nn.Cell):
    """The place of a decoder layer another pipeline stage holds: no weights, so the layers this stage builds keep
    their names (layers.{i}) and their seeds."""

    def __init__(self, is_moe: bool):
        super().__init__()
        self.is_moe = is_moe


@dataclass(frozen=True)
class StageParts:
    """What one pipeline stage builds: its decoder layers, the embedding (the first stage; the last too when MTP
    looks up the next tokens there: a copy whose gradient the trainer sums with the first stage's), and the tail
    (final norm, head, MTP blocks). `None` for TeleChatMoE: everything."""
    layers: frozenset
    embedding: bool
    tail: bool


class TeleChatMoE(nn.Cell):
    def __init__(self, cfg: ModelConfig, device_target: str = "CPU", ep: ExpertParallel = ExpertParallel(),
                 tp: TensorParallel = TensorParallel(), parts: StageParts | None = None, reuse_layers: bool = True,
                 cp: ContextParallel = ContextParallel()):
        """`ep`: this rank's share of the routed experts and its exchanges (the default: every expert here); `tp`:
        its tensor-parallel group (the default: none); `parts`: what its pipeline stage holds (the default: the
        whole model); `reuse_layers`: compile equal decoder layers' graph once (ReusedDecoderLayer); `cp`: its
        context-parallel group (the default: none). Weights are
        seeded by MindSpore's global seed and their names, so any part equals the whole model's."""
        super().__init__()
        self.cfg = cfg
        self.tp, self.cp = tp, cp
        self.context_shard = ShardSequence(cp)
        self.sum_over_context = SumOverContext(cp) if cp.cp > 1 else None
        parts = parts or StageParts(frozenset(range(cfg.num_hidden_layers)), True, True)
        self.parts = parts
        seed = ms.get_seed() or 0
        gmm = grouped_matmul_for(device_target)
        std = cfg.initializer_range
        layer = ReusedDecoderLayer if reuse_layers else DecoderLayer
        if not parts.embedding:
            self.embed_tokens = None
        elif tp.tp == 1:
            self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, std, weight_seed(seed, "embed_tokens"))
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp.transport, std, tp.sp,
                                                       weight_seed(seed, "embed_tokens"))
        self.layers = nn.CellList([layer(cfg, i, gmm, device_target, ep, tp, seed, "", cp) if i in parts.layers
                                   else AbsentLayer(cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)])
        tail = parts.tail
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device_target) if tail else None
        # The head computes in float32 (logits feed the softmax) and runs as its own cell, so a pipeline plan
        # that gives lm_head a stage moves its matmul there, not only its weight. Over tp its output is this
        # rank's vocabulary columns.
        head_kwargs = {} if tp.tp == 1 else {"sequence_parallel": tp.sp}
        self.lm_head = None if cfg.tie_word_embeddings or not tail else column_linear(
            cfg.hidden_size, cfg.vocab_size, std, ms.float32, weight_seed(seed, "lm_head"), tp, **head_kwargs)
        # one per loss (the LM's, each MTP depth's): under the pipeline executor's PyNative autograd over a compiled
        # chunk, one instance called twice gave the LM loss a backward 0.4-0.7% off (pp2 x tp2 with MTP: the final
        # norm's weight gradient; docs/pipeline.md)
        self.vocab_cross_entropy = nn.CellList([
            VocabParallelCrossEntropy(tp.transport) for _ in range(1 + cfg.num_nextn_predict_layers)]) \
            if tp.tp > 1 and tail else None
        # on CPU one kernel each way for the loss per position (dvm_fusion/rowwise.py)
        self.fused_cross_entropy = CrossEntropyCPU() if device_target != "Ascend" else None
        self.mtp = nn.CellList([
            MTPBlock(cfg, layer(cfg, cfg.num_hidden_layers + d, gmm, device_target, ep, tp, seed, f"mtp.{d}.block",
                                cp),
                     seed, f"mtp.{d}", tp, device_target)
            for d in range(cfg.num_nextn_predict_layers if tail else 0)])
        length = max(cfg.seq_length, cfg.max_position_embeddings)
        cos, sin = rope_tables(cfg, length)
        self.cos, self.sin = Tensor(cos), Tensor(sin)
        # the dense kernel's [s, s] causal mask; flash attention reads the documents from the segment ids alone
        self.causal = (Tensor(np.tril(np.ones((cfg.seq_length, cfg.seq_length), dtype=np.bool_)))
                       if cfg.attention_kernel == "dense" else None)
        self.head_matmul = ops.MatMul(transpose_b=True)

    def tp_split_axes(self) -> dict[str, int]:
        """{parameter name: the axis split over tp} of the tensor-parallel weights this rank holds a slice of."""
        from parallel.tp import ColumnParallelLinear, RowParallelLinear
        out = {}
        for name, cell in self.cells_and_names():
            if isinstance(cell, (ColumnParallelLinear, RowParallelLinear)):
                out[f"{name}.weight"] = cell.split_axis
            elif isinstance(cell, VocabParallelEmbedding):
                out[f"{name}.weight"] = 0
        return out

    def partial_over_tp(self, name: str) -> bool:
        """Whether the replicated weight `name` (not one of tp_split_axes(), not a routed expert) gets only this
        rank's share of its gradient (summed over tp by the trainer): under sequence parallelism every replicated
        weight (they see sequence shards or sit inside a region), otherwise those inside a region
        (INSIDE_REGIONS); a weight replicated outside any region sees the same tensors on every rank and gets the
        whole gradient."""
        if self.tp.tp == 1:
            return False
        return self.tp.sp or any(part in f".{name}" for part in INSIDE_REGIONS)

    def set_recompute(self, mode: str) -> None:
        """Activation recomputation (recompute_config): `full` keeps each decoder layer's input only and reruns
        the layer in the backward; `selective` reruns the attention core only. Gradients are unchanged."""
        if mode not in ("none", "selective", "full"):
            raise ValueError(f"recompute: expected none, selective or full, got {mode!r}")
        for layer in [x for x in self.layers if not isinstance(x, AbsentLayer)] + [block.block for block in self.mtp]:
            if mode == "full":
                layer.recompute()
                layer.self_attn.split = sliced      # split_last's own bprop would keep its input (mla.sliced)
            elif mode == "selective":
                layer.self_attn.core.recompute()

    # ---- pieces -------------------------------------------------------------------------------------
    def embed(self, input_ids):
        """The embedding of the whole sequences' tokens [b, s] at this rank's positions (all of them but under cp)."""
        return self.embed_tokens(self.context_shard(input_ids))

    def attention_mask(self, segment_ids):
        """What the attention kernel needs to keep documents apart: segment ids (flash) or an additive bias."""
        if self.cfg.attention_kernel == "flash":
            return segment_ids
        return attention_bias(segment_ids, self.causal)

    def rope(self, position_ids):
        position_ids = self.context_shard(position_ids)
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
        """[batch*seq, vocab] float32 logits (over tp: this rank's vocabulary columns [batch*seq, vocab/tp], of
        the whole sequence also under sequence parallelism)."""
        if self.lm_head is not None:
            out = self.lm_head(h.astype(ms.float32))
            return out.reshape(-1, out.shape[-1])
        return self.head_matmul(h.reshape(-1, h.shape[-1]).astype(ms.float32), self.embed_tokens.weight)

    def loss(self, logits, labels, mask, depth: int = 0):
        """`cross_entropy` of this rank's logits against the whole sequences' `labels` and `mask` [b, s]:
        vocab-parallel over tp (parallel.tp.VocabParallelCrossEntropy); over cp the mean of the rank's positions
        made its part of the whole sequences' mean and summed over the group (parallel.cp.SumOverContext)."""
        whole_mask = mask
        labels, mask = self.context_shard(labels), self.context_shard(mask)
        if self.vocab_cross_entropy is not None:
            mean = self.vocab_cross_entropy[depth](logits, labels, mask)
        else:
            mean = self.cross_entropy(logits, labels, mask, self.fused_cross_entropy)
        if self.sum_over_context is not None:
            return self.sum_over_context(mean, mask, whole_mask)
        return mean

    @staticmethod
    def cross_entropy(logits, labels, mask, fused=None):
        """Mean over masked-in positions of -log softmax(logits)[label], in float32. `fused`: a kernel giving the
        masked per-position losses (dvm_fusion.rowwise.CrossEntropyCPU), else MindSpore's operators."""
        mask = mask.reshape(-1).astype(ms.float32)
        if fused is not None:
            nll = fused(logits, labels.reshape(-1).astype(ms.int32), mask)
        else:
            # MindSpore's LogSoftmax kernel and its gradient: forward and backward 2.3x faster on CPU than the
            # same value composed of max, exp, sum and log (tiny: 64 of 1400 ms a step over the two heads)
            nll = -ops.gather_elements(ops.log_softmax(logits, -1), 1, labels.reshape(-1, 1)).squeeze(-1) * mask
        return nll.sum() / ops.maximum(mask.sum(), 1.0)

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
        return self.chunk_outputs(input_ids, cos, sin, bias, 0, len(self.layers), True, True)[1]

    def chunk_outputs(self, x, cos, sin, bias, start: int, end: int, first: bool, last: bool):
        """`layer_outputs` of a pipeline chunk, layers [start, end): (the stream it passes on, its outputs). On the
        first chunk `x` are token ids and the embedding is its first output; on the last the final norm is its
        last."""
        h = self.embed(x) if first else x
        outs = [h] if first else []
        for i in range(start, end):
            h = self.layers[i].attention_block(h, cos, sin, bias)
            outs.append(h)
            h = self.layers[i].ffn_block(h)[0]
            outs.append(h)
        if last:
            outs.append(self.norm(h))
        return h, tuple(outs)

    def head_losses(self, h, labels, loss_mask, cos, sin, bias, aux, z, loads):
        """Everything after the decoder layers: final norm, head, MTP blocks, and the losses."""
        lm_loss = self.loss(self.logits(self.norm(h)), labels, loss_mask)
        mtp_loss = ops.zeros((), ms.float32)   # a tensor also without MTP blocks: the step reads every loss's value
        next_ids, mtp_mask = labels, loss_mask
        for d, block in enumerate(self.mtp):
            # Depth d sees the embedding of token i+d and predicts token i+d+1; the last d positions have no target.
            mtp_labels = ops.cat((next_ids[:, 1:], next_ids[:, -1:]), 1)
            mtp_mask = ops.cat((mtp_mask[:, 1:], ops.zeros_like(mtp_mask[:, -1:])), 1)
            h, a, zz, load = block(h, self.embed(next_ids), cos, sin, bias)
            aux, z = aux + a, z + zz
            loads.append(load)
            mtp_loss = mtp_loss + self.loss(self.logits(h), mtp_labels, mtp_mask, 1 + d)
            next_ids = mtp_labels
        if self.mtp:
            mtp_loss = mtp_loss / len(self.mtp)
        total = lm_loss + self.cfg.mtp_loss_factor * mtp_loss + aux + z
        return total, lm_loss, mtp_loss, aux, z, ops.stack(loads)

    def construct(self, input_ids, labels, loss_mask, segment_ids, position_ids):
        h, aux, z, loads, (cos, sin, bias) = self.hidden_states(input_ids, segment_ids, position_ids)
        return self.head_losses(h, labels, loss_mask, cos, sin, bias, aux, z, loads)
