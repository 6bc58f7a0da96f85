"""This project's training step against transformers' DeepseekV3ForCausalLM (eager PyTorch, torch.optim.AdamW),
side by side on this CPU: the same model (our recipe's config and initial weights through hf_adapter), the same
batches, fp32, the same thread count.

Each side runs in a child process of its own, the two alternating for several rounds, because these machines drift
by tens of percent between minutes: only ratios within a round mean much. The side that goes first alternates too
(ours then HF, HF then ours, ...), and the files the preparation wrote are flushed to disk before the first round:
when ours always went first, its round 1 was its slowest of three in each of three runs on tiny (3403 against 3958
and 4184 tok/s in one), the preparation's writeback the likely cause. Per round and side:
the median tokens/s over the timed steps after warm-up, the first step (graph compile for ours), the child's peak
resident set, and the share of a large-GEMM rate measured once at the start in the same run (a 4096^3 fp32 GEMM
through numpy and through MindSpore's MatMul, at the same thread count; the higher of the two is the denominator).

What the two steps compute: forward with the same document-masked causal attention (ours builds the mask from
segment ids in its graph, the HF side passes the same mask as a 4-D additive mask), LM cross-entropy, backward,
gradient clipping at the recipe's norm, AdamW with the recipe's betas, eps and weight decay on matrices only.
Ours also adds its small auxiliary balance loss and moves the router's expert bias after each step, which
transformers' model does not train; MTP is off on both sides.

    .venv/bin/python -m bench.vs_pytorch [--models tiny,small] [--rounds 3] [--steps 6] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dvm_fusion import BLAS_ENVIRONMENT
from oneline import OneLineParser

ROOT = Path(__file__).resolve().parents[1]
NO_MTP = "model.num_nextn_predict_layers=0"
GEMM_N = 4096


def thread_environment(threads: int) -> dict:
    """The environment of every child: BLAS/OpenMP pools of both frameworks sized before they start, and the BLAS
    settings run_train.py gives a training process, a value already set kept as there (the HF side's torch does not
    use that BLAS)."""
    env = {**BLAS_ENVIRONMENT, **os.environ}
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    return env


def set_mindspore_threads(threads: int) -> None:
    import mindspore as ms
    # MindSpore's CPU kernels default to 25 threads whatever the machine has.
    ms.device_context.cpu.op_tuning.threads_num(threads)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def recipe_of(name: str, out: str):
    from telechat_moe.recipe import load_recipe
    return load_recipe(name, [f"output_dir={out}", NO_MTP])


def steps_needed(args) -> int:
    return 1 + args.warmup + args.steps


# ---- children ------------------------------------------------------------------------------------------------
def child_gemm(args) -> dict:
    from parallel.planner.machine import gemm_flops, mindspore_gemm_flops
    set_mindspore_threads(args.threads)
    numpy_rate = gemm_flops(GEMM_N, repeats=3)
    # chain=2: one x @ w_up @ w_down per call, all three GEMM_N square
    ms_rate = mindspore_gemm_flops(GEMM_N, GEMM_N, GEMM_N, chain=2, repeats=3)
    return {"numpy_gflops": numpy_rate / 1e9, "mindspore_gflops": ms_rate / 1e9}


def child_prepare(args) -> dict:
    """Our model's config, initial weights (as transformers' state dict) and batches, for both sides."""
    from telechat_moe.hf_adapter import ours_to_hf
    from telechat_moe.hf_config import hf_config_from
    from telechat_moe.trainer import Trainer, configure_mindspore
    work = Path(args.work)
    recipe = recipe_of(args.child_model, str(work / "ours_output"))
    configure_mindspore(recipe)
    trainer = Trainer(recipe, peak_flops=args.peak)
    cfg = recipe.model
    batches = [trainer.loader.batch_at(0, i) for i in range(steps_needed(args))]
    np.savez(work / "batches.npz", **{k: np.stack([b[k] for b in batches]) for k in batches[0]})
    weights = work / "hf_weights"
    weights.mkdir()
    for name, value in ours_to_hf({p.name: p.asnumpy() for p in trainer.model.get_parameters()}, cfg).items():
        np.save(weights / f"{name}.npy", value)
    (work / "hf_config.json").write_text(json.dumps(hf_config_from(cfg)))
    return {"parameters": int(sum(w.size for w in trainer.weights)),
            "tokens_per_step": recipe.training.global_batch_size * cfg.seq_length}


def timed_steps(step, batches: list, warmup: int) -> dict:
    """First step alone, `warmup` untimed steps, then each of the rest timed. `step` returns the LM loss: the
    first step's, from the same weights and batch on both sides, shows that both computed the same model."""
    start = time.perf_counter()
    first_loss = step(batches[0])
    first = time.perf_counter() - start
    for b in batches[1:1 + warmup]:
        step(b)
    times = []
    for b in batches[1 + warmup:]:
        start = time.perf_counter()
        step(b)
        times.append(time.perf_counter() - start)
    return {"first_step_s": first, "median_step_s": statistics.median(times), "step_s": times,
            "first_loss": float(first_loss)}


