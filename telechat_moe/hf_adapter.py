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
  so every q.k score, and with it the model, is unchanged.
- MTP: DeepSeek-V3 keeps depth d as decoder layer num_hidden_layers + d with enorm, hnorm, eh_proj,
  shared_head.norm and copies of the embedding and output head. Its eh_proj reads [enorm(embedding) |
  hnorm(hidden)] (DeepSeek's, vLLM's and Megatron's MTP), as our MTPBlock does, so it copies over unchanged.
  transformers' classes do not run MTP; the converter still carries it.
- The sigmoid router's `e_score_correction_bias` is our `expert_bias`; DeepseekV2 has none (zeros here).

Config keys map in `config_from_hf` / `hf_config_from`; where a transformers class computes something our model
cannot reproduce, `semantic_gaps` says so. Files: `read_hf_dir` / `write_hf_dir` and the safetensors helpers at
the end, which keep bfloat16 as raw bits (NumPy has no bfloat16) so nothing is rounded on the way.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import numpy as np

from oneline import InputError
from telechat_moe.config import MODEL_FIELDS, ModelConfig

V3, V2 = "deepseek_v3", "deepseek_v2"
ARCHITECTURES = {V3: "DeepseekV3ForCausalLM", V2: "DeepseekV2ForCausalLM"}
HF_LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


class ConversionError(InputError):
    """A checkpoint or config that cannot be converted; the message names the tensor or key."""


# ---- the table ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """One tensor. scope: 'model' (absolute names), 'block' (any decoder layer), 'dense' / 'moe' (decoder layers of
    that kind), 'mtp' (the MTP wrapper around a block). `{e}` in `hf` stands for a routed expert index.
    move: copy | q_rope_rows / kv_rope_rows (de-interleave the rope rows) | expert_gate / expert_up / expert_down
    (one expert's slice of w1 / w2, transposed) | expert_bias (absent in DeepseekV2: zeros) | shared / tied (HF holds a copy of one of our tensors: checked equal, written back as a copy)."""
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


def ours_to_hf(ours: Mapping[str, np.ndarray], cfg: ModelConfig, family: str = V3) -> dict[str, np.ndarray]:
    """Our parameters -> HF state dict (rope channels interleaved, as DeepSeek publishes them)."""
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
        if e.move in ("q_rope_rows", "kv_rope_rows"):
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


def hf_rope_interleaved(hf: Mapping) -> bool:
    """Whether the rope channels are stored as interleaved pairs: DeepseekV2 always, V3 unless rope_interleave=false."""
    return hf_family(hf) == V2 or bool(hf.get("rope_interleave", True))


def _check_shape(name: str, got: tuple, expected: tuple) -> None:
    if tuple(got) != tuple(expected):
        raise ConversionError(f"{name}: shape {tuple(got)}, expected {tuple(expected)} for this config")


def _check_names(hf: Mapping[str, np.ndarray], expected: set, cfg: ModelConfig) -> None:
    quantised = sorted(n for n in hf if n.endswith("_scale_inv"))
    if quantised:
        raise ConversionError(f"{quantised[0]}: FP8 block-quantised checkpoint; dequantise it to bfloat16 first")
    unknown = sorted(set(hf) - expected)
    if unknown:
        raise ConversionError(
            f"{unknown[0]}: not a tensor of this config (num_hidden_layers={cfg.num_hidden_layers}, "
            f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}); {len(unknown)} such tensors")
    missing = sorted(expected - set(hf))
    if missing:
        raise ConversionError(f"{missing[0]}: missing from the checkpoint; {len(missing)} tensors missing")


# ---- configs ------------------------------------------------------------------------------------------------
def hf_family(hf: Mapping) -> str:
    """'deepseek_v3' or 'deepseek_v2' from config.json's model_type or architectures."""
    for family, arch in ARCHITECTURES.items():
        if hf.get("model_type") == family or arch in (hf.get("architectures") or []):
            return family
    raise ConversionError(f"config.json: model_type {hf.get('model_type')!r} / architectures "
                          f"{hf.get('architectures')!r}: expected one of {sorted(ARCHITECTURES.values())}")


def _require(hf: Mapping, key: str, ok: Callable, expected: str, default=None):
    value = hf.get(key, default)
    if not ok(value):
        raise ConversionError(f"config.json: {key}={value!r}: expected {expected}")
    return value


