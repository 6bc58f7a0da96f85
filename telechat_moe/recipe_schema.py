"""What a recipe holds: one dataclass per section (`parallel_config`, `training`, `data`, `context`, ...), the model's
in telechat_moe/config.py. The keys, their defaults and what each does are here; recipe.py reads YAML into them and
recipe_checks.py checks their values."""
from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields, is_dataclass

from parallel.layout import ParallelLayout
from telechat_moe.config import ModelConfig


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
    # gradient elements per bucket of the distributed optimizer's reduce-scatters (Megatron-Core's
    # DistributedDataParallelConfig.bucket_size, --ddp-bucket-size, and its default); 0: one bucket per group
    ddp_bucket_size: int = 40_000_000
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
    # JSONL ({"text": ...} per line) or .txt; empty: embedded corpus. Or indexed datasets (.bin/.idx), weighted:
    # "0.3 a.bin 0.7 b.bin" or a list of {path, weight} (docs/data.md)
    paths: list | str = field(default_factory=list)
    tokenizer: str = ""                          # a sentencepiece .model; empty: train one on the corpus
    eval_fraction: float = 0.02
    attention_balance: str = "off"               # off | reorder | repack
    attention_cost: str = ""                     # calibration file of the attention cost model
    max_context_loss: float = 1.0                # repack: most share of a batch's tokens its cuts may cut off
    cache_dir: str = ""                          # indexed datasets' packing/shuffle indexes; empty: beside the data
    log_samples: bool = False                    # each rank logs the sample ids it read per step (logs/samples_*)


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
    # count every collective the comm layer issues (kind, group, bytes) into logs/collectives/rank_<R>.jsonl, one
    # record per step (parallel/comm/counters.py; a host callback per collective: for measurement runs)
    collectives: bool = False


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
