"""A recipe's values checked (`validate`: any plan, a dry run included) and what training needs beyond them
(`check_trainable`): every error is a `RecipeError` whose message is one line naming the key."""
from __future__ import annotations

import math
from collections.abc import Mapping

from parallel.layout import (MINDFORMERS_KEYS, LayoutError, experts_split, global_batch_splits, heads_split,
                             layers_fill_chunks)
from parallel.planner.trainable import refusal
from telechat_moe.errors import RecipeError, require
from telechat_moe.recipe_schema import ContextConfig, ProfileConfig, Recipe

# np.random.seed and MindSpore's dataset seed take unsigned 32-bit integers.
MAX_SEED = 2**32 - 1


def layout_error_text(e: LayoutError) -> str:
    """A LayoutError in the recipe's words: `parallel_config.<key>: reason`, the degrees named by their MindFormers
    keys (the layout's errors name the degree)."""
    key = "parallel_config" if e.field == "world_size" else f"parallel_config.{MINDFORMERS_KEYS.get(e.field, e.field)}"
    return f"{key}: {e.reason(MINDFORMERS_KEYS)}"


# What telechat_moe.context accepts and passes on (validate() names the field of a value outside them).
JIT_LEVELS = ("O0", "O1", "O2")
MEMORY_OPTIMIZE_LEVELS = ("O0", "O1")
HCCL_CONNECT_TIMEOUT_RANGE = (120, 7200)
HCCL_EXEC_TIMEOUT_MAX = 2**31 - 1
# The smallest size in GB written as MindSpore's "xxGB" string (six decimals).
MIN_GB = 1e-6




def validate(r: Recipe, world_size: int | None = None) -> None:
    """The recipe's values, section by section (the first error is raised); `world_size`: the devices a layout
    must fill, when known."""
    require(0 <= r.seed <= MAX_SEED, f"seed: expected an integer in [0, {MAX_SEED}] (the seeds NumPy and MindSpore "
                                      f"accept), got {r.seed}")
    r.model.validate()
    _validate_parallel(r, world_size)
    _validate_expert_placement(r)
    _validate_training(r)
    _validate_data(r)
    _validate_context(r.context)
    _validate_profile(r.profile, r.training.train_steps)
    _validate_fusion(r)


def _validate_parallel(r: Recipe, world_size: int | None) -> None:
    """The layout, what it splits of the model, and the global batch it splits."""
    m, p, t = r.model, r.parallel_config, r.training
    try:
        layout = p.layout().validate(world_size)
    except LayoutError as e:
        raise RecipeError(layout_error_text(e)) from None
    shape = m.to_model_shape()
    require(p.ddp_bucket_size >= 0, f"parallel_config.ddp_bucket_size: expected a number of gradient elements "
                                    f">= 0 (0: one bucket per group), got {p.ddp_bucket_size}")
    require(experts_split(shape, layout.ep),
             f"parallel_config.expert_parallel: {m.n_routed_experts} experts cannot be split evenly over "
             f"expert_parallel={p.expert_parallel}" + (f" x model_parallel={p.model_parallel} (expert_parallel_over_tp)"
                                                       if p.expert_parallel_over_tp else ""))
    require(not p.expert_parallel_over_tp or p.expert_model_parallel == 1,
             f"parallel_config.expert_parallel_over_tp: experts spread whole over the tensor-parallel ranks, so "
             f"expert_model_parallel must be 1, got {p.expert_model_parallel}")
    require(m.moe_intermediate_size % p.expert_model_parallel == 0,
             f"parallel_config.expert_model_parallel: the expert FFN size moe_intermediate_size="
             f"{m.moe_intermediate_size} is not divisible by expert_model_parallel={p.expert_model_parallel}")
    require(heads_split(shape, layout.tp),
             f"parallel_config.model_parallel: {m.num_attention_heads} attention heads are not divisible by "
             f"model_parallel={p.model_parallel}")
    for key, used in (("intermediate_size", m.first_k_dense_replace > 0),
                      ("moe_shared_expert_intermediate_size", m.n_shared_experts > 0)):
        require(not used or getattr(m, key) % p.model_parallel == 0,
                 f"parallel_config.model_parallel: model.{key}={getattr(m, key)} is not divisible by "
                 f"model_parallel={p.model_parallel}")
    # MindFormers splits the embedding and head by vocabulary unless vocab_emb_dp; an uneven vocabulary makes it fall
    # back to whole copies with only a warning, while the memory plan counts the split.
    require(p.vocab_emb_dp or m.vocab_size % p.model_parallel == 0,
             f"model.vocab_size: {m.vocab_size} is not divisible by model_parallel={p.model_parallel}; pad it to a "
             f"multiple or set parallel_config.vocab_emb_dp: true")
    require(m.seq_length % p.context_parallel == 0,
             f"model.seq_length: {m.seq_length} not divisible by context_parallel={p.context_parallel}")
    require(m.seq_length % (p.model_parallel if p.use_seq_parallel else 1) == 0,
             f"model.seq_length: {m.seq_length} not divisible by model_parallel={p.model_parallel} for sequence "
             f"parallelism")
    require(layers_fill_chunks(shape, layout.pp, layout.vpp),
             f"parallel_config.pipeline_stage: {p.pipeline_stage} stages x {p.pp_interleave_num} chunks need at "
             f"least that many layers less two (the embedding and the head may hold a chunk alone), the model has "
             f"{m.num_hidden_layers}")
    require(t.global_batch_size >= 1, f"training.global_batch_size: expected a positive integer, got "
                                        f"{t.global_batch_size}")
    require(global_batch_splits(t.global_batch_size, layout.dp, layout.micro_batch_num),
             f"training.global_batch_size: {t.global_batch_size} is not divisible by data_parallel*micro_batch_num "
             f"= {layout.dp * p.micro_batch_num}")
    require(t.train_steps >= 1, f"training.train_steps: expected at least 1, got {t.train_steps}")


