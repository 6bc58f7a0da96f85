"""transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM checkpoints <-> TeleChatMoE parameters.

One table (`RULES`) names every tensor on both sides, gives its shape and says how its values move;
`hf_to_ours` and `ours_to_hf` walk it in opposite directions, so each mapping is written once. Every move is a
pure rearrangement of values (no arithmetic), so HF -> ours -> HF is bitwise exact.

What moves besides names:
- Routed experts: HF keeps one SwiGLU per expert as [out, in] Linear weights; ours stacks them with gate and up
  fused and transposed: w1 [E, h, 2I] = [gate^T | up^T], w2 [E, I, h] = down^T.
- RoPE channels: DeepSeek's checkpoints keep each head's rope channels as interleaved pairs (x0,x1),(x2,x3),...
  DeepseekV3 with rope_interleave=True de-interleaves them on every call, DeepseekV2 rotates them as complex
  pairs; our MLA applies rotate-half RoPE, so the rows that produce rope channels (per head of q_b_proj/q_proj,
  the rope rows of kv_a_proj_with_mqa) are permuted once, even channels first. q and k get the same permutation,
  so every q.k score, and with it the model, is unchanged. A DeepseekV3 with rope_interleave=false already holds
  them in rotate-half order: copied as they are, and written back so (`rope_interleaved=False` both ways).
- MTP: DeepSeek-V3 keeps depth d as decoder layer num_hidden_layers + d with enorm, hnorm, eh_proj,
  shared_head.norm and copies of the embedding and output head. Its eh_proj reads [enorm(embedding) |
  hnorm(hidden)] (DeepSeek's, vLLM's and Megatron's MTP), as our MTPBlock does, so it copies over unchanged.
  transformers' classes do not run MTP and save_pretrained leaves it out while config.json keeps
  num_nextn_predict_layers: such a checkpoint is refused with that key named (set it to 0 to convert without MTP).
- The sigmoid router's `e_score_correction_bias` is our `expert_bias`; DeepseekV2 has none (zeros here).

Config keys map in `telechat_moe.hf_config`; checkpoint folders are read and written by
`telechat_moe.safetensors_io` (`read_hf_dir` / `write_hf_dir`), the safetensors code the trainer's checkpoints use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import numpy as np

from oneline import InputError
from telechat_moe.config import ModelConfig

V3, V2 = "deepseek_v3", "deepseek_v2"
ARCHITECTURES = {V3: "DeepseekV3ForCausalLM", V2: "DeepseekV2ForCausalLM"}


class ConversionError(InputError):
    """A checkpoint or config that cannot be converted; the message names the tensor or key."""


# ---- the table ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """One tensor. scope: 'model' (absolute names), 'block' (any decoder layer), 'dense' / 'moe' (decoder layers of
    that kind), 'mtp' (the MTP wrapper around a block). `{e}` in `hf` stands for a routed expert index.
    move: copy | q_rope_rows / kv_rope_rows (de-interleave the rope rows) | expert_gate / expert_up / expert_down
    (one expert's slice of w1 / w2, transposed) | expert_bias (absent in DeepseekV2: zeros) | shared / tied (HF
    holds a copy of one of our tensors: checked equal, written back as a copy)."""
    scope: str
    hf: str
    ours: str
    shape: Callable[[ModelConfig], tuple]  # our shape
    move: str = "copy"
    when: Callable[[ModelConfig], bool] = lambda c: True


def _vh(c): return (c.vocab_size, c.hidden_size)
def _h(c): return (c.hidden_size,)
def _q_lora(c): return c.q_lora_rank > 0
def _no_q_lora(c): return c.q_lora_rank == 0
def _untied(c): return not c.tie_word_embeddings
def _shared_i(c): return c.moe_shared_expert_intermediate_size * c.n_shared_experts
def _q_norm(c): return c.q_lora_rank > 0 and c.qk_layernorm
def _kv_norm(c): return c.qk_layernorm


RULES = (
    Rule("model", "model.embed_tokens.weight", "embed_tokens.weight", _vh),
    Rule("model", "model.norm.weight", "norm.weight", _h),
    Rule("model", "lm_head.weight", "lm_head.weight", _vh, when=_untied),
    # a tied head: transformers' state_dict lists it, save_pretrained leaves it out
    Rule("model", "lm_head.weight", "embed_tokens.weight", _vh, "tied", when=lambda c: c.tie_word_embeddings),
    Rule("block", "input_layernorm.weight", "input_layernorm.weight", _h),
    Rule("block", "post_attention_layernorm.weight", "post_attention_layernorm.weight", _h),
    Rule("block", "self_attn.q_a_proj.weight", "self_attn.q_a_proj.weight",
         lambda c: (c.q_lora_rank, c.hidden_size), when=_q_lora),
    Rule("block", "self_attn.q_a_layernorm.weight", "self_attn.q_a_layernorm.weight",
         lambda c: (c.q_lora_rank,), when=_q_norm),
    Rule("block", "self_attn.q_b_proj.weight", "self_attn.q_b_proj.weight",
         lambda c: (c.num_attention_heads * c.qk_head_dim, c.q_lora_rank), "q_rope_rows", when=_q_lora),
    Rule("block", "self_attn.q_proj.weight", "self_attn.q_proj.weight",
         lambda c: (c.num_attention_heads * c.qk_head_dim, c.hidden_size), "q_rope_rows", when=_no_q_lora),
    Rule("block", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight",
         lambda c: (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size), "kv_rope_rows"),
    Rule("block", "self_attn.kv_a_layernorm.weight", "self_attn.kv_a_layernorm.weight",
         lambda c: (c.kv_lora_rank,), when=_kv_norm),
    Rule("block", "self_attn.kv_b_proj.weight", "self_attn.kv_b_proj.weight",
         lambda c: (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)),
    Rule("block", "self_attn.o_proj.weight", "self_attn.o_proj.weight",
         lambda c: (c.hidden_size, c.num_attention_heads * c.v_head_dim)),
    Rule("dense", "mlp.gate_proj.weight", "mlp.gate_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
    Rule("dense", "mlp.up_proj.weight", "mlp.up_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
    Rule("dense", "mlp.down_proj.weight", "mlp.down_proj.weight", lambda c: (c.hidden_size, c.intermediate_size)),
    Rule("moe", "mlp.gate.weight", "mlp.gate.weight", lambda c: (c.n_routed_experts, c.hidden_size)),
    Rule("moe", "mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias", lambda c: (c.n_routed_experts,),
         "expert_bias"),
    Rule("moe", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.w1",
         lambda c: (c.n_routed_experts, c.hidden_size, 2 * c.moe_intermediate_size), "expert_gate"),
    Rule("moe", "mlp.experts.{e}.up_proj.weight", "mlp.experts.w1",
         lambda c: (c.n_routed_experts, c.hidden_size, 2 * c.moe_intermediate_size), "expert_up"),
    Rule("moe", "mlp.experts.{e}.down_proj.weight", "mlp.experts.w2",
         lambda c: (c.n_routed_experts, c.moe_intermediate_size, c.hidden_size), "expert_down"),
    Rule("moe", "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.gate_proj.weight",
         lambda c: (_shared_i(c), c.hidden_size)),
    Rule("moe", "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.up_proj.weight",
         lambda c: (_shared_i(c), c.hidden_size)),
    Rule("moe", "mlp.shared_experts.down_proj.weight", "mlp.shared_experts.down_proj.weight",
         lambda c: (c.hidden_size, _shared_i(c))),
    Rule("mtp", "enorm.weight", "enorm.weight", _h),
    Rule("mtp", "hnorm.weight", "hnorm.weight", _h),
    Rule("mtp", "eh_proj.weight", "eh_proj.weight", lambda c: (c.hidden_size, 2 * c.hidden_size)),
    Rule("mtp", "shared_head.norm.weight", "norm.weight", _h),
    # DeepSeek-V3 stores the embedding and head the MTP module shares with the main model once more.
    Rule("mtp", "embed_tokens.weight", "embed_tokens.weight", _vh, "shared"),
    Rule("mtp", "shared_head.head.weight", "lm_head.weight", _vh, "shared", when=_untied),
    Rule("mtp", "shared_head.head.weight", "embed_tokens.weight", _vh, "shared", when=lambda c: c.tie_word_embeddings),
)


@dataclass(frozen=True)
class Entry:
    """A rule made concrete for one config: full names on both sides."""
    hf: str | None        # None: no HF tensor (DeepseekV2 has no correction bias)
    ours: str
    move: str
    shape: tuple          # our shape
    expert: int = -1


def _blocks(cfg: ModelConfig) -> Iterator[tuple[str, str, bool]]:
    """(HF prefix, our prefix, is MoE) of every decoder block, main layers then MTP depths."""
    for i in range(cfg.num_hidden_layers):
        yield f"model.layers.{i}.", f"layers.{i}.", cfg.is_moe_layer(i)
    for d in range(cfg.num_nextn_predict_layers):
        yield f"model.layers.{cfg.num_hidden_layers + d}.", f"mtp.{d}.block.", True


def entries(cfg: ModelConfig, family: str) -> list[Entry]:
    """Every tensor of a checkpoint of this config, in table order."""
    out = []

    def add(rule: Rule, hf: str | None, ours: str):
        shape = tuple(rule.shape(cfg))
        if "{e}" in rule.hf:
            out.extend(Entry(hf.format(e=e), ours, rule.move, shape, e) for e in range(cfg.n_routed_experts))
        else:
            out.append(Entry(hf, ours, rule.move, shape))

    for rule in RULES:
        if not rule.when(cfg):
            continue
        if rule.scope == "model":
            add(rule, rule.hf, rule.ours)
        elif rule.scope == "mtp":
            for d in range(cfg.num_nextn_predict_layers):
                ours = rule.ours if rule.move == "shared" else f"mtp.{d}.{rule.ours}"
                add(rule, f"model.layers.{cfg.num_hidden_layers + d}.{rule.hf}", ours)
        else:
            for hf_prefix, our_prefix, moe in _blocks(cfg):
                if rule.scope == "block" or (rule.scope == "moe") == moe:
                    hf = None if rule.move == "expert_bias" and family == V2 else hf_prefix + rule.hf
                    add(rule, hf, our_prefix + rule.ours)
    return out


def our_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Name -> shape of every TeleChatMoE parameter for this config, as the table knows them."""
    return {e.ours: e.shape for e in entries(cfg, V3) if e.move not in ("shared", "tied")}


