"""Expert-parallel dispatch traffic, flat against hierarchical all-to-all, from routing traces.

    .venv/bin/python -m bench.ep_traffic                          # every trace, the tiny model trained 60 steps
    .venv/bin/python -m bench.ep_traffic --tiny-output output/tiny   # the tiny trace from an earlier run's checkpoint
    .venv/bin/python -m bench.ep_traffic --traces uniform zipf --nodes 2 8 64 --k 8
    .venv/bin/python -m bench.ep_traffic --traces tiny --exchange 1t   # rows the exact exchange sends, tiny -> 1t

Placement and counting: parallel/ep/traffic.py (rank r holds experts [rE/R, (r+1)E/R), nodes of --devices-per-node
consecutive ranks). Each row deals a trace of --tokens tokens to the R = nodes x devices-per-node ranks (contiguous
runs) and counts one MoE layer's forward DISPATCH; a training step moves 4x that (dispatch + combine, forward +
backward) per MoE layer and micro-batch. Bytes are per routed token of the trace at the 1t recipe's token size
(hidden 4096 x bfloat16 = 8 KiB; --hidden, --dtype-bytes), whatever model the trace came from.

Experts: --experts (256) while R <= E; rows with more ranks than experts (64 nodes x 8 = 512 ranks) use E = R (512,
one expert per rank), as the E column says. Traces:
  uniform   - k distinct experts uniformly at random (the analytic column's own assumption)
  zipf      - expert popularity ~ 1/rank^--zipf over a random permutation of the experts (skewed load), sampled
              without replacement (Gumbel top-k)
  affinity  - a token's experts on its source's own node weigh --affinity times the others (node-local affinity)
  nodelimit - DeepSeek-V3's node-limited routing: each token picks min(--node-limit, nodes) nodes, then k experts
              among theirs (the router's n_group = nodes, topk_group = node limit, under this placement)
  tiny      - recipes/tiny.yaml trained --tiny-steps steps in this process (16 experts, top-4, 3 MoE layers),
              routing recorded on its held-out batches; only layouts with R <= 16 exist for 16 experts, so its rows
              use 2 to 8 nodes of 2 to 8 devices (--tiny-layouts), the 3 layers pooled.
--exchange RECIPE: the rows the exact flat exchange sends against the routed copies, counted by the trainer's
dispatcher on the tiny trace scaled to the recipe's experts, top-k, ep and tokens per rank (exchange_rows).
Columns: inter- and intra-node KiB per token per MoE layer (dispatch), flat/hier inter-node ratio, the trace's mean
experts per touched remote node (counted per (token, node) pair: equal to the ratio by construction), and its
analytic value for uniform routing (traffic.uniform_expected_reduction).
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from oneline import OneLineParser
from parallel.ep.traffic import (EpTopology, Traffic, expected_reduction, split_by_rank, token_bytes, total,
                                 uniform_expected_reduction)

os.environ.setdefault("GLOG_v", "3")      # MindSpore (the tiny trace): errors only, as run_train's tests run it

SYNTHETIC = ("uniform", "zipf", "affinity", "nodelimit")
TINY_LAYOUTS = ("2x8", "2x4", "4x4", "2x2", "4x2", "8x2")


# ---- synthetic traces: [R, T, k] ---------------------------------------------------------------------------
def gumbel_topk(rng, log_weights: np.ndarray, k: int) -> np.ndarray:
    """k distinct experts per row, drawn without replacement with probabilities ~ exp(log_weights) (Gumbel top-k):
    log_weights [..., E] -> int32 [..., k]."""
    u = np.maximum(rng.random(log_weights.shape, dtype=np.float32), np.float32(1e-30))
    keys = log_weights - np.log(-np.log(u))
    return np.argpartition(-keys, k - 1, axis=-1)[..., :k].astype(np.int32)


def synthetic(name: str, topo: EpTopology, tokens_per_rank: int, k: int, rng, *, zipf: float, affinity: float,
              node_limit: int) -> np.ndarray:
    r, e = topo.ranks, topo.num_experts
    shape = (r, tokens_per_rank, e)
    expert_node = topo.node_of_rank(topo.rank_of(np.arange(e)))
    if name == "uniform":
        logw = np.zeros((1, 1, e), np.float32)
    elif name == "zipf":
        popularity = 1.0 / np.arange(1, e + 1) ** zipf
        logw = np.log(popularity[rng.permutation(e)]).astype(np.float32).reshape(1, 1, e)
    elif name == "affinity":
        own = expert_node[None, :] == topo.node_of_rank(np.arange(r))[:, None]                 # [R, E]
        logw = np.where(own, np.log(affinity), 0.0).astype(np.float32)[:, None, :]
    elif name == "nodelimit":
        m = min(node_limit, topo.nodes)
        if m * topo.experts_per_node < k:
            raise ValueError(f"nodelimit: {m} nodes of {topo.experts_per_node} experts hold fewer than k={k}")
        picked = np.argpartition(rng.random((r, tokens_per_rank, topo.nodes)), m - 1, axis=-1)[..., :m]
        allowed = np.zeros((r, tokens_per_rank, topo.nodes), bool)
        np.put_along_axis(allowed, picked, True, axis=-1)
        logw = np.where(allowed[..., expert_node], 0.0, -np.inf).astype(np.float32)
    else:
        raise ValueError(name)
    return gumbel_topk(rng, np.broadcast_to(logw, shape), k)


# ---- rows -----------------------------------------------------------------------------------------------------
def row(trace: str, topo: EpTopology, k: int, traffic: Traffic, reduction: float, tokens: int, bpt: int) -> dict:
    kib = traffic.to_bytes(bpt)
    per_token = {name: value / tokens / 1024 for name, value in kib.items()}
    return {"trace": trace, "nodes": topo.nodes, "dpn": topo.devices_per_node, "ranks": topo.ranks, "k": k,
            "E": topo.num_experts, **per_token, "ratio": traffic.ratio, "reduction": reduction,
            "uniform": uniform_expected_reduction(k, topo.nodes, topo.num_experts, topo.ranks)}


def print_table(rows: list[dict], bpt: int) -> None:
    print(f"\nDispatch traffic of one MoE layer's forward, KiB per routed token ({bpt} B per token copy); "
          f"x4 per training step (dispatch + combine, forward + backward)\n")
    print("| trace | nodes | ranks | k | E | inter flat | inter hier | flat/hier | trace experts per touched node "
          "| uniform analytic | intra flat | intra hier |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['trace']} | {r['nodes']} | {r['ranks']} ({r['nodes']}x{r['dpn']}) | {r['k']} | {r['E']} "
              f"| {r['flat_inter']:.1f} | {r['hier_inter']:.1f} | {r['ratio']:.2f} | {r['reduction']:.3f} "
              f"| {r['uniform']:.3f} | {r['flat_intra']:.1f} | {r['hier_intra']:.1f} |")


def exchange_rows(rec, recipe_name: str, rng) -> dict:
    """Rows the exact flat exchange sends for the recipe's layout (ep, experts, top-k and the tokens a rank routes
    per MoE layer, micro-batch and token slice, as the dry run's exchange line states them), routed by the trace
    `rec` scaled to the recipe's experts (routing_trace.scale_routing), its MoE layers one after another. Counted
    by the trainer's own dispatcher (telechat_moe/moe/dispatch.AllToAllDispatcher, `sent_rows`: what the step log's
    ep_rows_sent sums), one source rank at a time: its transport stands in for a member of the ep-rank group
    (SelfTransport, every exchange the identity), and the rows a source sends depend on its own routing only."""
    import mindspore as ms
    from mindspore import Tensor
    from parallel.comm.groups import Group
    from parallel.comm.transport import SelfTransport
    from telechat_moe.dry_run import slice_tokens
    from telechat_moe.moe.dispatch import AllToAllDispatcher
    from telechat_moe.recipe import load_recipe
    from telechat_moe.routing_trace import scale_routing
    class SentRows(ms.nn.Cell):
        def __init__(self, dispatcher):
            super().__init__()
            self.dispatcher = dispatcher

        def construct(self, x, indices, weights):
            return self.dispatcher.sent_rows(self.dispatcher.dispatch(x, indices, weights)[2])

    r = load_recipe(recipe_name)
    ep, experts, k, tokens = r.layout.ep, r.model.n_routed_experts, r.model.num_experts_per_tok, slice_tokens(r)
    ms.set_context(mode=ms.GRAPH_MODE)      # one compile, then each rank's call runs the compiled exchange
    count = SentRows(AllToAllDispatcher(experts, SelfTransport(Group("ep_stand_in", tuple(range(ep)), 0)),
                                        ms.float32))
    x, weights = Tensor(np.ones((tokens, 1), np.float32)), Tensor(np.ones((tokens, k), np.float32))
    sent = copies = 0
    received = np.zeros(ep)
    for layer in rec.routing.values():
        pool = scale_routing(layer, rec.num_experts, experts, k, rng)
        for rank in range(ep):      # the layer's tokens dealt to the ranks in turn, reused once all are dealt
            idx = pool[np.arange(rank * tokens, (rank + 1) * tokens) % len(pool)]
            sent += int(count(x, Tensor(idx), weights).asnumpy())
            copies += idx.size
            received += np.bincount(idx.reshape(-1) // (experts // ep), minlength=ep)
    return {"recipe": recipe_name, "ep": ep, "experts": experts, "k": k, "tokens": tokens,
            "layers": len(rec.routing), "copies": copies, "sent": sent, "ratio": sent / copies,
            "receiver_skew": received.max() / received.mean()}


def layout(text: str) -> tuple[int, int]:
    try:
        nodes, dpn = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--tiny-layouts: expected NODESxDEVICES such as 2x8, got {text!r}") from None
    return nodes, dpn


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.ep_traffic", description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--devices-per-node", type=int, default=8)
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--experts", type=int, default=256, help="E while ranks <= E (else E = ranks)")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per synthetic row, dealt over the ranks")
    ap.add_argument("--traces", nargs="+", default=[*SYNTHETIC, "tiny"], choices=[*SYNTHETIC, "tiny"])
    ap.add_argument("--zipf", type=float, default=1.0, help="zipf exponent of expert popularity")
    ap.add_argument("--affinity", type=float, default=4.0, help="weight of experts on the source's node")
    ap.add_argument("--node-limit", type=int, default=4, help="nodes per token of the nodelimit trace")
    ap.add_argument("--tiny-steps", type=int, default=60)
    ap.add_argument("--tiny-output", help="an earlier tiny run's output folder: its checkpoint, no training")
    ap.add_argument("--tiny-layouts", nargs="+", default=list(TINY_LAYOUTS), help="NODESxDEVICES per tiny row")
    ap.add_argument("--exchange", nargs="*", default=[], metavar="RECIPE",
                    help="also count the rows the exact exchange sends on the tiny trace scaled to these recipes' "
                         "layouts (e.g. 1t)")
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size of a token copy (1t recipe: 4096)")
    ap.add_argument("--dtype-bytes", type=int, default=2, help="bytes per element of a token copy (bfloat16: 2)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        tiny_layouts = [layout(x) for x in args.tiny_layouts]
    except ValueError as e:
        ap.error(str(e))
    bpt = token_bytes(args.hidden, args.dtype_bytes)
    rng = np.random.default_rng(args.seed)
    rows, started = [], time.perf_counter()

    for trace in [t for t in args.traces if t in SYNTHETIC]:
        t0 = time.perf_counter()
        for k in args.k:
            for nodes in args.nodes:
                ranks = nodes * args.devices_per_node
                e = args.experts if ranks <= args.experts else ranks
                if e % ranks:
                    e = -(-e // ranks) * ranks
                topo = EpTopology(e, ranks, args.devices_per_node)
                per = max(1, args.tokens // ranks)
                idx = synthetic(trace, topo, per, k, rng, zipf=args.zipf, affinity=args.affinity,
                                node_limit=args.node_limit)
                rows.append(row(trace, topo, k, total(idx, topo), expected_reduction(idx, topo), per * ranks, bpt))
        print(f"[bench] {trace}: {len(args.k) * len(args.nodes)} rows, {args.tokens} tokens each "
              f"({time.perf_counter() - t0:.1f}s)", flush=True)

    if "tiny" in args.traces:
        from telechat_moe.routing_trace import trained_tiny_trace
        t0 = time.perf_counter()
        rec = trained_tiny_trace(args.tiny_steps, output_dir=args.tiny_output,
                                 log=lambda s: print(s, flush=True))
        print(f"[bench] tiny trace: {rec.source}; {len(rec.routing)} MoE layers x {rec.tokens} held-out tokens, "
              f"{rec.num_experts} experts top-{rec.top_k} ({time.perf_counter() - t0:.1f}s: "
              + ", ".join(f"{k} {v:.1f}s" for k, v in rec.seconds.items()) + ")", flush=True)
        per_layer = []
        for nodes, dpn in tiny_layouts:
            try:
                topo = EpTopology(rec.num_experts, nodes * dpn, dpn)
            except ValueError as e:
                print(f"[bench] tiny {nodes}x{dpn}: skipped ({e})")
                continue
            by_layer = {i: split_by_rank(idx, topo) for i, idx in rec.routing.items()}
            traffic = sum(total(x, topo) for x in by_layer.values())
            pooled = np.concatenate(list(by_layer.values()), axis=1)
            tokens = sum(x.shape[0] * x.shape[1] for x in by_layer.values())
            rows.append(row(f"tiny ({rec.step} steps)", topo, rec.top_k, traffic,
                            expected_reduction(pooled, topo), tokens, bpt))
            per_layer.append(f"{nodes}x{dpn}: " + " ".join(f"L{i} {total(x, topo).ratio:.2f}"
                                                           for i, x in by_layer.items()))
        print("[bench] tiny flat/hier per MoE layer: " + "; ".join(per_layer))
        exchanged = []
        for name in args.exchange:
            t0 = time.perf_counter()
            exchanged.append(exchange_rows(rec, name, rng))
            print(f"[bench] exact exchange on the tiny trace scaled to {name} ({time.perf_counter() - t0:.1f}s)",
                  flush=True)
    print_table(rows, bpt)
    if "tiny" in args.traces and exchanged:
        print("\nRows the exact flat exchange sends (its dispatcher's own count, the step log's ep_rows_sent) on the "
              "tiny trace scaled to a recipe's layout, per MoE layer x the trace's layers, all source ranks\n")
        print("| recipe | ep | experts | top-k | tokens per rank and slice | routed copies | rows sent | sent / copies "
              "| most loaded receiver / mean |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for e in exchanged:
            print(f"| {e['recipe']} | {e['ep']} | {e['experts']} | {e['k']} | {e['tokens']} | {e['copies']:,} "
                  f"| {e['sent']:,} | {e['ratio']:.4f}x | {e['receiver_skew']:.2f} |")
    wide = sorted({r["E"] for r in rows if not r["trace"].startswith("tiny") and r["E"] != args.experts})
    if wide:
        print(f"\nE = {args.experts} experts except where ranks > {args.experts} (one expert group per rank): "
              f"E = {', '.join(map(str, wide))} there, one expert per rank.")
    if "tiny" in args.traces:
        print("tiny rows: the trained tiny model's own routing (16 experts, top-4), so only layouts with ranks <= 16 "
              "exist; priced at the same bytes per token copy as the other rows, its 3 MoE layers pooled.")
    print(f"\n[bench] total {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