def _validate_expert_placement(r: Recipe) -> None:
    m, p = r.model, r.parallel_config
    x = r.expert_placement
    require(x.interval >= 0, f"expert_placement.interval: expected 0 or more, got {x.interval}")
    require(x.window >= 1, f"expert_placement.window: expected at least 1, got {x.window}")
    require(math.isfinite(x.threshold) and x.threshold >= 0,
            f"expert_placement.threshold: expected a number >= 0, got {x.threshold}")
    require(not x.interval or p.expert_parallel > 1,
            f"expert_placement.interval: moving experts needs expert_parallel > 1, got {p.expert_parallel}")
    # group-limited routing picks groups of consecutive experts: relabelling them would change what it picks
    require(not x.interval or m.n_group <= 1,
            f"expert_placement.interval: group-limited routing (model.n_group={m.n_group}) ties experts to their "
            f"groups; moving them is not supported")
    # moving an expert moves whole experts between EP ranks; under expert tensor parallelism each is in etp shards
    require(not x.interval or p.expert_model_parallel == 1,
            f"expert_placement.interval: moving experts is not supported under expert_model_parallel="
            f"{p.expert_model_parallel}; use 1")
    require(x.spare_slots >= 0, f"expert_placement.spare_slots: expected 0 or more, got {x.spare_slots}")
    if x.spare_slots:
        for ok, why in ((x.interval > 0, "expert_placement.interval > 0 (replicas are made by migrations)"),
                        (m.moe_token_dispatcher_type == "alltoall", "model.moe_token_dispatcher_type: alltoall"),
                        (m.moe_expert_capacity_factor is None, "dropless routing (no moe_expert_capacity_factor)"),
                        (p.pipeline_stage == 1, "pipeline_stage: 1")):
            require(ok, f"expert_placement.spare_slots: replicas need {why}")


