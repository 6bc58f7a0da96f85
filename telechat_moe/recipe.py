"""Recipes: YAML files with `base:` inheritance and `--set a.b=c` overrides, validated into dataclasses.

Every error is a `RecipeError` whose message is one line naming the key; the entry point turns it into exit code 2.
"""
from __future__ import annotations

import copy
import difflib
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

import yaml

from parallel.layout import (MINDFORMERS_KEYS, LayoutError, ParallelLayout, experts_split, global_batch_splits,
                             heads_split, layers_fill_chunks)
from telechat_moe.config import ModelConfig
from telechat_moe.errors import RecipeError, require

# Names users bring from other frameworks, pointed at ours.
ALIASES = {"top_k": "num_experts_per_tok", "num_layers": "num_hidden_layers", "num_experts": "n_routed_experts",
           "n_experts": "n_routed_experts", "num_heads": "num_attention_heads", "ffn_hidden_size": "intermediate_size",
           "tensor_parallel": "model_parallel", "pipeline_parallel": "pipeline_stage", "lr": "learning_rate",
           "max_steps": "train_steps", "batch_size": "global_batch_size",
           "max_device_memory": "max_device_memory_gb", "mempool_block_size": "mempool_block_size_gb",
           "jit_config": "jit_level", "train_precision_sync": "deterministic"}
RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"
# Sections nest two levels (model.hidden_size); lists of lists a few more. Deeper is not a recipe (and would
# exhaust the recursion of merging and copying).
MAX_DEPTH = 16
# np.random.seed and MindSpore's dataset seed take unsigned 32-bit integers.
MAX_SEED = 2**32 - 1


def layout_error_text(e: LayoutError) -> str:
    """A LayoutError in the recipe's words: `parallel_config.<key>: reason`, the degrees named by their MindFormers
    keys (the layout's errors name the degree)."""
    key = "parallel_config" if e.field == "world_size" else f"parallel_config.{MINDFORMERS_KEYS.get(e.field, e.field)}"
    return f"{key}: {e.reason(MINDFORMERS_KEYS)}"


@dataclass
class ParallelConfig:
    data_parallel: int = 1
    model_parallel: int = 1
    pipeline_stage: int = 1
    pp_interleave_num: int = 1
    expert_parallel: int = 1
    expert_model_parallel: int = 1
    context_parallel: int = 1
    micro_batch_num: int = 1
    # the pipeline's schedule (MindFormers' parallel.pipeline_config.pipeline_scheduler): 1f1b (interleaved 1F1B
    # when pp_interleave_num > 1) or gpipe (every forward, then every backward: more activations in flight)
    pipeline_scheduler: str = "1f1b"
    use_seq_parallel: bool = False
    devices_per_node: int = 8
    optimizer_shard: bool = True        # MindFormers' enable_parallel_optimizer (ZeRO-1)
    vocab_emb_dp: bool = False
    # TP-extends-EP: the routed experts of a stage spread whole over its model_parallel x expert_parallel ranks (the
    # EP group takes in the tensor-parallel ranks, each expert unsplit) instead of each expert split over tp
    expert_parallel_over_tp: bool = False

    def layout(self) -> ParallelLayout:
        over_tp = self.expert_parallel_over_tp
        return ParallelLayout(dp=self.data_parallel, tp=self.model_parallel, pp=self.pipeline_stage,
                              vpp=self.pp_interleave_num,
                              ep=self.expert_parallel * (self.model_parallel if over_tp else 1),
                              etp=1 if over_tp else self.expert_model_parallel,
                              cp=self.context_parallel, sp=self.use_seq_parallel,
                              micro_batch_num=self.micro_batch_num, devices_per_node=self.devices_per_node)


@dataclass
class RecomputeConfig:
    recompute: bool = False
    select_recompute: bool = False

    @property
    def mode(self) -> str:
        """none | selective (the attention core) | full (every decoder layer), as the planner names them."""
        return "full" if self.recompute else "selective" if self.select_recompute else "none"


@dataclass
class OptimizerConfig:
    type: str = "AdamW"
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclass
class ScheduleConfig:
    type: str = "cosine"                 # cosine | constant
    warmup_steps: int = 0
    decay_steps: int = 0                 # 0: decay over train_steps


