"""How one rank of a parallel layout holds the model and what it exchanges: every weight it builds (full shape, the
axis split, the group it is split over, its shard) and every collective one micro-batch's forward and backward and
the step's gradient reduction issue on it (where, direction, kind, group, the tensor as it enters the collective, its
dtype, payload and wire bytes). `run_train.py --dry-run --show-parallel` prints it (show_parallel.py);
tests/test_show_parallel.py builds the model of a layout with recording transports and checks it call for call.

Pure functions of (ModelConfig, ParallelLayout, the micro-batch: b sequences of s tokens): nothing here imports
MindSpore, so the report is as cheap as the dry run for the largest recipes. What it lists is read from the code that
issues the collectives, and mirrors it:

- telechat_moe/model.py, mla.py, layers.py, mtp.py, moe/layer.py, moe/router.py, moe/dispatch.py, and under them
  parallel/tp/layers.py and parallel/tp/mappings.py over parallel/comm/collectives.py (each Cell's forward and
  bprop): the collectives of one micro-batch;
- telechat_moe/gradients.py's PrepareGradients: the gradient all-reduces of the step (per weight over dp, tp or edp;
  the two norm sums), and the trainer's two host-side all-reduces over the world (expert load, loss means).

Conventions:
- The collective listed is the logical one, what HCCL / NCCL run through `NativeTransport`. The CPU transport
  (`CpuTransport`, mccl) builds all-gather, reduce-scatter and all-to-all out of all-reduces of bigger buffers; on CPU
  the wire bytes are larger than listed.
- A group of one rank exchanges nothing (`SelfTransport`), so no collective of such a group is listed.
- `shape` is the tensor as it enters the collective: the input of an all-gather (the output is g times as many
  rows), the full input of a reduce-scatter. The Cells of parallel/comm gather and scatter axis 0, so the sequence
  collectives of sequence parallelism see [s, b, h] (sequence first).
- payload_bytes: the full buffer (an all-gather's output, a reduce-scatter's input, an all-reduce's or all-to-all's
  tensor); wire_bytes: what one rank sends under the ring algorithm, (g-1)/g x payload for all-gather,
  reduce-scatter and all-to-all, 2(g-1)/g x payload for all-reduce.
- dtypes as they reach the collective: the residual stream is float32 (the embedding is), so are the routed tokens
  and the gradients; a tensor-parallel region's input is cast to the compute dtype before its collective
  (EnterRegion, a column-parallel layer's own input, eh_proj's), the head's to float32 (the head computes in
  float32); the outputs of the linear layers (a row-parallel layer's partial sums, the experts' results, eh_proj's
  columns) are in the compute dtype. Every parameter is built in float32 (params_dtype is counted by the dry run's
  memory figures, not applied by the model).
- The tensor-parallel collectives of each piece (a region's entry and exit, the embedding, the head and the
  cross-entropy, the router's sums, MTP's eh_proj) are parallel/planner/tp_traffic.py's, the list the planner's
  cost model prices: the report adds where each is issued.
- Micro-batch: b = global_batch_size / (data_parallel x micro_batch_num) sequences of seq_length tokens; the
  forward and backward collectives run micro_batch_num times a step, the step's once.
- Context parallelism (parallel/cp): a rank holds s/cp positions of each sequence (the tensor-parallel and expert
  collectives are of those), gathers MLA's latent and shared key over cp in each attention (reduce-scatter in the
  backward), sums each loss over cp (forward), the router's statistics over tp x cp (`tp_cp`), and the dense
  gradients over dp x cp (listed as `dp`, of that size).
- Pipeline parallelism is planned, not trained: for pp > 1 the report is one rank of one stage (by default the
  dry run's heaviest), holding the layers `even_layer_split` gives it (contiguous, as the dry run counts them; an
  interleaved schedule would hold other layers), with the embedding on stage 0 and norm, head and MTP on the last.
  The stage-to-stage transfers are point-to-point, not collectives, and are not listed.
- recompute_config.recompute (full): each decoder layer's forward runs again in its backward, its collectives with
  it (listed as backward, `note` recompute), as the planner assumes.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import prod

from parallel.ep.capacity import routed_copies, sent_rows
from parallel.planner import tp_traffic

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}
PARAM_DTYPE = "float32"      # the dtype of every Parameter the model builds
RESIDUAL = "float32"         # the residual stream, norms' outputs, routed tokens, gradients of float32 tensors
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v")
DIRECTIONS = ("forward", "backward", "step")

# Replicated weights inside a tensor-parallel region (telechat_moe.model.INSIDE_REGIONS; the test compares them): their
# gradient on a rank is its share, summed over tp by PrepareGradients.
INSIDE_REGIONS = (".self_attn.q_a_proj.", ".self_attn.q_a_layernorm.", ".self_attn.kv_a_proj_with_mqa.",
                  ".self_attn.kv_a_layernorm.", ".mlp.gate.")


@dataclass(frozen=True)
class WeightShard:
    """One parameter as one rank builds it."""
    name: str                      # the model's parameter name (layers.1.self_attn.q_b_proj.weight)
    full_shape: tuple
    split_axis: int | None         # the axis split over `group`, None: replicated
    group: str | None              # tp or ep
    group_size: int
    shard_shape: tuple
    trainable: bool = True         # the routers' expert_bias is not (moved by its own rule)
    reduced_over: tuple = ()       # the groups the step all-reduces its gradient over (groups of one rank left out)
    etp_axis: int | None = None    # a routed expert's axis split over expert tensor parallelism (etp > 1)
    etp: int = 1

    @property
    def numel(self) -> int:
        return prod(self.shard_shape)

    @property
    def full_numel(self) -> int:
        return prod(self.full_shape)


@dataclass(frozen=True)
class Collective:
    where: str          # the module (layers.1.self_attn.o_proj); a shared module called for MTP: embed_tokens@mtp.0
    what: str
    direction: str      # forward | backward | step
    kind: str           # all_reduce | all_gather | reduce_scatter | all_to_all | all_to_all_v
    group: str          # tp | ep | ep_node | ep_inter | dp | edp | world
    group_size: int
    shape: tuple        # as it enters the collective (all_to_all_v: its rows as expected, known at run time)
    dtype: str
    note: str = ""      # recompute: the forward's collective again in the backward; host: outside the step graph

    @property
    def payload_bytes(self) -> int:
        n = prod(self.shape) * DTYPE_BYTES[self.dtype]
        return n * self.group_size if self.kind == "all_gather" else n

    @property
    def wire_bytes(self) -> float:
        g = self.group_size
        return (2 if self.kind == "all_reduce" else 1) * (g - 1) / g * self.payload_bytes

    @property
    def key(self) -> tuple:
        """What a recording transport sees: (kind, group size, shape, dtype); an uneven all-to-all's rows as -1."""
        shape = (-1,) + tuple(self.shape[1:]) if self.kind == "all_to_all_v" else tuple(self.shape)
        return (self.kind, self.group_size, shape, self.dtype)