def _validate_training(r: Recipe) -> None:
    """The pipeline's schedule, the training loop's intervals, loss scale and dumps, the optimizer, the schedule."""
    p, t = r.parallel_config, r.training
    require(p.pipeline_scheduler in ("1f1b", "gpipe", "dualpipev"),
            f"parallel_config.pipeline_scheduler: expected 1f1b, gpipe or dualpipev, got {p.pipeline_scheduler!r}")
    if p.pipeline_scheduler == "dualpipev":
        from parallel.pipeline.schedules import dualpipe_v_unfit
        unfit = dualpipe_v_unfit(p.pipeline_stage, p.pp_interleave_num, p.micro_batch_num,
                                 names={"p": "pipeline_stage", "v": "pp_interleave_num", "m": "micro_batch_num"})
        field = {"chunks": "pp_interleave_num", "microbatches": "micro_batch_num"}[unfit[0]] if unfit else ""
        require(unfit is None, f"parallel_config.{field}: dualpipev {unfit[1]}" if unfit else "")
    for key in ("log_interval", "save_interval", "eval_interval", "keep_checkpoints", "eval_batches"):
        require(getattr(t, key) >= 0, f"training.{key}: expected 0 or more, got {getattr(t, key)}")
    require(t.loss_scale in ("auto", "dynamic", "none") or _is_number(t.loss_scale),
             f"training.loss_scale: expected auto, dynamic, none or a number, got {t.loss_scale!r}")
    if t.dump_steps:
        from precision.dump import DumpError, parse_steps
        try:
            parse_steps(t.dump_steps, "training.dump_steps")
        except DumpError as e:
            raise RecipeError(str(e)) from None
    o = r.optimizer
    require(o.type in ("AdamW",), f"optimizer.type: expected AdamW, got {o.type!r}")
    require(len(o.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas),
             f"optimizer.betas: expected two numbers in [0, 1), got {o.betas!r}")
    require(math.isfinite(o.learning_rate) and o.learning_rate > 0,
             f"optimizer.learning_rate: expected a finite number > 0, got {o.learning_rate}")
    require(0 <= o.min_lr <= o.learning_rate,
             f"optimizer.min_lr: expected between 0 and learning_rate={o.learning_rate}, got {o.min_lr}")
    require(math.isfinite(o.eps) and o.eps > 0, f"optimizer.eps: expected a finite number > 0, got {o.eps}")
    for key in ("weight_decay", "grad_clip"):
        value = getattr(o, key)
        require(math.isfinite(value) and value >= 0, f"optimizer.{key}: expected a finite number >= 0, got {value}")
    require(r.lr_schedule.type in ("cosine", "constant"),
             f"lr_schedule.type: expected cosine or constant, got {r.lr_schedule.type!r}")
    require(r.lr_schedule.warmup_steps >= 0, "lr_schedule.warmup_steps: expected 0 or more")


def _validate_data(r: Recipe) -> None:
    m = r.model
    d = r.data
    from data_sched.attention_balance import check_balance_mode, check_context_loss
    from data_sched.blend import parse_paths
    from data_sched.errors import DataError
    try:
        check_balance_mode(d.attention_balance)
        check_context_loss(d.max_context_loss)
        parse_paths(d.paths)
    except DataError as e:
        raise RecipeError(str(e)) from None
    require(0 <= d.eval_fraction < 0.5, f"data.eval_fraction: expected in [0, 0.5), got {d.eval_fraction}")
    require(r.context.device_target in ("CPU", "Ascend"),
             f"context.device_target: expected CPU or Ascend, got {r.context.device_target!r}")
    require(r.context.mode in (0, 1), f"context.mode: expected 0 (graph) or 1 (pynative), got {r.context.mode}")
    for key in ("params_dtype", "compute_dtype"):
        require(r.context.device_target == "Ascend" or getattr(m, key) != "bfloat16",
                f"model.{key}: bfloat16 has no CPU kernels in MindSpore; use float32 or float16 on CPU")
    # the float32 master of weights below float32 lives in the distributed optimizer
    require(m.params_dtype == "float32" or r.parallel_config.optimizer_shard,
            f"model.params_dtype: {m.params_dtype} weights need parallel_config.optimizer_shard: true (the "
            f"distributed optimizer holds their float32 master)")


def _validate_context(c: ContextConfig) -> None:
    require(c.jit_level in JIT_LEVELS, f"context.jit_level: expected O0, O1 or O2, got {c.jit_level!r}")
    require(c.memory_optimize_level in MEMORY_OPTIMIZE_LEVELS,
             f"context.memory_optimize_level: expected O0 or O1, got {c.memory_optimize_level!r}")
    for key in ("max_device_memory_gb", "mempool_block_size_gb"):
        gb = getattr(c, key)
        require(math.isfinite(gb) and (gb == 0 or gb >= MIN_GB),
                 f"context.{key}: expected 0 (MindSpore's default) or a size in GB of at least {MIN_GB:g}, got {gb}")
    low, high = HCCL_CONNECT_TIMEOUT_RANGE
    require(c.hccl_connect_timeout == 0 or low <= c.hccl_connect_timeout <= high,
             f"context.hccl_connect_timeout: expected 0 (leave HCCL_CONNECT_TIMEOUT as it is) or seconds from {low} "
             f"to {high}, got {c.hccl_connect_timeout}")
    require(0 <= c.hccl_exec_timeout <= HCCL_EXEC_TIMEOUT_MAX,
             f"context.hccl_exec_timeout: expected 0 (leave HCCL_EXEC_TIMEOUT as it is) or seconds up to "
             f"{HCCL_EXEC_TIMEOUT_MAX}, got {c.hccl_exec_timeout}")
    require(c.hccl_buffsize >= 0, f"context.hccl_buffsize: expected 0 (leave HCCL_BUFFSIZE as it is) or MB >= 1, "
                                  f"got {c.hccl_buffsize}")
    require(c.peak_tflops >= 0 and math.isfinite(c.peak_tflops),
             f"context.peak_tflops: expected 0 (measure this machine) or a finite number > 0, got {c.peak_tflops}")