# ---- moves --------------------------------------------------------------------------------------------------
def rope_deinterleave(rope_dim: int) -> np.ndarray:
    """ours[j] = hf[perm[j]]: pairs (2i, 2i+1) become (i, i + d/2), the halves rotate-half RoPE rotates together."""
    return np.concatenate([np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)])


def _rope_rows(cfg: ModelConfig, move: str, rows: int) -> np.ndarray:
    """Row order of a projection, ours from HF: identity except the rope rows."""
    perm = rope_deinterleave(cfg.qk_rope_head_dim)
    if move == "kv_rope_rows":
        return np.concatenate([np.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + perm])
    head = np.concatenate([np.arange(cfg.qk_nope_head_dim), cfg.qk_nope_head_dim + perm])
    return (np.arange(rows // cfg.qk_head_dim)[:, None] * cfg.qk_head_dim + head).reshape(-1)


def hf_to_ours(hf: Mapping[str, np.ndarray], cfg: ModelConfig, family: str = V3,
               rope_interleaved: bool = True) -> dict[str, np.ndarray]:
    """HF state dict -> our parameters. Every HF tensor must be used and every one of ours produced."""
    table = [e for e in entries(cfg, family) if e.move != "tied" or e.hf in hf]
    _check_names(hf, {e.hf for e in table if e.hf is not None}, cfg)
    ours: dict[str, np.ndarray] = {}
    inter = cfg.moe_intermediate_size
    for e in table:
        src = None if e.hf is None else np.asarray(hf[e.hf])
        if e.move in ("expert_gate", "expert_up", "expert_down"):
            _check_shape(e.hf, src.shape, (cfg.hidden_size, inter) if e.move == "expert_down"
                         else (inter, cfg.hidden_size))
            stack = ours.setdefault(e.ours, np.empty(e.shape, src.dtype))
            cols = {"expert_gate": slice(0, inter), "expert_up": slice(inter, 2 * inter),
                    "expert_down": slice(None)}[e.move]
            stack[e.expert, :, cols] = src.T
            continue
        if e.move == "expert_bias" and src is None:
            ours[e.ours] = np.zeros(e.shape, np.float32)
            continue
        _check_shape(e.hf, src.shape, e.shape)
        if e.move in ("shared", "tied"):
            continue  # checked once every main tensor is in
        if e.move in ("q_rope_rows", "kv_rope_rows") and rope_interleaved:
            ours[e.ours] = src[_rope_rows(cfg, e.move, src.shape[0])]
        else:
            ours[e.ours] = src
    for e in table:
        if e.move in ("shared", "tied") and not np.array_equal(np.asarray(hf[e.hf]), ours[e.ours]):
            raise ConversionError(f"{e.hf}: differs from {e.ours}, which TeleChatMoE shares with it")
    return ours


def ours_to_hf(ours: Mapping[str, np.ndarray], cfg: ModelConfig, family: str = V3,
               rope_interleaved: bool = True) -> dict[str, np.ndarray]:
    """Our parameters -> HF state dict (rope channels interleaved, as DeepSeek publishes them, unless
    rope_interleaved=False: DeepseekV3's rope_interleave=false layout, which is ours)."""
    table = [e for e in entries(cfg, family) if e.move != "tied"]
    missing = sorted({e.ours for e in table} - set(ours))
    if missing:
        raise ConversionError(f"checkpoint: missing {len(missing)} parameters of this config, e.g. {missing[0]}")
    inter = cfg.moe_intermediate_size
    hf: dict[str, np.ndarray] = {}
    for e in table:
        src = np.asarray(ours[e.ours])
        _check_shape(e.ours, src.shape, e.shape)
        if e.hf is None:
            if cfg.moe_router_enable_expert_bias and np.any(src):
                raise ConversionError(f"{e.ours}: non-zero expert bias; {ARCHITECTURES[family]} has no such tensor")
            continue
        if e.move in ("q_rope_rows", "kv_rope_rows") and rope_interleaved:
            out = np.empty_like(src)
            out[_rope_rows(cfg, e.move, src.shape[0])] = src
        elif e.move == "expert_gate":
            out = np.ascontiguousarray(src[e.expert, :, :inter].T)
        elif e.move == "expert_up":
            out = np.ascontiguousarray(src[e.expert, :, inter:].T)
        elif e.move == "expert_down":
            out = np.ascontiguousarray(src[e.expert].T)
        elif e.move == "expert_bias" and not cfg.moe_router_enable_expert_bias:
            out = np.zeros_like(src)  # our router ignores the bias then; DeepseekV3 always adds it
        else:
            out = src
        hf[e.hf] = out
    return hf


def _check_shape(name: str, got: tuple, expected: tuple) -> None:
    if tuple(got) != tuple(expected):
        raise ConversionError(f"{name}: shape {tuple(got)}, expected {tuple(expected)} for this config")


def _check_names(hf: Mapping[str, np.ndarray], expected: set, cfg: ModelConfig) -> None:
    quantised = sorted(n for n in hf if n.endswith("_scale_inv"))
    if quantised:
        raise ConversionError(f"{quantised[0]}: FP8 block-quantised checkpoint; dequantise it to bfloat16 first")
    mtp = [f"model.layers.{cfg.num_hidden_layers + d}." for d in range(cfg.num_nextn_predict_layers)]
    if mtp and not any(n.startswith(tuple(mtp)) for n in hf):
        raise ConversionError(
            f"config.json: num_nextn_predict_layers={cfg.num_nextn_predict_layers}, but the checkpoint holds no MTP "
            f"weights ({mtp[0]}*; transformers does not save them): set num_nextn_predict_layers: 0 in config.json "
            f"to convert it without MTP")
    unknown = sorted(set(hf) - expected)
    if unknown:
        raise ConversionError(
            f"{unknown[0]}: not a tensor of this config (num_hidden_layers={cfg.num_hidden_layers}, "
            f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}); {len(unknown)} such tensors")
    missing = sorted(expected - set(hf))
    if missing:
        raise ConversionError(f"{missing[0]}: missing from the checkpoint; {len(missing)} tensors missing")