@dataclass
class TrainingConfig:
    train_steps: int = 100
    global_batch_size: int = 8           # sequences per optimizer step, over all data-parallel ranks
    log_interval: int = 10
    save_interval: int = 0               # 0: only at the end
    eval_interval: int = 0               # 0: only at the end
    eval_batches: int = 4               # held-out batches per evaluation; 0: no evaluation
    keep_checkpoints: int = 3
    loss_scale: str = "auto"             # auto (dynamic for float16, off otherwise) | dynamic | none | a number
    loss_scale_window: int = 1000
    dump_steps: str = ""                 # e.g. "1,10-12": dump forward outputs, gradients, optimizer states, losses
    dump_dir: str = ""                   # empty: <output_dir>/dump (python -m precision.compare RUN_A RUN_B)


@dataclass
class DataConfig:
    paths: list = field(default_factory=list)   # JSONL ({"text": ...} per line) or .txt; empty: embedded corpus
    tokenizer: str = ""                          # a sentencepiece .model; empty: train one on the corpus
    eval_fraction: float = 0.02
    attention_balance: str = "off"               # off | reorder | repack
    attention_cost: str = ""                     # calibration file of the attention cost model
    max_context_loss: float = 1.0                # repack: most share of a batch's tokens its cuts may cut off


@dataclass
class ExpertPlacementConfig:
    """Dynamic expert placement (telechat_moe/expert_placement.py): every `interval` steps each MoE layer's experts
    may move between the expert-parallel ranks, when the load predicted from the last `window` steps makes the most
    loaded rank's gain exceed `threshold` x the time of moving the weights and Adam moments."""
    interval: int = 0                    # steps between decisions; 0: the static placement (expert e on e // (E/ep))
    window: int = 20                     # steps of router load per window the predictor takes
    threshold: float = 1.0               # a move needs predicted gain > threshold x its cost (0: any gain)
    spare_slots: int = 0                 # slots per EP rank beyond E/ep for replicas of hot experts (their tokens
                                         # split between the copies); each costs one expert's weights and moments


# A switch MindSpore spells ON / OFF (YAML reads a bare ON or OFF as a boolean; both spellings are taken).
OnOff = typing.NewType("OnOff", str)


@dataclass
class ContextConfig:
    """MindSpore's context (telechat_moe.context.configure_mindspore applies it), MindFormers' key names where it has
    them (max_device_memory and mempool_block_size are numbers of GB here)."""
    mode: int = 0                         # 0 graph, 1 pynative (MindSpore's numbering)
    device_target: str = "CPU"
    jit_level: str = "O0"                 # O0 | O1 (graph-kernel fusion: DVM on Ascend) | O2 (Ascend: whole graph sunk)
    enable_graph_kernel: bool = False
    max_device_memory_gb: float = 0.0     # 0: this machine's memory (CPU) / unknown; Ascend: the memory pool's cap
    mempool_block_size_gb: float = 0.0    # Ascend: the memory pool's growth step; 0: MindSpore's (2 GB)
    memory_optimize_level: str = "O0"     # O0 | O1 (MindSpore's memory-reuse optimisation)
    deterministic: OnOff = "OFF"          # ON: deterministic kernels and HCCL reductions (mindspore.set_deterministic)
    # Ascend only (HCCL's environment, set before communication init; 0: leave what the environment has, else HCCL's
    # default). On CPU the transport is mccl and nothing reads them.
    hccl_connect_timeout: int = 0         # seconds to build the links, HCCL_CONNECT_TIMEOUT: 120 to 7200 (HCCL: 120)
    hccl_exec_timeout: int = 0            # seconds a collective waits for its peers, HCCL_EXEC_TIMEOUT (HCCL: 1836)
    hccl_buffsize: int = 0                # MB of buffer per communicator, HCCL_BUFFSIZE (HCCL: 200)
    peak_tflops: float = 0.0              # for MFU; 0: this CPU's fp32 GEMM peak (metrics.peak_gemm_flops)
    # keep compiled graphs between runs (MindSpore's compile cache, keyed here by the recipe, the code and MindSpore's
    # version): a re-run or resume of the same recipe skips the graph compile
    compile_cache: bool = False
    # compile each kind of decoder layer once and inline it into every layer of that kind (MindSpore's lazy_inline
    # at the front end: telechat_moe.model.ReusedDecoderLayer); false compiles every layer's copy
    lazy_inline: bool = True