@dataclass(frozen=True)
class ParallelReport:
    layout: object                 # parallel.layout.ParallelLayout
    batch: int                     # sequences per micro-batch
    seq: int
    micro_batches: int             # micro-batches per step
    stage: int
    layers: tuple                  # [first, end) of the decoder layers on the stage
    has_embedding: bool
    has_head: bool                 # final norm, head, MTP
    weights: tuple
    collectives: tuple
    group_sizes: dict = field(default_factory=dict)

    @property
    def parameters(self) -> int:
        """Trainable parameters on the rank (what the dry run's 'parameters per device' counts)."""
        return sum(w.numel for w in self.weights if w.trainable)

    @property
    def expert_parameters(self) -> int:
        """Of them in the routed experts (split over ep, whole at ep=1)."""
        return sum(w.numel for w in self.weights if w.trainable and ".experts." in f".{w.name}")

    @property
    def parameter_bytes(self) -> int:
        return self.parameters * DTYPE_BYTES[PARAM_DTYPE]

    def select(self, direction: str | None = None, group: str | None = None, where=None, host: bool = False):
        """The collectives of a direction / group / module (`where`: a prefix, or a predicate of the name);
        the trainer's host-side ones only with host=True."""
        out = []
        for c in self.collectives:
            if (direction and c.direction != direction) or (group and c.group != group) or \
                    (not host and c.note == "host"):
                continue
            if where is not None and not (where(c.where) if callable(where) else _under(c.where, where)):
                continue
            out.append(c)
        return out

    def wire_bytes(self, **kw) -> float:
        return sum(c.wire_bytes for c in self.select(**kw))

    def payload_bytes(self, **kw) -> int:
        return sum(c.payload_bytes for c in self.select(**kw))

    def step_wire_bytes(self, host: bool = True) -> float:
        """Per rank and step: micro_batch_num x (forward + backward) + the step's gradient reduction."""
        per_micro = self.wire_bytes(direction="forward") + self.wire_bytes(direction="backward")
        return self.micro_batches * per_micro + self.wire_bytes(direction="step", host=host)

    def step_payload_bytes(self, host: bool = True) -> int:
        per_micro = self.payload_bytes(direction="forward") + self.payload_bytes(direction="backward")
        return self.micro_batches * per_micro + self.payload_bytes(direction="step", host=host)

    def keys(self, direction: str, host: bool = False) -> Counter:
        """The multiset of (kind, group size, shape, dtype) a recording transport sees."""
        return Counter(c.key for c in self.select(direction=direction, host=host))


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".") or name.startswith(prefix + "@")