def load_batches(work: Path) -> list[dict]:
    with np.load(work / "batches.npz") as z:
        stacked = {k: z[k] for k in z.files}
    return [{k: v[i] for k, v in stacked.items()} for i in range(len(stacked["input_ids"]))]


def child_ours(args) -> dict:
    from telechat_moe.trainer import Trainer, configure_mindspore
    work = Path(args.work)
    recipe = recipe_of(args.child_model, str(work / "ours_output"))
    configure_mindspore(recipe)
    set_mindspore_threads(args.threads)
    trainer = Trainer(recipe, peak_flops=args.peak)
    result = timed_steps(lambda b: trainer.train_step(b)[0]["lm_loss"], load_batches(work), args.warmup)
    return dict(result, parameters=int(sum(w.size for w in trainer.weights)), peak_rss_gib=peak_rss_gib())


def document_causal_mask(segments, torch):
    """Additive [b, 1, s, s] mask: a token sees earlier tokens of its own document (ours: mla.attention_bias)."""
    s = segments.shape[1]
    allowed = (segments[:, :, None] == segments[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    blocked = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return blocked[:, None]


def child_hf(args) -> dict:
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    recipe = recipe_of(args.child_model, str(work / "ours_output"))
    hf = json.loads((work / "hf_config.json").read_text())
    config = transformers.DeepseekV3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(config).train()
    state = model.state_dict()
    files = {p.name[:-len(".npy")] for p in (work / "hf_weights").iterdir()}
    assert files == set(state), sorted(files ^ set(state))[:5]
    with torch.no_grad():
        for name, tensor in state.items():   # one tensor at a time: the peak resident set stays the model's
            tensor.copy_(torch.from_numpy(np.load(work / "hf_weights" / f"{name}.npy")))
    params = list(model.parameters())
    o = recipe.optimizer
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=o.learning_rate, betas=tuple(o.betas), eps=o.eps)

    def step(batch):
        ids, labels = torch.from_numpy(batch["input_ids"]).long(), torch.from_numpy(batch["labels"]).long()
        mask = document_causal_mask(torch.from_numpy(batch["segment_ids"]), torch)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    result = timed_steps(step, load_batches(work), args.warmup)
    return dict(result, parameters=int(sum(p.numel() for p in params)), peak_rss_gib=peak_rss_gib())


CHILDREN = {"gemm": child_gemm, "prepare": child_prepare, "ours": child_ours, "hf": child_hf}


# ---- parent ----------------------------------------------------------------------------------------------------
def run_child(kind: str, args, model: str = "", work: str = "", peak: float = 1.0) -> dict:
    cmd = [sys.executable, "-m", "bench.vs_pytorch", "--child", kind, "--child-model", model, "--work", work,
           "--peak", repr(peak), "--threads", str(args.threads), "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=thread_environment(args.threads))
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        raise SystemExit(f"{kind} {model}: child failed (exit {proc.returncode})\n{proc.stderr[-3000:]}")
    result = json.loads(line[-1][len("RESULT "):])
    result["wall_s"] = time.perf_counter() - start
    return result


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def compare(model: str, args, peak: float) -> dict:
    from parallel.planner.model_shape import flops_per_token
    recipe = recipe_of(model, "unused")
    fpt = flops_per_token(recipe.model.to_model_shape())["training"]
    rounds = []
    with tempfile.TemporaryDirectory(prefix=f"vs_pytorch_{model}_") as work:
        progress(f"{model}: preparing config, initial weights and {steps_needed(args)} batches")
        prepared = run_child("prepare", args, model, work, peak)
        os.sync()
        tokens = prepared["tokens_per_step"]
        for r in range(args.rounds):
            sides = {}
            for side in ("ours", "hf")[::1 if r % 2 == 0 else -1]:
                progress(f"{model}: round {r + 1}/{args.rounds}, {side} ...")
                res = run_child(side, args, model, work, peak)
                if res["parameters"] != prepared["parameters"]:
                    raise SystemExit(f"{model}: {side} has {res['parameters']:,} parameters, "
                                     f"ours {prepared['parameters']:,}")
                res["tokens_per_s"] = tokens / res["median_step_s"]
                res["gemm_share"] = fpt * res["tokens_per_s"] / peak
                sides[side] = res
                progress(f"{model}: round {r + 1}, {side}: {res['tokens_per_s']:.0f} tok/s, first step "
                         f"{res['first_step_s']:.1f} s (LM loss {res['first_loss']:.5f}), peak RSS "
                         f"{res['peak_rss_gib']:.2f} GiB")
            rounds.append(sides)
    return {"model": model, "parameters": prepared["parameters"], "tokens_per_step": tokens,
            "training_flops_per_token": fpt, "rounds": rounds}


def table(result: dict) -> str:
    head = (f"{'round':<7}{'ours tok/s':>11}{'HF tok/s':>10}{'ratio':>7}{'RSS GiB ours/HF':>17}"
            f"{'first step s ours/HF':>22}{'GEMM share ours/HF':>20}")
    first = result["rounds"][0]
    lines = [f"{result['model']}: {result['parameters']:,} parameters, {result['tokens_per_step']} tokens/step, "
             f"first-step LM loss ours {first['ours']['first_loss']:.5f}, HF {first['hf']['first_loss']:.5f}", head]

    def row(label, o_tps, h_tps, o_rss, h_rss, o_first, h_first, o_share, h_share):
        return (f"{label:<7}{o_tps:>11.0f}{h_tps:>10.0f}{o_tps / h_tps:>7.2f}{f'{o_rss:.2f}/{h_rss:.2f}':>17}"
                f"{f'{o_first:.1f}/{h_first:.1f}':>22}{f'{100 * o_share:.1f}%/{100 * h_share:.1f}%':>20}")

    keys = ("tokens_per_s", "peak_rss_gib", "first_step_s", "gemm_share")
    for i, r in enumerate(result["rounds"]):
        lines.append(row(str(i + 1), *[r[side][k] for k in keys for side in ("ours", "hf")]))
    if len(result["rounds"]) > 1:
        lines.append(row("median", *[statistics.median(r[side][k] for r in result["rounds"])
                                     for k in keys for side in ("ours", "hf")]))
    # Beside other jobs the sides slow down unequally (eager PyTorch's thread pool far more than MindSpore's), so
    # the fastest single step of each side, over all rounds, is the nearest to a quiet machine's figure.
    best = {side: result["tokens_per_step"] / min(t for r in result["rounds"] for t in r[side]["step_s"])
            for side in ("ours", "hf")}
    lines.append(f"{'best':<7}{best['ours']:>11.0f}{best['hf']:>10.0f}{best['ours'] / best['hf']:>7.2f}"
                 f"  (fastest single step of each side)")
    return "\n".join(lines)


def model_list(text: str) -> list[str]:
    from telechat_moe.recipe import RecipeError, find_recipe
    names = [x for x in text.split(",") if x]
    for name in names:
        try:
            find_recipe(name)
        except RecipeError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    if not names:
        raise argparse.ArgumentTypeError("no model named")
    return names


def at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text}: must be at least {low}")
        return value
    return parse


def main() -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=model_list, default="tiny,small", help="recipes, comma-separated")
    ap.add_argument("--rounds", type=at_least(1), default=3)
    ap.add_argument("--steps", type=at_least(1), default=6, help="timed steps per side and round")
    ap.add_argument("--warmup", type=at_least(0), default=1, help="untimed steps after the first")
    ap.add_argument("--threads", type=at_least(1), default=2)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--child-model", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--peak", type=float, default=1.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(CHILDREN[args.child](args)), flush=True)
        return 0
    progress(f"fp32 GEMM {GEMM_N}^3 at {args.threads} threads (numpy, MindSpore MatMul)")
    gemm = run_child("gemm", args)
    peak = 1e9 * max(gemm["numpy_gflops"], gemm["mindspore_gflops"])
    progress(f"GEMM: numpy {gemm['numpy_gflops']:.1f}, MindSpore {gemm['mindspore_gflops']:.1f} GFLOP/s")
    results = [compare(m, args, peak) for m in args.models]
    print(f"\nfp32 GEMM {GEMM_N}^3, {args.threads} threads: numpy {gemm['numpy_gflops']:.1f} GFLOP/s, MindSpore MatMul "
          f"{gemm['mindspore_gflops']:.1f} GFLOP/s (the higher is the GEMM peak); median of {args.steps} steps "
          f"after {1 + args.warmup}; load {os.getloadavg()[0]:.2f}")
    for r in results:
        print("\n" + table(r))
    if args.json:
        Path(args.json).write_text(json.dumps({"gemm": gemm, "threads": args.threads, "steps": args.steps,
                                               "warmup": args.warmup, "models": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