@dataclass
class ProfileConfig:
    """MindSpore's profiler around some training steps (telechat_moe/profiling.py; `python -m telechat_moe.profiling
    DIR` reports top operators, time per phase, host gaps and each step's total)."""
    steps: str = ""                       # e.g. "3-4" (training.dump_steps' syntax); empty: no profiling
    output_dir: str = ""                  # empty: <output_dir>/profile


@dataclass
class FusionConfig:
    """Graph-kernel fusion (telechat_moe.context applies it): on Ascend MindSpore's DVM at context.jit_level O1, on
    CPU AKG through enable_graph_kernel. The operator lists become MindSpore's graph-kernel flags
    (MS_DEV_GRAPH_KERNEL_FLAGS); `python -m dvm_fusion.report DIR` lists the fused kernels of an IR dump."""
    graph_kernel: bool = False            # fuse (context.enable_graph_kernel: true is the same switch)
    enable_expand_ops: list = field(default_factory=list)     # --enable_expand_ops: operators expanded to fuse
    disable_expand_ops: list = field(default_factory=list)    # --disable_expand_ops
    enable_cluster_ops: list = field(default_factory=list)    # --enable_cluster_ops: operators added to clusters
    disable_cluster_ops: list = field(default_factory=list)   # --disable_cluster_ops: never fused
    flags: str = ""                       # more graph-kernel flags as MindSpore spells them, e.g. "--opt_level=2"
    save_graphs: bool = False             # dump the compiled graphs' IR (MS_DEV_SAVE_GRAPHS)
    save_graphs_path: str = ""            # empty: <output_dir>/graphs


# What telechat_moe.context accepts and passes on (validate() names the field of a value outside them).
JIT_LEVELS = ("O0", "O1", "O2")
MEMORY_OPTIMIZE_LEVELS = ("O0", "O1")
HCCL_CONNECT_TIMEOUT_RANGE = (120, 7200)
HCCL_EXEC_TIMEOUT_MAX = 2**31 - 1
# The smallest size in GB written as MindSpore's "xxGB" string (six decimals).
MIN_GB = 1e-6


