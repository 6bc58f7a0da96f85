"""What the trainer runs: the one predicate that `check_trainable` (before a run starts) and the planner's search
and refinement (before a layout is proposed) both ask, so that the planner never proposes a layout the trainer
refuses.

A layout the layout rules allow (parallel.layout) may still not train: an engine not built yet (the three switches
below, each flipped in one line when its engine lands), or a model size that one of the trained engines cannot split
evenly (heads, tokens, vocabulary, FFN columns over tensor parallelism; the expert FFN over expert tensor
parallelism), or a tied head where the trainer keeps the embedding and head apart. The rules are functions over
numbers that hold alike for one layout (Python scalars: `refusal` words the first broken one in the recipe's keys)
and for NumPy arrays of candidate layouts (`trainable`: true where every rule holds).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# ---- what is trained; each a one-line switch for the engine that lands it ------------------------------------
CONTEXT_PARALLEL_TRAINS = True            # parallel/cp (context_parallel > 1)
CONTEXT_PARALLEL_WITH_PIPELINE = True     # cp > 1 under pipeline_stage > 1 (pp=2 x cp=2 trains)
EXPERT_TENSOR_PARALLEL_TRAINS = True      # the expert FFN split over expert_model_parallel ranks
TRAINED_SCHEDULES = ("1f1b", "interleaved", "gpipe", "dualpipev")   # what telechat_moe/pipeline_step.py runs
# the expert exchanges the trainer builds (telechat_moe/moe/dispatch.py), in the planner's names; `local` (every
# expert on every rank) is the recipe's dispatcher without an exchange
TRAINED_EP_SCHEMES = ("flat", "hierarchical")

NOT_TRAINED = ("{key}: {value} is not trained yet (data, tensor, sequence, expert and pipeline parallelism are); use "
               "--dry-run to plan this layout")
# why a dispatcher cannot exchange tokens between expert-parallel ranks
NO_EXCHANGE = {"local": "keeps every expert on every rank", "node_dedup": "is priced by the planner, not built"}


@dataclass(frozen=True)
class Rule:
    ok: object          # bool, or a boolean array over candidate layouts
    template: str       # the one-line refusal, `key: reason`, formatted with the layout's values


def rules(shape, seq_length, tp, pp, ep, etp, cp=1, sp=True, ep_scheme="flat", schedule="1f1b") -> list[Rule]:
    """The rules in the order `refusal` reports them. `shape` is the planner's ModelShape; `seq_length` the
    sequence trained; the degrees are scalars or arrays of one entry per layout; `ep_scheme` a planner scheme name
    (flat, hierarchical, node_dedup) or `local`, an array of names for many; `schedule` a pipeline schedule's name
    (schedules.SCHEDULES)."""
    s = shape
    shared = s.shared_intermediate * s.num_shared_experts
    one = tp == 1
    shards = "the sequence shards of sequence parallelism" if np.all(sp) else "each rank's share of the tokens"
    return [
        Rule((cp == 1) | CONTEXT_PARALLEL_TRAINS, NOT_TRAINED.replace("{key}", "parallel_config.context_parallel")
             .replace("{value}", "{cp}")),
        # parallel/cp: each rank a front and a back block of every sequence, split over tp; under a pipeline the
        # stages pass activations of the rank's positions (pipeline_step: a cp=2 x pp=2 run once waited for a
        # whole sequence's activation in its first step)
        Rule((cp == 1) | (seq_length % (2 * cp * tp) == 0),
             "model.seq_length: {seq} is not divisible by 2*context_parallel*model_parallel = 2*{cp}*{tp} (each "
             "context-parallel rank holds a front and a back block of every sequence, split over tp)"),
        Rule((cp == 1) | (pp == 1) | CONTEXT_PARALLEL_WITH_PIPELINE,
             "parallel_config.context_parallel: {cp} with pipeline_stage={pp} is not trained yet (context "
             "parallelism trains beside data, tensor, sequence and expert parallelism); use --dry-run to plan this "
             "layout"),
        Rule((etp == 1) | EXPERT_TENSOR_PARALLEL_TRAINS,
             NOT_TRAINED.replace("{key}", "parallel_config.expert_model_parallel").replace("{value}", "{etp}")),
        Rule(s.moe_intermediate % etp == 0, "parallel_config.expert_model_parallel: the expert FFN size "
             "moe_intermediate_size={moe} is not divisible by expert_model_parallel={etp}"),
        # the etp ranks gather the rows their EP exchanges brought; the local dispatcher's (no exchange) is not built
        Rule((etp == 1) | (ep > 1), "parallel_config.expert_model_parallel: {etp} needs expert_parallel > 1 (expert "
             "tensor parallelism splits the experts of an EP group; without expert parallelism it is not trained)"),
        Rule(one | (s.num_heads % tp == 0),
             "model.num_attention_heads: {heads} heads are not divisible by model_parallel={tp}"),
        Rule(one | (seq_length % tp == 0),
             "model.seq_length: {seq} is not divisible by model_parallel={tp} (" + shards + ")"),
        Rule(one | (s.vocab_size % tp == 0),
             "model.vocab_size: {vocab} is not divisible by model_parallel={tp}; training under tensor parallelism "
             "splits the embedding and head by vocabulary (vocab_emb_dp is planned, not trained): pad it to a "
             "multiple"),
        Rule(one | (s.first_k_dense == 0) | (s.dense_intermediate % tp == 0),
             "model.intermediate_size: {dense} (the dense FFN) is not divisible by model_parallel={tp}"),
        Rule(one | (s.num_shared_experts == 0) | (shared % tp == 0),
             "model.moe_shared_expert_intermediate_size: {shared_one} x n_shared_experts={n_shared} = {shared} (the "
             "shared experts' FFN) is not divisible by model_parallel={tp}"),
        Rule(one | (not s.tie_embeddings),
             "model.tie_word_embeddings: a head tied to the embedding is not trained yet under tensor parallelism "
             "(model_parallel={tp}); untie it or use model_parallel=1"),
        Rule((pp == 1) | (not s.tie_embeddings),
             "model.tie_word_embeddings: a head tied to the embedding is not trained yet under pipeline parallelism "
             "(pipeline_stage={pp}); untie it or use pipeline_stage=1"),
        Rule((ep == 1) | np.isin(ep_scheme, TRAINED_EP_SCHEMES),
             "model.moe_token_dispatcher_type: {dispatcher!r} {no_exchange}; expert_parallel={ep} needs alltoall "
             "or hierarchical"),
        Rule(np.isin(schedule, TRAINED_SCHEDULES),
             "parallel_config.pipeline_scheduler: {schedule} is not trained yet (the trainer's pipeline runs "
             + ", ".join(TRAINED_SCHEDULES) + ")"),
    ]


def trainable(shape, seq_length, tp, pp, ep, etp, cp=1, sp=True, ep_scheme="flat", schedule="1f1b"):
    """True where the trainer runs the layout (arrays: one entry per layout)."""
    ok = True
    for rule in rules(shape, seq_length, tp, pp, ep, etp, cp, sp, ep_scheme, schedule):
        ok = ok & np.asarray(rule.ok)
    return ok


def refusal(shape, seq_length, tp, pp, ep, etp, cp=1, sp=True, ep_scheme="flat", schedule="1f1b") -> str | None:
    """The first rule one layout (scalars) breaks, as one line naming the recipe key; None if the trainer runs it."""
    s = shape
    for rule in rules(shape, seq_length, tp, pp, ep, etp, cp, sp, ep_scheme, schedule):
        if not bool(np.all(rule.ok)):
            return rule.template.format(
                tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, seq=seq_length, schedule=schedule, heads=s.num_heads,
                vocab=s.vocab_size, dense=s.dense_intermediate, moe=s.moe_intermediate,
                shared_one=s.shared_intermediate, n_shared=s.num_shared_experts,
                shared=s.shared_intermediate * s.num_shared_experts,
                dispatcher="alltoall" if ep_scheme == "flat" else ep_scheme,
                no_exchange=NO_EXCHANGE.get(ep_scheme, "is not built"))
    return None


def layout_refusal(shape, seq_length, layout, schedule: str) -> str | None:
    """`refusal` of a ParallelLayout (its planner choices included) under `schedule`."""
    return refusal(shape, seq_length, layout.tp, layout.pp, layout.ep, layout.etp, layout.cp, layout.sp,
                   layout.ep_scheme, schedule)
