"""transformers' DeepseekV3 / DeepseekV2 config.json <-> TeleChatMoE's ModelConfig.

`config_from_hf` reads a config.json into ModelConfig keyword arguments (refusing, with the key named, what our
model cannot run: GQA heads, biases, another activation, rope scalings other than YaRN); `hf_config_from` writes
one back, DeepseekV3 for sigmoid routing and DeepseekV2 for softmax routing. Where a transformers class computes
something our model (which follows DeepSeek's own code) does not, `semantic_gaps` says so. The tensor names are
`telechat_moe.hf_adapter`'s table; the files are `telechat_moe.safetensors_io`'s.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

from telechat_moe.config import MODEL_FIELDS, ModelConfig
from telechat_moe.hf_adapter import ARCHITECTURES, V2, V3, ConversionError

HF_LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


def hf_family(hf: Mapping) -> str:
    """'deepseek_v3' or 'deepseek_v2' from config.json's model_type or architectures."""
    for family, arch in ARCHITECTURES.items():
        if hf.get("model_type") == family or arch in (hf.get("architectures") or []):
            return family
    raise ConversionError(f"config.json: model_type {hf.get('model_type')!r} / architectures "
                          f"{hf.get('architectures')!r}: expected one of {sorted(ARCHITECTURES.values())}")


def hf_rope_interleaved(hf: Mapping) -> bool:
    """Whether the rope channels are stored as interleaved pairs: DeepseekV2 always, V3 unless rope_interleave=false."""
    return hf_family(hf) == V2 or bool(hf.get("rope_interleave", True))


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
    # the longest input transformers' model takes (YaRN's original context only says how the rope tables stretch);
    # a recipe may train at less (model.seq_length)
    kw["seq_length"] = kw["max_position_embeddings"]
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


def hf_config_from(cfg: ModelConfig, rope_interleave: bool = True) -> dict:
    """config.json for transformers: DeepseekV3 for sigmoid routing, DeepseekV2 for softmax routing. rope_interleave:
    whether the rope rows are written as interleaved pairs (DeepseekV2 always reads them so)."""
    family = V3 if cfg.scoring_func == "sigmoid" else V2
    if family == V2 and not rope_interleave:
        raise ConversionError("rope_interleave=false: DeepseekV2 always reads interleaved rope channels")
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
        hf.update(rope_interleave=rope_interleave, n_group=cfg.n_group or 1, topk_group=cfg.topk_group or 1)
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