@dataclass
class Recipe:
    name: str = ""
    seed: int = 1234
    output_dir: str = "output"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    recompute_config: RecomputeConfig = field(default_factory=RecomputeConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    expert_placement: ExpertPlacementConfig = field(default_factory=ExpertPlacementConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    fusion: FusionConfig = field(default_factory=FusionConfig)

    @property
    def layout(self) -> ParallelLayout:
        return self.parallel_config.layout()

    def to_dict(self) -> dict:
        def plain(obj):
            if is_dataclass(obj):
                return {f.name: plain(getattr(obj, f.name)) for f in fields(obj)}
            return obj
        return plain(self)


# ---- loading ------------------------------------------------------------------------------------------
def find_recipe(path: str) -> Path:
    """`1t.yaml`, `1t` and `recipes/1t.yaml` all name the same file."""
    candidates = [Path(path), RECIPE_DIR / path, RECIPE_DIR / f"{path}.yaml"]
    for c in candidates:
        if c.is_file():
            return c
    raise RecipeError(f"--recipe: no recipe file {path!r} (looked in . and {RECIPE_DIR})")


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise RecipeError(f"{path}:{where} is not valid YAML ({getattr(e, 'problem', e)})") from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not a text file (byte {e.start} is not UTF-8); a recipe is YAML text") from None
    except RecursionError:
        raise RecipeError(f"{path}: nested too deeply to be a recipe (sections nest at most {MAX_DEPTH} "
                          f"levels)") from None
    except OSError as e:
        raise RecipeError(f"{path}: cannot read ({e.strerror})") from None
    if data is None:
        raise RecipeError(f"{path}: the recipe file is empty (start it with base: base.yaml, or name a recipe "
                          f"in {RECIPE_DIR})")
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    if _depth(data) > MAX_DEPTH:
        raise RecipeError(f"{path}: nested too deeply to be a recipe (sections nest at most {MAX_DEPTH} levels)")
    return data


def _depth(data) -> int:
    """How deep mappings and lists nest in `data`, up to MAX_DEPTH + 1, counted without recursion; a node that YAML
    anchors share is visited once."""
    deepest, todo, seen = 0, [(data, 1)], set()
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (dict, list)) and id(node) not in seen:
            seen.add(id(node))
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _resolve(path: Path, seen: tuple = ()) -> dict:
    if path.resolve() in seen:
        raise RecipeError(f"{path}: base: chain loops back to itself")
    data = _read_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise RecipeError(f"{path}: base: expected a recipe file name, got {base!r}")
    base_path = path.parent / base
    if not base_path.is_file():
        raise RecipeError(f"{path}: base: no such recipe {base!r} next to it")
    return deep_merge(_resolve(base_path, seen + (path.resolve(),)), data)


def apply_override(raw: dict, assignment: str) -> None:
    """`a.b.c=value`, value parsed as YAML (so 2, 1e-3, true, [1,2] keep their types)."""
    if "=" not in assignment:
        raise RecipeError(f"--set {assignment!r}: expected key.path=value")
    key, value = assignment.split("=", 1)
    parts = key.strip().split(".")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise RecipeError(f"--set {key}: {p} is not a section")
    node[parts[-1]] = parsed


def _coerce(value, tp, key: str):
    if tp is OnOff:
        if isinstance(value, bool):
            return "ON" if value else "OFF"
        if isinstance(value, str) and value.upper() in ("ON", "OFF"):
            return value.upper()
        raise RecipeError(f"{key}: expected ON or OFF, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise RecipeError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise RecipeError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise RecipeError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise RecipeError(f"{key}: expected a string, got {value!r}")
    if tp is list:
        if isinstance(value, list):
            return value
        raise RecipeError(f"{key}: expected a list, got {value!r}")
    return value


def _build(cls, raw, prefix: str):
    if not isinstance(raw, dict):
        raise RecipeError(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = [ALIASES[key]] if ALIASES.get(key) in names else \
                difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.6)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise RecipeError(f"{full}: unknown key{hint}")
        tp = hints[key]
        kwargs[key] = _build(tp, value, f"{full}.") if is_dataclass(tp) else _coerce(value, tp, full)
    return cls(**kwargs)


def load_recipe(path: str, overrides: list[str] = ()) -> Recipe:
    file = find_recipe(path)
    raw = _resolve(file)
    for assignment in overrides:
        apply_override(raw, assignment)
    raw.setdefault("name", file.stem)
    recipe = _build(Recipe, raw, "")
    validate(recipe)
    return recipe


# ---- consistency ----------------------------------------------------------------------------------------
def validate(r: Recipe, world_size: int | None = None) -> None:
    m, p, t = r.model, r.parallel_config, r.training
    require(0 <= r.seed <= MAX_SEED, f"seed: expected an integer in [0, {MAX_SEED}] (the seeds NumPy and MindSpore "
                                      f"accept), got {r.seed}")
    m.validate()

    try:
        layout = p.layout().validate(world_size)
    except LayoutError as e:
        raise RecipeError(layout_error_text(e)) from None
    shape = m.to_model_shape()
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
    require(x.spare_slots >= 0, f"expert_placement.spare_slots: expected 0 or more, got {x.spare_slots}")
    if x.spare_slots:
        for ok, why in ((x.interval > 0, "expert_placement.interval > 0 (replicas are made by migrations)"),
                        (m.moe_token_dispatcher_type == "alltoall", "model.moe_token_dispatcher_type: alltoall"),
                        (m.moe_expert_capacity_factor is None, "dropless routing (no moe_expert_capacity_factor)"),
                        (p.pipeline_stage == 1, "pipeline_stage: 1")):
            require(ok, f"expert_placement.spare_slots: replicas need {why}")
    require(p.pipeline_scheduler in ("1f1b", "gpipe"),
            f"parallel_config.pipeline_scheduler: expected 1f1b or gpipe, got {p.pipeline_scheduler!r}")
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
    d = r.data
    from data_sched.attention_balance import check_balance_mode, check_context_loss
    from data_sched.errors import DataError
    try:
        check_balance_mode(d.attention_balance)
        check_context_loss(d.max_context_loss)
    except DataError as e:
        raise RecipeError(str(e)) from None
    require(0 <= d.eval_fraction < 0.5, f"data.eval_fraction: expected in [0, 0.5), got {d.eval_fraction}")
    require(all(isinstance(x, str) for x in d.paths), f"data.paths: expected a list of file paths, got {d.paths!r}")
    require(r.context.device_target in ("CPU", "Ascend"),
             f"context.device_target: expected CPU or Ascend, got {r.context.device_target!r}")
    require(r.context.mode in (0, 1), f"context.mode: expected 0 (graph) or 1 (pynative), got {r.context.mode}")
    require(r.context.device_target == "Ascend" or "bfloat16" not in (m.compute_dtype, m.params_dtype),
             "model.compute_dtype: bfloat16 has no CPU kernels in MindSpore; use float32 or float16 on CPU")
    _validate_context(r.context)
    _validate_profile(r.profile, t.train_steps)
    _validate_fusion(r)


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
    """What training needs beyond a valid recipe (a --dry-run plans any layout): an engine that runs the layout, a
    dispatcher that is built, and one process per device of the layout. Checked before MindSpore initialises
    communication, whose init() otherwise fails with a traceback or waits for peers that were never started."""
    p, m = r.parallel_config, r.model
    for key, degree in (("context_parallel", p.context_parallel), ("expert_model_parallel", p.expert_model_parallel)):
        require(degree == 1, f"parallel_config.{key}: {degree} is not trained yet (data, tensor, sequence, expert "
                             f"and pipeline parallelism are); use --dry-run to plan this layout")
    if p.model_parallel > 1:
        _check_tensor_parallel(r)
    if p.pipeline_stage > 1:
        _check_pipeline(r)
    require(p.expert_parallel == 1 or m.moe_token_dispatcher_type != "local",
             f"model.moe_token_dispatcher_type: 'local' keeps every expert on every rank; expert_parallel="
             f"{p.expert_parallel} needs alltoall or hierarchical")
    world = r.layout.world_size
    devices = f"{world} device{'s' if world > 1 else ''}"
    launched = f"{processes} process{'es were' if processes > 1 else ' was'} launched"
    require(world == processes,
             f"parallel_config: data_parallel*model_parallel*context_parallel*pipeline_stage = {p.data_parallel}*"
             f"{p.model_parallel}*{p.context_parallel}*{p.pipeline_stage} = {devices}, but {launched} (use msrun "
             f"--worker_num={world}, or change parallel_config)")


def _check_pipeline(r: Recipe) -> None:
    """What the multi-process pipeline (telechat_moe/pipeline_step.py) runs beyond a valid layout (whose schedule
    validate() checked): an untied head."""
    p, m = r.parallel_config, r.model
    require(not m.tie_word_embeddings,
            f"model.tie_word_embeddings: a head tied to the embedding is not trained yet under pipeline "
            f"parallelism (pipeline_stage={p.pipeline_stage}); untie it or use pipeline_stage=1")


def _check_tensor_parallel(r: Recipe) -> None:
    """What the tensor-parallel model splits over model_parallel ranks, each split whole: attention heads, the
    tokens of a sequence (each rank routes its share; under sequence parallelism the residual stream is a sequence
    shard), the vocabulary of the embedding, head and cross-entropy (always, whatever vocab_emb_dp says), the dense
    and shared-expert FFN columns. Some of these validate() checks for any plan already; training checks them all."""
    p, m = r.parallel_config, r.model
    tp = p.model_parallel
    require(m.num_attention_heads % tp == 0,
             f"model.num_attention_heads: {m.num_attention_heads} heads are not divisible by model_parallel={tp}")
    shards = "the sequence shards of sequence parallelism" if p.use_seq_parallel else "each rank's share of the tokens"
    require(m.seq_length % tp == 0,
             f"model.seq_length: {m.seq_length} is not divisible by model_parallel={tp} ({shards})")
    require(m.vocab_size % tp == 0,
             f"model.vocab_size: {m.vocab_size} is not divisible by model_parallel={tp}; training under tensor "
             f"parallelism splits the embedding and head by vocabulary (vocab_emb_dp is planned, not trained): pad "
             f"it to a multiple")
    require(m.first_k_dense_replace == 0 or m.intermediate_size % tp == 0,
             f"model.intermediate_size: {m.intermediate_size} (the dense FFN) is not divisible by model_parallel={tp}")
    shared = m.moe_shared_expert_intermediate_size * m.n_shared_experts
    require(m.n_shared_experts == 0 or shared % tp == 0,
             f"model.moe_shared_expert_intermediate_size: {m.moe_shared_expert_intermediate_size} x n_shared_experts="
             f"{m.n_shared_experts} = {shared} (the shared experts' FFN) is not divisible by model_parallel={tp}")
    require(not m.tie_word_embeddings,
             f"model.tie_word_embeddings: a head tied to the embedding is not trained yet under tensor parallelism "
             f"(model_parallel={tp}); untie it or use model_parallel=1")


def _is_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False