# ---- the model, read from its code -----------------------------------------------------------------------------
class _Rank:
    def __init__(self, cfg, layout, batch: int, seq: int, recompute: str, dispatcher: str):
        self.cfg, self.layout = cfg, layout
        # the positions of a sequence this rank computes (all of them but under context parallelism)
        self.b, self.s, self.h = batch, seq // layout.cp, cfg.hidden_size
        self.cp = layout.cp
        self.t, self.sp = layout.tp, bool(layout.sp) and layout.tp > 1
        self.cdt = cfg.compute_dtype
        self.recompute = recompute
        self.dispatcher = dispatcher if layout.ep > 1 else "local"
        self.sizes = group_sizes(layout, self.dispatcher)
        self.weights: list[WeightShard] = []
        self.collectives: list[Collective] = []

    # -- weights --
    def weight(self, name: str, shape, axis: int | None = None, group: str | None = None, trainable: bool = True,
               etp_axis: int | None = None):
        shape = tuple(int(d) for d in shape)
        size = self.sizes[group] if group else 1
        if axis is not None and size == 1:
            axis, group = None, None
        shard = list(shape)
        if axis is not None:
            if shape[axis] % size:
                raise ValueError(f"{name}: dimension {axis} of {shape} is not divisible by {group}={size}")
            shard[axis] //= size
        etp = self.sizes["etp"] if etp_axis is not None else 1
        if etp > 1:
            shard[etp_axis] //= etp
        self.weights.append(WeightShard(name, shape, axis, group, size if axis is not None else 1, tuple(shard),
                                        trainable, etp_axis=etp_axis if etp > 1 else None, etp=etp))

    def column(self, name, out_features, in_features):
        self.weight(name, (out_features, in_features), 0, "tp")

    def row(self, name, out_features, in_features):
        self.weight(name, (out_features, in_features), 1, "tp")

    # -- collectives --
    def coll(self, where, what, direction, kind, group, shape, dtype, note=""):
        g = self.sizes[group]
        if g > 1:
            self.collectives.append(Collective(where, what, direction, kind, group, g,
                                               tuple(int(d) for d in shape), dtype, note))

    def add(self, where: str, collectives, note: str = "", group: str = "tp"):
        """parallel/planner/tp_traffic's collectives of a piece, issued at `where` over tp (or `group`; the dtype
        roles read as this model's: compute -> the compute dtype, residual -> float32)."""
        dtypes = {tp_traffic.COMPUTE: self.cdt, tp_traffic.RESIDUAL: RESIDUAL, tp_traffic.FLOAT32: "float32"}
        for c in collectives:
            self.coll(where, c.what, c.direction, c.kind, group, c.shape, dtypes[c.dtype], note)

    def enter_region(self, where: str, width: int | None = None, dtype: str = tp_traffic.COMPUTE,
                     what: str = "EnterRegion"):
        """EnterRegion / a column-parallel layer's input, cast to the region's compute dtype (`dtype`) first."""
        self.add(where, tp_traffic.region_entry(self.s, self.b, self.t, self.h, self.sp, width, dtype, what))

    def row_parallel(self, where: str):
        self.add(where, tp_traffic.row_parallel_exit(self.s, self.b, self.t, self.h, self.sp))

    def embedding(self, where: str):
        self.add(where, tp_traffic.embedding_lookup(self.s, self.b, self.t, self.h, self.sp))

    def head(self, where: str, loss: str):
        """The head's input (float32: the head computes in float32; none when tied) and the cross-entropy."""
        if self.t == 1:
            return
        if not self.cfg.tie_word_embeddings:
            self.enter_region(where, self.h, tp_traffic.FLOAT32, "ColumnParallelLinear input")
        self.add(loss, tp_traffic.cross_entropy(self.s, self.b, self.t))

    def context_sum(self, loss: str):
        """SumOverContext: the loss's parts over cp (ReduceFromGroup: forward only)."""
        self.coll(loss, "SumOverContext: the loss's parts over cp", "forward", "all_reduce", "cp", (), "float32")

    # -- blocks --
    def attention(self, prefix: str):
        cfg, h = self.cfg, self.h
        H, qk = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if H % self.t:
            raise ValueError(f"num_attention_heads {H} is not divisible by model_parallel {self.t}")
        a = f"{prefix}.self_attn"
        if cfg.q_lora_rank:
            self.weight(f"{a}.q_a_proj.weight", (cfg.q_lora_rank, h))
            if cfg.qk_layernorm:
                self.weight(f"{a}.q_a_layernorm.weight", (cfg.q_lora_rank,))
            self.column(f"{a}.q_b_proj.weight", H * qk, cfg.q_lora_rank)
        else:
            self.column(f"{a}.q_proj.weight", H * qk, h)
        self.weight(f"{a}.kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h))
        if cfg.qk_layernorm:
            self.weight(f"{a}.kv_a_layernorm.weight", (cfg.kv_lora_rank,))
        self.column(f"{a}.kv_b_proj.weight", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        self.row(f"{a}.o_proj.weight", h, H * cfg.v_head_dim)
        self.enter_region(a, h)
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.coll(f"{a}.context", "GatherContext: normed latent and rotated shared key", "forward", "all_gather", "cp",
                  (self.s, self.b, width), self.cdt)
        self.coll(f"{a}.context", "GatherContext backward: their gradient", "backward", "reduce_scatter", "cp",
                  (self.s * self.cp, self.b, width), self.cdt)
        self.row_parallel(f"{a}.o_proj")

    def swiglu(self, prefix: str, intermediate: int):
        h = self.h
        self.column(f"{prefix}.gate_proj.weight", intermediate, h)
        self.column(f"{prefix}.up_proj.weight", intermediate, h)
        self.row(f"{prefix}.down_proj.weight", h, intermediate)
        self.enter_region(prefix, h)
        self.row_parallel(f"{prefix}.down_proj")

    def moe(self, prefix: str):
        cfg, b, s, t, h = self.cfg, self.b, self.s, self.t, self.h
        E, k, ep = cfg.n_routed_experts, cfg.num_experts_per_tok, self.layout.ep
        m = f"{prefix}.mlp"
        self.weight(f"{m}.gate.weight", (E, h))
        self.weight(f"{m}.gate.expert_bias", (E,), trainable=False)
        # expert tensor parallelism: gate and up by columns (packed [gate | up] shards), down by rows
        self.weight(f"{m}.experts.w1", (E, h, 2 * cfg.moe_intermediate_size), 0, "ep", etp_axis=2)
        self.weight(f"{m}.experts.w2", (E, cfg.moe_intermediate_size, h), 0, "ep", etp_axis=1)
        # each tp rank routes its 1/tp of the positions: without sequence parallelism split off (and gathered back)
        split = tp_traffic.moe_token_split(s, b, t, h, self.sp)
        local = s // t if t > 1 else s
        self.add(m, split[:1])
        # the ranks routing a sequence's positions: tp, times cp under context parallelism
        self.add(f"{m}.gate", tp_traffic.router_sums(b, t * self.cp, E, cfg.moe_device_aux_loss_coeff > 0,
                                                     cfg.moe_z_loss_coeff > 0), group="tp" if self.cp == 1 else "tp_cp")
        if ep > 1:
            rows = b * local // cfg.moe_comm_chunks
            for _ in range(cfg.moe_comm_chunks):
                self.dispatch(f"{m}.dispatcher", rows)
                self.expert_rows(f"{m}.experts", rows)
        self.add(m, split[1:])
        self.swiglu(f"{m}.shared_experts", cfg.moe_shared_expert_intermediate_size * cfg.n_shared_experts)

    def exchange(self, where: str, group: str, rows: int, experts: int):
        """_ExpertExchange over `group`: the copies per expert (a fixed-shape all-to-all, float32), the uneven
        all-to-alls (AllToAllV) of the token copies and of the results in the compute dtype, the backward's reverse
        ones. Their rows are known at run time: the routed copies of `rows` tokens (after any capacity drop) and one
        pad row per member (parallel/ep/capacity.py), as listed."""
        cfg, h = self.cfg, self.h
        g, k, cf = self.sizes[group], cfg.num_experts_per_tok, cfg.moe_expert_capacity_factor
        sent = int(sent_rows(routed_copies(rows, k, cfg.n_routed_experts, cf), g))
        what = f"{sent} rows, {'dropless' if cf is None else f'capacity factor {cf}'}"
        self.coll(where, "dispatch AllToAll: copies per expert", "forward", "all_to_all", group,
                  (g, experts // g), "float32")
        self.coll(where, f"dispatch AllToAllV: token copies ({what})", "forward", "all_to_all_v", group, (sent, h),
                  self.cdt)
        self.coll(where, "combine AllToAllV: expert outputs", "forward", "all_to_all_v", group, (sent, h), self.cdt)
        self.coll(where, "dispatch AllToAllV backward: token copies' gradient", "backward", "all_to_all_v", group,
                  (sent, h), self.cdt)
        self.coll(where, "combine AllToAllV backward: outputs' gradient", "backward", "all_to_all_v", group,
                  (sent, h), self.cdt)

    def expert_rows(self, where: str, rows: int):
        """parallel/tp/expert.py's ExpertRows over etp: the rows per local expert of each peer (all-gather, float32,
        no gradient), the received rows tiled to every peer and the peers' partial sums back (uneven all-to-alls
        whose rows are known at run time: listed at the rows the exchange sent, what a rank receives on average),
        each mirrored in the backward."""
        etp = self.sizes["etp"]
        if etp == 1:
            return
        cfg, h = self.cfg, self.h
        local = cfg.n_routed_experts // self.layout.ep
        n = etp * int(sent_rows(routed_copies(rows, cfg.num_experts_per_tok, cfg.n_routed_experts,
                                              cfg.moe_expert_capacity_factor), self.layout.ep))
        self.coll(where, "ExpertRows.gather: rows per local expert of each etp peer", "forward", "all_gather", "etp",
                  (local + 1,), "float32")
        for direction, note in (("forward", ""), ("backward", " gradient")):
            self.coll(where, f"ExpertRows.gather AllToAllV: the rows to every etp peer{note}", direction,
                      "all_to_all_v", "etp", (n, h), self.cdt)
            self.coll(where, f"ExpertRows.scatter AllToAllV: the peers' partial sums back{note}", direction,
                      "all_to_all_v", "etp", (n, h), self.cdt)

    def dispatch(self, where: str, rows: int):
        cfg, h, k, E = self.cfg, self.h, self.cfg.num_experts_per_tok, self.cfg.n_routed_experts
        if self.dispatcher != "hierarchical":
            self.exchange(where, "ep", rows, E)
            return
        n = self.sizes["ep_inter"]
        # (token, node) pairs: each token to each node holding any of its experts (expected under uniform
        # routing), one pad row per node
        pairs = round(rows * n * (1 - (1 - 1 / n) ** k)) + n
        self.coll(where, "hierarchical: (token, node) pairs per node", "forward", "all_to_all", "ep_inter", (n,),
                  "float32")
        self.coll(where, f"hierarchical AllToAllV: token rows to the nodes (+ experts, weights; {pairs} expected)",
                  "forward", "all_to_all_v", "ep_inter", (pairs, h + 2 * k), RESIDUAL)
        self.coll(where, "hierarchical AllToAllV backward: rows' gradient from the nodes", "backward", "all_to_all_v",
                  "ep_inter", (pairs, h + 2 * k), RESIDUAL)
        self.exchange(where, "ep_node", rows, E // n)
        self.coll(where, "hierarchical AllToAllV: per-node sums back", "forward", "all_to_all_v", "ep_inter",
                  (pairs, h), self.cdt)
        self.coll(where, "hierarchical AllToAllV backward: sums' gradient", "backward", "all_to_all_v", "ep_inter",
                  (pairs, h), self.cdt)

    def decoder_layer(self, prefix: str, index: int):
        cfg, h = self.cfg, self.h
        start = len(self.collectives)
        self.weight(f"{prefix}.input_layernorm.weight", (h,))
        self.attention(prefix)
        self.weight(f"{prefix}.post_attention_layernorm.weight", (h,))
        if cfg.is_moe_layer(index):
            self.moe(prefix)
        else:
            self.swiglu(f"{prefix}.mlp", cfg.intermediate_size)
        if self.recompute == "full":
            for c in [c for c in self.collectives[start:] if c.direction == "forward"]:
                self.collectives.append(Collective(c.where, c.what + " (recomputed in the backward)", "backward",
                                                   c.kind, c.group, c.group_size, c.shape, c.dtype, "recompute"))

    def mtp(self, d: int):
        cfg, b, s, t, h = self.cfg, self.b, self.s, self.t, self.h
        p = f"mtp.{d}"
        self.embedding(f"embed_tokens@{p}")
        self.weight(f"{p}.enorm.weight", (h,))
        self.weight(f"{p}.hnorm.weight", (h,))
        self.column(f"{p}.eh_proj.weight", h, 2 * h)
        self.add(f"{p}.eh_proj", tp_traffic.mtp_projection(s, b, t, h, self.sp))
        self.decoder_layer(f"{p}.block", cfg.num_hidden_layers + d)
        self.weight(f"{p}.norm.weight", (h,))
        self.head(f"lm_head@{p}", f"cross_entropy@{p}")
        self.context_sum(f"cross_entropy@{p}")

    def model(self, first: int, end: int, has_embedding: bool, has_head: bool):
        cfg, h = self.cfg, self.h
        if has_embedding:
            self.weight("embed_tokens.weight", (cfg.vocab_size, h), 0, "tp")
            self.embedding("embed_tokens")
        for i in range(first, end):
            self.decoder_layer(f"layers.{i}", i)
        if has_head:
            self.weight("norm.weight", (h,))
            if not cfg.tie_word_embeddings:
                self.weight("lm_head.weight", (cfg.vocab_size, h), 0, "tp")
            self.head("lm_head", "cross_entropy")
            self.context_sum("cross_entropy")
            if not has_embedding and cfg.num_nextn_predict_layers and not cfg.tie_word_embeddings:
                # MTP's copy of the embedding on a last stage apart from it (model.StageParts; summed over the pair)
                self.weight("embed_tokens.weight", (cfg.vocab_size, h), 0, "tp")
            for d in range(cfg.num_nextn_predict_layers):
                self.mtp(d)

    # -- the step (PrepareGradients, then the trainer's host-side sums) --
    def partial_over_tp(self, w: WeightShard) -> bool:
        """TeleChatMoE.partial_over_tp: a replicated weight whose gradient is the rank's share."""
        if self.t == 1 or w.group == "tp":
            return False
        return self.sp or any(part in f".{w.name}" for part in INSIDE_REGIONS)

    def step(self, world: int):
        for i, w in enumerate(self.weights):
            if not w.trainable:
                continue
            if ".experts." in f".{w.name}":
                groups = ("edp",)
            elif self.partial_over_tp(w):
                groups = ("dp", "tp")
            else:
                groups = ("dp",)
            groups = tuple(g for g in groups if self.sizes[g] > 1)
            self.weights[i] = WeightShard(**{**w.__dict__, "reduced_over": groups})
            for g in groups:
                self.coll(w.name, f"gradient sum over {g}", "step", "all_reduce", g, w.shard_shape, PARAM_DTYPE)
        self.coll("grad_norm", "sum of the tp shards' squares", "step", "all_reduce", "tp", (), "float32")
        self.coll("grad_norm", "sum of the expert shards' squares", "step", "all_reduce",
                  "ep" if self.sizes["etp"] == 1 else "expert", (), "float32")
        cfg = self.cfg
        routers = cfg.num_moe_layers + cfg.num_nextn_predict_layers
        if world > 1:
            if routers:
                # (+ 5: moe.layer.ROUTING_STATS, the traffic counts and the rows sent)
                self.coll("trainer", "expert load, dispatch traffic and rows sent of every rank (host)", "step",
                          "all_reduce", "world", (routers, cfg.n_routed_experts + 5), "float32", "host")
            self.coll("trainer", "loss means over the ranks (host)", "step", "all_reduce", "world", (5,), "float32",
                      "host")


def group_sizes(layout, dispatcher: str = "alltoall") -> dict:
    """Sizes of the groups a rank of `layout` exchanges on (rank 0's; every rank's are alike): tp, ep, dp (the dense
    gradients' group: data x context), edp, cp, tp_cp (the ranks routing a sequence's positions under context
    parallelism), etp and expert (ep x etp: every expert shard of the stage once), world, and for the hierarchical dispatcher the EP ranks in a node (ep_node) and across nodes
    (ep_inter)."""
    from parallel.layout import Axis
    sizes = {"tp": layout.tp, "ep": layout.ep, "dp": layout.dp * layout.cp, "edp": layout.edp, "cp": layout.cp,
             "tp_cp": layout.tp * layout.cp, "world": layout.world_size, "ep_node": 1, "ep_inter": 1,
             "etp": layout.etp, "expert": layout.ep * layout.etp}
    if dispatcher == "hierarchical" and layout.ep > 1:
        ep = layout.group_of(Axis.EP, 0)
        sizes["ep_node"] = sum(1 for r in ep if layout.node_of(r) == layout.node_of(0))
        sizes["ep_inter"] = len({layout.node_of(r) for r in ep})
    return sizes


def stage_layers(cfg, layout, stage: int) -> tuple[int, int]:
    """[first, end) of the decoder layers a stage holds (the dry run's even split)."""
    from parallel.planner.model_shape import even_layer_split
    counts = even_layer_split(cfg.num_hidden_layers, layout.pp)
    first = sum(counts[:stage])
    return first, first + counts[stage]


def parallel_report(cfg, layout, batch: int, seq: int | None = None, stage: int = 0, recompute: str = "none",
                    dispatcher: str | None = None) -> ParallelReport:
    """One rank of `layout` (on pipeline stage `stage`) training `cfg` on micro-batches of `batch` sequences of
    `seq` tokens (default cfg.seq_length). `recompute`: none | selective | full (the recipe's recompute_config);
    `dispatcher`: the EP token dispatcher (default cfg.moe_token_dispatcher_type)."""
    seq = seq or cfg.seq_length
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage {stage}: the layout has {layout.pp} pipeline stage(s)")
    if layout.tp > 1 and seq % layout.tp:
        raise ValueError(f"seq_length {seq} is not divisible by model_parallel {layout.tp}")
    r = _Rank(cfg, layout, batch, seq, recompute, dispatcher or cfg.moe_token_dispatcher_type)
    first, end = stage_layers(cfg, layout, stage)
    has_embedding, has_head = stage == 0, stage == layout.pp - 1
    r.model(first, end, has_embedding, has_head)
    r.step(layout.world_size)
    return ParallelReport(layout, batch, seq, layout.micro_batch_num, stage, (first, end), has_embedding, has_head,
                          tuple(r.weights), tuple(r.collectives), r.sizes)