def config_from_hf(hf: Mapping) -> dict:
    """ModelConfig keyword arguments of a transformers DeepseekV3/V2 config.json."""
    family = hf_family(hf)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size"):
        _require(hf, key, lambda v: isinstance(v, int) and v > 0, "a positive integer")
    heads = hf["num_attention_heads"]
    _require(hf, "num_key_value_heads", lambda v: v in (None, heads), f"None or num_attention_heads={heads}")
    _require(hf, "hidden_act", lambda v: v == "silu", "'silu'", "silu")
    _require(hf, "attention_bias", lambda v: not v, "false (TeleChatMoE's projections have no bias)", False)
    _require(hf, "mlp_bias", lambda v: not v, "false", False)
    n_shared = _require(hf, "n_shared_experts", lambda v: isinstance(v, int) and v >= 1,
                        "at least 1 shared expert", 1)
    kw = {k: hf[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                             "intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                             "v_head_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")}
    kw.update(
        q_lora_rank=hf.get("q_lora_rank") or 0, qk_layernorm=True, n_shared_experts=n_shared,
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"],
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), initializer_range=float(hf.get("initializer_range", 0.02)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        first_k_dense_replace=int(hf.get("first_k_dense_replace", 0)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers", 0)))
    if hf.get("aux_loss_alpha") is not None:
        kw["moe_aux_loss_coeff"] = float(hf["aux_loss_alpha"])
    kw.update(_rope_from_hf(hf.get("rope_scaling"), kw["max_position_embeddings"]))
    kw["seq_length"] = kw.get("original_max_position_embeddings", kw["max_position_embeddings"])
    if family == V3:
        n_group = int(hf.get("n_group") or 1)
        grouped = n_group > 1  # one group is plain top-k
        kw.update(scoring_func="sigmoid", moe_router_enable_expert_bias=True,
                  norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                  n_group=n_group if grouped else 0, topk_group=int(hf.get("topk_group") or 1) if grouped else 0)
    else:
        method = _require(hf, "topk_method", lambda v: v in ("greedy", "group_limited_greedy"),
                          "'greedy' or 'group_limited_greedy'", "greedy")
        grouped = method == "group_limited_greedy"
        kw.update(scoring_func="softmax", moe_router_enable_expert_bias=False,
                  norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                  n_group=int(hf["n_group"]) if grouped else 0, topk_group=int(hf["topk_group"]) if grouped else 0)
    return kw


def _rope_from_hf(scaling: Mapping | None, max_positions: int) -> dict:
    if not scaling:
        return {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return {}
    if kind != "yarn":
        raise ConversionError(f"config.json: rope_scaling.rope_type={kind!r}: expected 'yarn' (or no rope_scaling)")
    if scaling.get("attention_factor") is not None or scaling.get("truncate", True) is not True:
        raise ConversionError("config.json: rope_scaling: attention_factor / truncate=false are not supported; "
                              "TeleChatMoE derives the attention factor from mscale / mscale_all_dim")
    return dict(rotary_scaling_factor=float(scaling["factor"]),
                original_max_position_embeddings=int(scaling.get("original_max_position_embeddings") or max_positions),
                beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
                mscale=float(scaling.get("mscale") or 0), mscale_all_dim=float(scaling.get("mscale_all_dim") or 0))


def hf_config_from(cfg: ModelConfig) -> dict:
    """config.json for transformers: DeepseekV3 for sigmoid routing, DeepseekV2 for softmax routing."""
    family = V3 if cfg.scoring_func == "sigmoid" else V2
    if not cfg.qk_layernorm:
        raise ConversionError("model.qk_layernorm=False: DeepSeek's MLA always normalises the q and kv latents")
    shared = cfg.moe_shared_expert_intermediate_size * cfg.n_shared_experts
    if shared % cfg.moe_intermediate_size:
        raise ConversionError(f"model.moe_shared_expert_intermediate_size: the shared expert's width {shared} must be "
                              f"a multiple of moe_intermediate_size={cfg.moe_intermediate_size} for DeepSeek's config")
    hf = {
        "architectures": [ARCHITECTURES[family]], "model_type": family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "initializer_range": cfg.initializer_range, "tie_word_embeddings": cfg.tie_word_embeddings,
        "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "attention_bias": False, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "rope_scaling": None,
        "first_k_dense_replace": cfg.first_k_dense_replace, "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok, "n_shared_experts": shared // cfg.moe_intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob, "aux_loss_alpha": cfg.moe_aux_loss_coeff,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
    }
    if cfg.yarn_enabled:
        hf["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.rotary_scaling_factor,
                              "original_max_position_embeddings": cfg.original_max_position_embeddings,
                              "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
                              "mscale": cfg.mscale, "mscale_all_dim": cfg.mscale_all_dim}
    if family == V3:
        hf.update(rope_interleave=True, n_group=cfg.n_group or 1, topk_group=cfg.topk_group or 1)
    else:
        grouped = cfg.n_group > 1
        hf.update(topk_method="group_limited_greedy" if grouped else "greedy",
                  n_group=cfg.n_group if grouped else None, topk_group=cfg.topk_group if grouped else None)
    return hf


def semantic_gaps(hf: Mapping) -> list[str]:
    """Where transformers' class computes something TeleChatMoE (which follows DeepSeek's own code) does not."""
    family, gaps = hf_family(hf), []
    eps = float(hf.get("rms_norm_eps", 1e-6))
    if not math.isclose(eps, HF_LATENT_NORM_EPS):
        gaps.append(f"transformers normalises the q/kv latents with eps={HF_LATENT_NORM_EPS:g}, "
                    f"TeleChatMoE with rms_norm_eps={eps:g}")
    if family == V2:
        scaling = hf.get("rope_scaling") or {}
        if scaling.get("mscale_all_dim"):
            gaps.append("transformers' DeepseekV2 leaves out the YaRN mscale_all_dim^2 factor of the softmax scale "
                        "that DeepSeek's code and TeleChatMoE apply")
        if hf.get("norm_topk_prob"):
            gaps.append("transformers' DeepseekV2 ignores norm_topk_prob=true; TeleChatMoE normalises top-k weights")
    return gaps


def model_config(kwargs: Mapping) -> ModelConfig:
    """ModelConfig from keyword arguments, naming the first unknown key."""
    unknown = sorted(set(kwargs) - set(MODEL_FIELDS))
    if unknown:
        raise ConversionError(f"model config: unknown key {unknown[0]!r}")
    return ModelConfig(**kwargs)


# ---- files --------------------------------------------------------------------------------------------------
ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
             "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
ST_NAMES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
            np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
            np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Exact: a bfloat16 is the top half of the float32 with the same value."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even; exact for values that came from bfloat16."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)


def read_safetensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of one file, memory-mapped; bfloat16 tensors are widened to float32 (exactly)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path}: not a readable safetensors file ({exc.__class__.__name__})") from None
    meta = header.pop("__metadata__", None) or {}
    raw = np.memmap(path, np.uint8, "r", offset=8 + n) if header else np.zeros(0, np.uint8)
    out = {}
    for name, spec in header.items():
        if spec["dtype"] not in ST_DTYPES:
            raise ConversionError(f"{path}: {name} has dtype {spec['dtype']}, which this converter does not read")
        begin, end = spec["data_offsets"]
        arr = raw[begin:end].view(ST_DTYPES[spec["dtype"]]).reshape(spec["shape"])
        out[name] = bf16_bits_to_f32(arr) if spec["dtype"] == "BF16" else arr
    return out, meta


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None,
                      dtype: str | None = None) -> None:
    """Write tensors (optionally cast floating ones to 'float32' | 'float16' | 'bfloat16') to `path` atomically."""
    header, arrays, offset = {}, [], 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        st = ST_NAMES.get(arr.dtype)
        if dtype and arr.dtype.kind == "f":
            if dtype == "bfloat16":
                arr, st = f32_to_bf16_bits(arr), "BF16"
            else:
                arr = arr.astype(dtype)
                st = ST_NAMES[arr.dtype]
        arr = np.ascontiguousarray(arr)
        header[name] = {"dtype": st, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        arrays.append(arr)
        offset += arr.nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, path)


def read_hf_dir(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json, state dict) of a transformers checkpoint folder: one model.safetensors or indexed shards."""
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{cfg_path}: expected a transformers config.json ({exc.__class__.__name__})") from None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
    else:
        shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not shards:
        raise ConversionError(f"{path}: no *.safetensors weights (PyTorch .bin checkpoints are not read)")
    state: dict[str, np.ndarray] = {}
    for shard in shards:
        state.update(read_safetensors(os.path.join(path, shard))[0])
    return config, state


def write_hf_dir(path: str, config: Mapping, state: Mapping[str, np.ndarray], dtype: str = "float32",
                 max_shard_bytes: int = 5 * 2 ** 30) -> list[str]:
    """config.json + model.safetensors, or numbered shards with model.safetensors.index.json past max_shard_bytes."""
    os.makedirs(path, exist_ok=True)
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    shards, current, size = [], {}, 0
    for name, arr in state.items():
        nbytes = arr.size * itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = arr
        size += nbytes
    shards.append(current)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        write_safetensors(os.path.join(path, name), shard, {"format": "pt"}, dtype)
    if len(shards) > 1:
        weight_map = {t: name for name, shard in zip(names, shards) for t in shard}
        total = sum(a.size * itemsize for a in state.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "torch_dtype": dtype}, f, indent=2)
    return names