def _validate_profile(p: ProfileConfig, train_steps: int) -> None:
    if p.steps:
        from precision.dump import DumpError, parse_steps
        try:
            steps = parse_steps(p.steps, "profile.steps")
        except DumpError as e:
            raise RecipeError(str(e)) from None
        require(max(steps) <= train_steps, f"profile.steps: step {max(steps)} is after the last training step "
                                           f"(training.train_steps={train_steps})")


# the fusion section's operator lists: the graph-kernel flag each becomes
FUSION_OP_LISTS = ("enable_expand_ops", "disable_expand_ops", "enable_cluster_ops", "disable_cluster_ops")


def _validate_fusion(r: Recipe) -> None:
    f, c = r.fusion, r.context
    for key in FUSION_OP_LISTS:
        ops = getattr(f, key)
        require(all(isinstance(op, str) and op.isidentifier() for op in ops),
                f"fusion.{key}: expected a list of operator names such as [Mul, Add], got {ops!r}")
    tokens = f.flags.split()
    require(all(t.startswith("--") and len(t) > 2 for t in tokens),
            f"fusion.flags: expected graph-kernel flags such as '--opt_level=2', got {f.flags!r}")
    listed = sorted({t[2:].split("=", 1)[0] for t in tokens} & set(FUSION_OP_LISTS)) or [""]
    require(not listed[0], f"fusion.flags: --{listed[0]} has its own key, fusion.{listed[0]}")
    require(not f.graph_kernel or c.device_target == "CPU" or c.jit_level == "O1",
            f"fusion.graph_kernel: on Ascend graph-kernel fusion (DVM) runs at context.jit_level O1, got "
            f"{c.jit_level}")
    tuned = [key for key in FUSION_OP_LISTS if getattr(f, key)] + (["flags"] if f.flags else []) + [""]
    require(not tuned[0] or fusion_on(r), f"fusion.{tuned[0]}: graph-kernel fusion is off; set fusion.graph_kernel: "
                                          f"true")


def fusion_on(r: Recipe) -> bool:
    """Whether the recipe's graphs are compiled with graph-kernel fusion (DVM on Ascend at jit_level O1, AKG on CPU)."""
    c = r.context
    return r.fusion.graph_kernel or c.enable_graph_kernel or (c.device_target == "Ascend" and c.jit_level == "O1")


def launched_processes(env: Mapping[str, str]) -> int:
    """How many processes this launch started: msrun exports MS_WORKER_NUM to each; a plain `python` start is one."""
    value = env.get("MS_WORKER_NUM", "1").strip()
    require(value.isdigit() and int(value) >= 1,
             f"MS_WORKER_NUM: expected a positive process count (msrun sets it), got {value!r}")
    return int(value)


def check_trainable(r: Recipe, processes: int) -> None:
    """What training needs beyond a valid recipe (a --dry-run plans any layout): the trainer runs the layout (the one
    predicate the planner's search asks too, parallel.planner.trainable), and one process per device of the layout.
    Checked before MindSpore initialises communication, whose init() otherwise fails with a traceback or waits for
    peers that were never started."""
    p, m = r.parallel_config, r.model
    one_f_one_b = "interleaved" if p.pp_interleave_num > 1 else "1f1b"
    schedule = one_f_one_b if p.pipeline_scheduler == "1f1b" else p.pipeline_scheduler
    dispatcher = {"alltoall": "flat"}.get(m.moe_token_dispatcher_type, m.moe_token_dispatcher_type)
    lay = r.layout
    problem = refusal(m.to_model_shape(), m.seq_length, lay.tp, lay.pp, lay.ep, lay.etp, lay.cp, lay.sp, dispatcher,
                      schedule)
    require(problem is None, problem or "")
    world = lay.world_size
    devices = f"{world} device{'s' if world > 1 else ''}"
    launched = f"{processes} process{'es were' if processes > 1 else ' was'} launched"
    require(world == processes,
             f"parallel_config: data_parallel*model_parallel*context_parallel*pipeline_stage = {p.data_parallel}*"
             f"{p.model_parallel}*{p.context_parallel}*{p.pipeline_stage} = {devices}, but {launched} (use msrun "
             f"--worker_num={world}, or change parallel_config)")


def _is_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False
