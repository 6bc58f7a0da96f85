"""Dynamic expert placement (parallel/ep/placement.py): device load balance, bytes moved and planning time.

    .venv/bin/python -m bench.expert_placement              # synthetic traces and the tiny model trained 60 steps
    .venv/bin/python -m bench.expert_placement --no-tiny    # synthetic traces only (about a minute)
    .venv/bin/python -m bench.expert_placement --no-tiny --devices 8 --repeats 1   # table 3 quickly (20 s)
    .venv/bin/python -m bench.expert_placement --tiny-output output/tiny   # the tiny trace from an earlier run

Traces (per MoE layer, tokens per expert per sampled step; top-k distinct experts per token, Gumbel top-k):
  skewed   - --experts (256) experts, popularity ~ 1/rank^--zipf over a random permutation, fixed over time
  drifting - the same, its log-popularity moving linearly from one random permutation to another over the trace
  tiny     - recipes/tiny.yaml trained --tiny-steps steps in this process (16 experts, top-4, 3 MoE layers), its
             routing on held-out batches cut into --windows windows (no drift: one model); layouts 2x2, 2x4
Each window is --steps-per-window sampled steps of --tokens tokens. Devices: --devices (8 to 64), nodes of
--devices-per-node (8); slots per device E/D + --spare-slots (the memory for one more expert per device).

Table 1, placement on each window's own load (mean over windows and layers), max/mean device load:
  static    - MindFormers' placement: expert e on device e // (E/D)
  greedy    - one copy per expert, largest first onto the least loaded device, all devices at once (no nodes,
              no refinement, move cost ignored)
  planner   - plan_placement without replicas / with replicas of the hottest experts in the spare slots
  bounds    - without replicas: max(hottest expert, mean)/mean (the issue's bound), and the bound with the slots
              (`load_bound`: the hottest expert's device must also take the lightest experts the other devices'
              slots cannot hold)
  plan ms   - time.perf_counter, median of --repeats runs per window (then the median over windows, and the
              worst window's median), without / with replicas; CPU: time.process_time likewise (this machine's 2
              cores are shared: wall time counts the waits)

Table 2, online: at each window boundary the predictor (Holt smoothing with trend) forecasts the next window from
the ones before; a placement made for the forecast is judged on the window that comes (realised max/mean, mean
over the windows from the second on). greedy re-places every window from scratch (every expert whose device
changes moves); the planner starts from static and migrates only when plan_migration accepts (gain over the window
> cost of moving weights + 2 Adam moments at --cluster's link speeds). Token scale for gain and cost: the 1t recipe's
routed expert (hidden 4096, FFN 2304: 28.3M parameters, fp32 weights and moments: 340 MB a copy), --real-tokens
tokens per device per step, --real-window steps per window; the expert time per token copy is 18 x hidden x FFN
FLOPs at the cluster's bf16 peak x matmul efficiency.

Table 3, the time gained: the 1t recipe's own layout priced by the planner's cost model (`Workload.expert_load` =
the realised max/mean of table 2's online run on a 512-expert top-8 trace of each kind) for each placement; the
exchange moves the routed copies, so the most loaded rank slows its expert compute and its receive.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

from bench.ep_traffic import gumbel_topk
from oneline import OneLineParser
from parallel.ep.load import LoadPredictor, LoadWindow
from parallel.ep.migration_plan import MoveCost, plan_migration
from parallel.ep.placement import Placement, expert_flops_per_token, greedy_placement, load_bound, plan_placement
from parallel.planner.cluster import load_cluster

os.environ.setdefault("GLOG_v", "3")      # MindSpore (the tiny trace): errors only

HIDDEN_1T, FFN_1T = 4096, 2304


# ---- traces: [windows, layers, experts] tokens per expert per window (sampled scale) ---------------------------------
def synthetic_trace(kind: str, experts: int, k: int, zipf: float, windows: int, steps: int, tokens: int,
                    rng) -> np.ndarray:
    base = np.log(1.0 / np.arange(1, experts + 1) ** zipf)
    a, b = base[rng.permutation(experts)], base[rng.permutation(experts)]
    total = windows * steps
    out = np.zeros((windows, 1, experts))
    for t in range(total):
        s = t / max(1, total - 1) if kind == "drifting" else 0.0
        logw = ((1 - s) * a + s * b).astype(np.float32)
        idx = gumbel_topk(rng, np.broadcast_to(logw, (tokens, experts)), k)
        out[t // steps, 0] += np.bincount(idx.ravel(), minlength=experts)
    return out


def tiny_trace(rec, windows: int) -> np.ndarray:
    layers = sorted(rec.routing)
    out = np.zeros((windows, len(layers), rec.num_experts))
    for j, layer in enumerate(layers):
        for w, part in enumerate(np.array_split(rec.routing[layer], windows)):
            out[w, j] = np.bincount(part.ravel(), minlength=rec.num_experts)
    return out


def timed(fn, repeats: int) -> tuple[object, float, float]:
    """(result, median wall ms (time.perf_counter), median CPU ms (time.process_time)) of `repeats` runs."""
    wall, cpu, out = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return out, statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


# ---- table 1 ---------------------------------------------------------------------------------------------------------
def quality_row(name: str, trace: np.ndarray, d: int, dpn: int, spare: int, repeats: int) -> dict:
    windows, layers, e = trace.shape
    s = e // d + spare
    acc = {key: [] for key in ("static", "greedy", "plan", "plan_rep", "bound", "bound_slots", "node_plan")}
    t_plain, t_rep, c_rep = [], [], []
    for w in range(windows):
        for layer in range(layers):
            load = trace[w, layer]
            mean = load.sum() / d
            acc["static"].append(Placement.static(e, d, s, dpn, load).imbalance)
            acc["greedy"].append(greedy_placement(load, d, s, dpn).imbalance)
            p, ms, _ = timed(lambda: plan_placement(load, d, s, dpn, replicas=False), repeats)
            t_plain.append(ms)
            acc["plan"].append(p.imbalance)
            p, ms, cpu = timed(lambda: plan_placement(load, d, s, dpn, replicas=True), repeats)
            t_rep.append(ms)
            c_rep.append(cpu)
            acc["plan_rep"].append(p.imbalance)
            nl = p.node_load
            acc["node_plan"].append(nl.max() / nl.mean())
            acc["bound"].append(max(load.max(), mean) / mean)
            acc["bound_slots"].append(load_bound(load, d, s) / mean)
    row = {key: float(np.mean(v)) for key, v in acc.items()}
    row.update(trace=name, devices=d, dpn=dpn, slots=s, experts=e, ms_plain=statistics.median(t_plain),
               ms_rep=statistics.median(t_rep), ms_rep_max=max(t_rep), cpu_rep=statistics.median(c_rep))
    return row


def print_quality(rows: list[dict]) -> None:
    print("\nTable 1: max/mean device load on each window's own load (mean over windows and layers)\n")
    print("| trace | devices (nodes x per node) | slots/device | static | greedy global | planner | "
          "planner + replicas | (its node max/mean) | bound: hottest | bound: hottest + slots | "
          "plan ms, no replicas | plan ms, replicas: median / worst window / CPU |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['trace']} | {r['devices']} ({r['devices'] // r['dpn']}x{r['dpn']}) | {r['slots']} "
              f"| {r['static']:.3f} | {r['greedy']:.3f} | {r['plan']:.3f} | {r['plan_rep']:.3f} "
              f"| {r['node_plan']:.4f} | {r['bound']:.3f} | {r['bound_slots']:.3f} "
              f"| {r['ms_plain']:.2f} | {r['ms_rep']:.2f} / {r['ms_rep_max']:.2f} / {r['cpu_rep']:.2f} |")


# ---- table 2 ---------------------------------------------------------------------------------------------------------
def online_row(name: str, trace: np.ndarray, d: int, dpn: int, spare: int, scale: float, cost: MoveCost,
               spt: float, threshold_intra: float, threshold_inter: float) -> dict:
    windows, layers, e = trace.shape
    s = e // d + spare
    real = trace * scale
    stats = LoadWindow(layers, e, 1)               # one append per window here: the trace is already per window
    predictor = LoadPredictor()
    greedy_prev = [Placement.static(e, d, s, dpn, real[0, j]) for j in range(layers)]
    planners = {rep: [Placement.static(e, d, s, dpn, real[0, j]) for j in range(layers)] for rep in (False, True)}
    acc = {key: [] for key in ("static", "greedy", "plan", "plan_rep", "oracle_rep")}
    moved = {key: [0.0, 0.0] for key in ("greedy", "plan", "plan_rep")}    # intra, inter bytes
    accepted = {False: 0, True: 0}
    gain = {False: 0.0, True: 0.0}
    spent = {False: 0.0, True: 0.0}
    migrate_ms = []
    errors = []
    for w in range(windows):
        if w > 0:                                   # plan for window w from windows < w, judge on window w
            forecast = predictor.predict()
            actual = real[w]
            for j in range(layers):
                acc["static"].append(Placement.static(e, d, s, dpn, actual[j]).imbalance)
                g = greedy_placement(forecast[j], d, s, dpn)
                old = np.argmax(greedy_prev[j].presence(), 0)         # one copy per expert: its device
                new = np.argmax(g.presence(), 0)
                ch = old != new
                same = old[ch] // dpn == new[ch] // dpn
                moved["greedy"][0] += same.sum() * cost.expert_bytes
                moved["greedy"][1] += (~same).sum() * cost.expert_bytes
                greedy_prev[j] = g
                acc["greedy"].append(g.evaluate(actual[j]).imbalance)
                for rep in (False, True):
                    t0 = time.perf_counter()
                    m = plan_migration(planners[rep][j], forecast[j], cost=cost, seconds_per_token=spt,
                                       replicas=rep, threshold_intra=threshold_intra,
                                       threshold_inter=threshold_inter)
                    migrate_ms.append((time.perf_counter() - t0) * 1e3)
                    if m.accepted:
                        accepted[rep] += 1
                        key = "plan_rep" if rep else "plan"
                        moved[key][0] += m.intra_bytes
                        moved[key][1] += m.inter_bytes
                        gain[rep] += m.predicted_gain_s
                        spent[rep] += m.cost_s
                    planners[rep][j] = m.placement
                    acc["plan_rep" if rep else "plan"].append(m.placement.evaluate(actual[j]).imbalance)
                acc["oracle_rep"].append(plan_placement(actual[j], d, s, dpn).imbalance)
        stats.append(real[w])
        predictor.observe(stats.total())
        if predictor.error() is not None:
            errors.append(predictor.error())
    evaluated = (windows - 1) * layers
    row = {key: float(np.mean(v)) for key, v in acc.items()}
    row.update(trace=name, devices=d, dpn=dpn, error=float(np.mean(errors)) if errors else float("nan"),
               evaluated=evaluated, accepted=accepted, gain=gain, spent=spent,
               migrate_ms=statistics.median(migrate_ms),
               moved={key: (a / max(1, evaluated), b / max(1, evaluated)) for key, (a, b) in moved.items()})
    return row


def print_online(rows: list[dict]) -> None:
    print("\nTable 2: online (forecast from earlier windows, judged on the window that came), realised max/mean "
          "device load; bytes moved per window and layer (GiB, intra + inter-node)\n")
    print("| trace | devices | predictor error | static | greedy global | greedy GiB moved | planner | "
          "migrations | GiB moved | planner + replicas | migrations | GiB moved | gain / cost (s, per window) | "
          "planned on the window itself | migrate ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    gib = 2 ** 30

    def mv(key):
        a, b = r["moved"][key]
        return f"{(a + b) / gib:.1f} ({a / gib:.1f} + {b / gib:.1f})"

    for r in rows:
        n = r["evaluated"]
        print(f"| {r['trace']} | {r['devices']} | {r['error']:.3f} | {r['static']:.3f} | {r['greedy']:.3f} "
              f"| {mv('greedy')} | {r['plan']:.3f} | {r['accepted'][False]}/{n} | {mv('plan')} "
              f"| {r['plan_rep']:.3f} | {r['accepted'][True]}/{n} | {mv('plan_rep')} "
              f"| {r['gain'][True] / n:.2f} / {r['spent'][True] / n:.3f} | {r['oracle_rep']:.3f} "
              f"| {r['migrate_ms']:.1f} |")


# ---- table 3 ---------------------------------------------------------------------------------------------------------
def priced_1t(args, rng, cost: MoveCost, spt: float) -> list[dict]:
    """The 1t recipe's own layout on --cluster, its step priced by the planner's cost model (`Workload.expert_load`:
    the most loaded EP rank's copies over the mean) under each placement's realised max/mean on a trace of the 1t
    routing (512 experts, top-8, over its 128 EP ranks in nodes of 8). A migration's cost, amortised: the seconds
    its moves take per layer and window, times the MoE layers a pipeline stage holds, over the window's steps."""
    import dataclasses
    from parallel.planner.cost_model import evaluate
    from parallel.planner.workload import Layouts
    from telechat_moe.recipe import load_recipe
    from telechat_moe.workload import recipe_layout, recipe_workload
    recipe = load_recipe("recipes/1t.yaml")
    w = recipe_workload(recipe, args.cluster)
    layout = recipe_layout(recipe, w)
    m = recipe.model
    d, dpn = layout.ep, w.cluster.devices_per_node
    stage_layers = w.shape.num_moe_layers / layout.pp
    rows = []
    for kind in args.traces:
        t0 = time.perf_counter()
        trace = synthetic_trace(kind, m.n_routed_experts, m.num_experts_per_tok, args.zipf, args.windows,
                                args.steps_per_window, args.tokens, rng)
        scale = args.real_tokens * d * args.real_window / (args.tokens * args.steps_per_window)
        online = online_row(kind, trace, d, dpn, args.spare_slots, scale, cost, spt, args.threshold_intra,
                            args.threshold_inter)
        for name, key, rep in (("balanced (max/mean 1)", None, None), ("static", "static", None),
                               ("greedy global", "greedy", None), ("planner", "plan", False),
                               ("planner + replicas", "plan_rep", True),
                               ("planned on the window itself", "oracle_rep", None)):
            load = 1.0 if key is None else online[key]
            step = float(evaluate(dataclasses.replace(w, expert_load=load), Layouts.of(layout))["step_time"][0])
            moving = 0.0 if rep is None else (online["spent"][rep] / online["evaluated"] * stage_layers
                                              / args.real_window)
            rows.append({"trace": kind, "placement": name, "load": load, "step": step, "moving": moving})
        print(f"[bench] 1t on {args.cluster}: {kind} trace priced ({time.perf_counter() - t0:.1f}s)", flush=True)
    return rows


def print_priced(rows: list[dict], args) -> None:
    print(f"\nTable 3: the 1t recipe's step on {args.cluster} (its own layout, the planner's cost model, even layer "
          f"split) under each placement's realised max/mean EP-rank load (online, as in table 2); migration cost "
          f"amortised over --real-window {args.real_window} steps\n")
    print("| trace | placement | max/mean load | migration s/step | step s | vs static |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        static = next(x for x in rows if x["trace"] == r["trace"] and x["placement"] == "static")
        print(f"| {r['trace']} | {r['placement']} | {r['load']:.3f} | {r['moving']:.4f} | {r['step']:.2f} | "
              f"{100 * ((r['step'] + r['moving']) / static['step'] - 1):+.1f}% |")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.expert_placement", description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--devices-per-node", type=int, default=8)
    ap.add_argument("--spare-slots", type=int, default=1, help="slots per device beyond experts / devices")
    ap.add_argument("--k", type=int, default=8, help="experts per token of the synthetic traces")
    ap.add_argument("--zipf", type=float, default=1.0, help="zipf exponent of expert popularity")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--steps-per-window", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per sampled step of the synthetic traces")
    ap.add_argument("--traces", nargs="+", default=["skewed", "drifting"], choices=["skewed", "drifting"])
    ap.add_argument("--no-tiny", action="store_true", help="leave out the trace of the trained tiny model")
    ap.add_argument("--no-1t", action="store_true", help="leave out table 3 (the 1t step under each placement)")
    ap.add_argument("--tiny-steps", type=int, default=60)
    ap.add_argument("--tiny-output", help="an earlier tiny run's output folder: its checkpoint, no training")
    ap.add_argument("--cluster", default="ascend910b")
    ap.add_argument("--real-tokens", type=int, default=65536, help="tokens per device per step (gain and cost)")
    ap.add_argument("--real-window", type=int, default=50, help="training steps per window (gain and cost)")
    ap.add_argument("--threshold-intra", type=float, default=1.0)
    ap.add_argument("--threshold-inter", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per planning (median)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for d in args.devices:
        if args.experts % d or d % args.devices_per_node:
            ap.error(f"--devices {d}: must divide --experts {args.experts} and be a multiple of "
                     f"--devices-per-node {args.devices_per_node}")
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    cluster = load_cluster(args.cluster)
    cost = MoveCost.from_cluster(cluster, 3 * HIDDEN_1T * FFN_1T)
    spt = expert_flops_per_token(HIDDEN_1T, FFN_1T) / (cluster.flops("bf16") * cluster.matmul_efficiency)
    print(f"[bench] cost: {cost.expert_bytes / 1e6:.0f} MB per expert copy, links {cost.intra_bandwidth / 1e9:.0f} / "
          f"{cost.inter_bandwidth / 1e9:.1f} GB/s (intra / inter, x network efficiency), expert time "
          f"{spt * 1e6:.2f} us per token copy ({args.cluster})", flush=True)

    traces = []
    for kind in args.traces:
        t0 = time.perf_counter()
        tr = synthetic_trace(kind, args.experts, args.k, args.zipf, args.windows, args.steps_per_window,
                             args.tokens, rng)
        traces.append((kind, tr, args.devices, args.devices_per_node, args.k,
                       args.tokens * args.steps_per_window))
        print(f"[bench] {kind}: {args.windows} windows x {args.steps_per_window} steps x {args.tokens} tokens, "
              f"top-{args.k} of {args.experts} ({time.perf_counter() - t0:.1f}s)", flush=True)
    if not args.no_tiny:
        from telechat_moe.routing_trace import trained_tiny_trace
        t0 = time.perf_counter()
        rec = trained_tiny_trace(args.tiny_steps, output_dir=args.tiny_output, log=lambda s: print(s, flush=True))
        tr = tiny_trace(rec, args.windows)
        print(f"[bench] tiny: {rec.source}; {len(rec.routing)} MoE layers x {rec.tokens} held-out tokens in "
              f"{args.windows} windows, {rec.num_experts} experts top-{rec.top_k} ({time.perf_counter() - t0:.1f}s)",
              flush=True)
        for d, dpn in ((4, 2), (8, 4)):
            traces.append((f"tiny ({rec.step} steps)", tr, [d], dpn, rec.top_k, rec.tokens // args.windows))

    quality, online = [], []
    for name, tr, devices, dpn, k, sampled_tokens in traces:
        for d in devices:
            t0 = time.perf_counter()
            quality.append(quality_row(name, tr, d, dpn, args.spare_slots, args.repeats))
            scale = args.real_tokens * d * args.real_window / sampled_tokens
            online.append(online_row(name, tr, d, dpn, args.spare_slots, scale, cost, spt, args.threshold_intra,
                                     args.threshold_inter))
            print(f"[bench] {name} on {d} devices ({time.perf_counter() - t0:.1f}s)", flush=True)
    priced = [] if args.no_1t else priced_1t(args, rng, cost, spt)
    print_quality(quality)
    print_online(online)
    if priced:
        print_priced(priced, args)

    print("\nTargets (synthetic skewed trace): max/mean <= 1.05 with replicas, or within 5% of the bound without; "
          "planning <= 10 ms (256 experts on 64 devices)")
    for r in quality:
        if r["trace"] == "skewed":
            ok = r["plan_rep"] <= 1.05
            near = r["plan"] <= 1.05 * r["bound"]
            print(f"  {r['devices']} devices: with replicas {r['plan_rep']:.3f} ({'met' if ok else 'MISSED'}); "
                  f"without {r['plan']:.3f} vs bound {r['bound']:.3f} "
                  f"({'within 5%' if near else 'not within 5%'}; {r['bound_slots']:.3f} with the slots); "
                  f"planning {r['ms_plain']:.2f} / {r['ms_rep']:.2f} ms median wall, {r['cpu_rep']:.2f} ms CPU "
                  f"with replicas ({'met' if r['ms_rep'] <= 10 else 'MISSED'})")
    print(f"\n[bench] total {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
