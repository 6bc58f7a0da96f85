"""Operator-level accuracy check: each core operator in MindSpore against its float64 NumPy reference.

Each registry entry is an OpCase: the MindSpore function, the reference, an input generator and the operator's
accumulation counts K (a chain: one K per accumulating step). Inputs are drawn in float64, rounded to the
compute dtype, and the reference runs on exactly those rounded values, so the error measured is the
operator's own. The tolerance is `chain_tolerance(dtype, ks)` (precision/TOLERANCES.md).

    python -m precision.op_check                       # all operators, fp32, fp16 and bf16, a table
    python -m precision.op_check --dtype fp16 --ops router,rope --mode graph

Exit status 0 when every runnable row passes, 1 when one fails, 2 on bad arguments. bfloat16 rows that the
backend cannot execute (no bf16 CPU kernels) are reported as not runnable with the backend's reason.
The model swaps in its own Cells with `register(dataclasses.replace(REGISTRY[name], mindspore_fn=...))`.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from oneline import OneLineParser
from precision import reference_ops as ref
from precision.tolerance import chain_tolerance, dtype_name, mean_relative_error, relative_error, round_to

Inputs = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class OpCase:
    """One operator to check. `make_inputs(rng, shape)` returns named float64/integer arrays, passed in order
    to both functions; `ks(shape)` gives the accumulation counts; inputs named in `float32_inputs` stay
    float32 whatever the compute dtype (tables, router weights, optimizer state), as they do in the model.
    `computes_in` names the format an operator computes and returns in whatever its input dtype (the router,
    the loss and the optimizer stay float32): its tolerance is that format's, so a silent half-precision
    path is caught."""
    name: str
    mindspore_fn: Callable
    reference_fn: Callable
    make_inputs: Callable[[np.random.Generator, Mapping[str, int]], Inputs]
    ks: Callable[[Mapping[str, int]], tuple[int, ...]]
    shapes: tuple[Mapping[str, int], ...]
    float32_inputs: tuple[str, ...] = ()
    accumulate: str | None = None
    computes_in: str | None = None


@dataclass(frozen=True)
class OpResult:
    op: str
    dtype: str
    shape: str
    ks: tuple[int, ...]
    max_rel_error: float
    mean_rel_error: float
    rtol: float
    status: str  # "pass", "FAIL", "error" or "not runnable"
    note: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status in ("FAIL", "error")


REGISTRY: dict[str, OpCase] = {}


def register(case: OpCase) -> OpCase:
    """Add or replace an operator (the model registers its real functions under the same names)."""
    REGISTRY[case.name] = case
    return case


# ---- default entries ----------------------------------------------------------------------------------
def _normal(rng, *shape, std=1.0):
    return rng.standard_normal(shape) * std


def _matmul_inputs(rng, s):
    return {"x": _normal(rng, s["m"], s["k"]), "w": _normal(rng, s["k"], s["n"], std=s["k"] ** -0.5)}


def _rms_norm_inputs(rng, s):
    return {"x": _normal(rng, s["t"], s["h"], std=3.0), "weight": 1.0 + _normal(rng, s["h"], std=0.1)}


def _softmax_inputs(rng, s):
    return {"x": _normal(rng, s["t"], s["n"], std=3.0)}


ROPE_CONFIG = {"base": 10000.0, "factor": 40.0, "original_max_position": 4096, "beta_fast": 32.0,
               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _rope_inputs(rng, s):
    positions = s["offset"] + np.arange(s["s"])
    inv_freq = ref.yarn_inv_freq(s["d"], ROPE_CONFIG["base"], ROPE_CONFIG["factor"],
                                 ROPE_CONFIG["original_max_position"], ROPE_CONFIG["beta_fast"],
                                 ROPE_CONFIG["beta_slow"])
    mscale = (ref.yarn_mscale(ROPE_CONFIG["factor"], ROPE_CONFIG["mscale"])
              / ref.yarn_mscale(ROPE_CONFIG["factor"], ROPE_CONFIG["mscale_all_dim"]))
    cos, sin = ref.rope_tables(positions, inv_freq, mscale)
    return {"x": _normal(rng, s["b"], s["s"], s["h"], s["d"]), "cos": cos, "sin": sin}


def _attention_inputs(rng, s):
    b, t, h = s["b"], s["s"], s["h"]
    return {"q_nope": _normal(rng, b, t, h, s["dn"]), "q_pe": _normal(rng, b, t, h, s["dr"]),
            "k_nope": _normal(rng, b, t, h, s["dn"]), "k_pe": _normal(rng, b, t, s["dr"]),
            "v": _normal(rng, b, t, h, s["dv"])}


ATTENTION_MSCALE = ref.yarn_mscale(ROPE_CONFIG["factor"], ROPE_CONFIG["mscale_all_dim"])
ROUTER_TOP_K, ROUTED_SCALING = 4, 2.8


def _router_inputs(rng, s):
    return {"x": _normal(rng, s["t"], s["h"]), "weight": _normal(rng, s["e"], s["h"], std=s["h"] ** -0.5),
            "bias": _normal(rng, s["e"], std=0.05)}


def _dispatch_inputs(rng, s):
    indices = np.stack([rng.choice(s["e"], s["k"], replace=False) for _ in range(s["t"])]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (s["t"], s["k"]))
    return {"x": _normal(rng, s["t"], s["h"]), "indices": indices,
            "weights": weights / weights.sum(-1, keepdims=True) * ROUTED_SCALING,
            "expert_scale": 1.0 + _normal(rng, s["e"], s["h"], std=0.5)}


def _swiglu_inputs(rng, s):
    h, f = s["h"], s["f"]
    return {"x": _normal(rng, s["t"], h), "w_gate": _normal(rng, h, f, std=h ** -0.5),
            "w_up": _normal(rng, h, f, std=h ** -0.5), "w_down": _normal(rng, f, h, std=f ** -0.5)}


def _cross_entropy_inputs(rng, s):
    return {"logits": _normal(rng, s["t"], s["v"], std=2.0),
            "labels": rng.integers(0, s["v"], s["t"]).astype(np.int32)}


ADAMW_CONFIG = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "step": 3}
ADAMW_ROUNDINGS = 8  # elementwise roundings on the path to the new parameter


def _adamw_inputs(rng, s):
    n = s["n"]
    return {"param": _normal(rng, n, std=0.02), "grad": _normal(rng, n, std=1e-2),
            "exp_avg": _normal(rng, n, std=1e-2), "exp_avg_sq": np.abs(_normal(rng, n, std=1e-4))}


def _register_defaults() -> None:
    from precision import ms_ops

    def adamw_reference(param, grad, exp_avg, exp_avg_sq):
        return ref.adamw(param, grad, exp_avg, exp_avg_sq, **ADAMW_CONFIG)

    def attention_reference(q_nope, q_pe, k_nope, k_pe, v):
        scale = (q_nope.shape[-1] + q_pe.shape[-1]) ** -0.5 * ATTENTION_MSCALE ** 2
        return ref.mla_attention(q_nope, q_pe, k_nope, k_pe, v, scale)

    def router_reference(x, weight, bias):
        return ref.router(x, weight, bias, ROUTER_TOP_K, ROUTED_SCALING)

    for case in (
        OpCase("matmul", ms_ops.matmul, ref.matmul, _matmul_inputs, lambda s: (s["k"],),
               ({"m": 16, "k": 64, "n": 32}, {"m": 33, "k": 512, "n": 47}, {"m": 8, "k": 4096, "n": 24})),
        OpCase("rmsnorm", ms_ops.make_rms_norm(), ref.rms_norm, _rms_norm_inputs, lambda s: (s["h"], 1),
               ({"t": 16, "h": 64}, {"t": 7, "h": 1536}, {"t": 4, "h": 7168})),
        OpCase("rope_yarn", ms_ops.apply_rope, ref.apply_rope, _rope_inputs, lambda s: (2,),
               ({"b": 2, "s": 16, "h": 4, "d": 64, "offset": 0}, {"b": 1, "s": 128, "h": 3, "d": 64, "offset": 0},
                {"b": 1, "s": 64, "h": 2, "d": 32, "offset": 8000}),
               float32_inputs=("cos", "sin")),
        OpCase("mla_attention", ms_ops.make_mla_attention(ATTENTION_MSCALE), attention_reference, _attention_inputs,
               lambda s: (s["dn"] + s["dr"], s["s"], s["s"]),
               ({"b": 2, "s": 16, "h": 4, "dn": 32, "dr": 16, "dv": 32},
                {"b": 1, "s": 128, "h": 2, "dn": 128, "dr": 64, "dv": 128})),
        OpCase("softmax", ms_ops.softmax, ref.softmax, _softmax_inputs, lambda s: (s["n"],),
               ({"t": 16, "n": 64}, {"t": 5, "n": 1000}, {"t": 2, "n": 32768})),
        OpCase("router", ms_ops.make_router(ROUTER_TOP_K, ROUTED_SCALING), router_reference, _router_inputs,
               lambda s: (s["h"], ROUTER_TOP_K), ({"t": 32, "h": 64, "e": 16}, {"t": 64, "h": 512, "e": 192}),
               float32_inputs=("weight", "bias"), computes_in="float32"),
        OpCase("dispatch_combine", ms_ops.dispatch_combine, ref.dispatch_combine, _dispatch_inputs,
               lambda s: (s["k"],), ({"t": 32, "h": 16, "e": 8, "k": 2}, {"t": 100, "h": 64, "e": 192, "k": 8}),
               float32_inputs=("weights",)),
        OpCase("swiglu_ffn", ms_ops.swiglu_ffn, ref.swiglu_ffn, _swiglu_inputs, lambda s: (s["h"], 1, s["f"]),
               ({"t": 16, "h": 64, "f": 96}, {"t": 8, "h": 512, "f": 1536})),
        OpCase("cross_entropy", ms_ops.cross_entropy, ref.cross_entropy, _cross_entropy_inputs,
               lambda s: (s["v"], s["t"]), ({"t": 16, "v": 100}, {"t": 64, "v": 32000}), computes_in="float32"),
        OpCase("adamw", ms_ops.make_adamw(**ADAMW_CONFIG), adamw_reference, _adamw_inputs,
               lambda s: (1,) * ADAMW_ROUNDINGS, ({"n": 1000}, {"n": 65536}),
               float32_inputs=("param", "exp_avg", "exp_avg_sq"), computes_in="float32"),
    ):
        register(case)


# ---- running ------------------------------------------------------------------------------------------
def _ms_dtype(name: str):
    import mindspore as ms
    return {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}[name]


def _to_tensor(value: np.ndarray, dtype: str):
    import mindspore as ms
    if not np.issubdtype(value.dtype, np.floating):
        return ms.Tensor(value.astype(np.int32))
    return ms.Tensor(value.astype(np.float32)).astype(_ms_dtype(dtype))


def _to_numpy(value) -> np.ndarray:
    import mindspore as ms
    if value.dtype == ms.bfloat16:
        value = value.astype(ms.float32)
    return value.asnumpy().astype(np.float64)


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _one_line(error: BaseException) -> str:
    # MindSpore's messages open with banner lines ("----", "- Kernel select failed:"); keep the first real one.
    lines = [line.strip() for line in str(error).splitlines()
             if any(ch.isalpha() for ch in line) and not line.strip().startswith("-")]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:160]


_GRAPH_FUNCTIONS: dict[Callable, Callable] = {}


def _drain_pending_errors() -> None:
    """PyNative launches kernels asynchronously: a failed launch can raise again at the next sync point, which
    would be charged to the next operator's row. Synchronise here so the failure stays in its own row."""
    import mindspore as ms
    try:
        ms.runtime.synchronize()
    except (RuntimeError, TypeError, ValueError):
        pass


def _graph_function(fn: Callable) -> Callable:
    """One ms.jit wrapper per function, so that a second dtype or shape recompiles the same object."""
    import mindspore as ms
    if fn not in _GRAPH_FUNCTIONS:
        _GRAPH_FUNCTIONS[fn] = ms.jit(fn)
    return _GRAPH_FUNCTIONS[fn]


def check_case(case: OpCase, dtype="float32", mode: str = "pynative", seed: int = 0) -> list[OpResult]:
    """Run `case` on each of its shapes in `dtype`; one OpResult per shape."""
    dtype = dtype_name(dtype)
    fn = _graph_function(case.mindspore_fn) if mode == "graph" else case.mindspore_fn
    results = []
    for index, shape in enumerate(case.shapes):
        rng = np.random.default_rng([seed, index])
        raw = case.make_inputs(rng, shape)
        rounded = {}
        for name, value in raw.items():
            if np.issubdtype(value.dtype, np.floating):
                rounded[name] = round_to(value, "float32" if name in case.float32_inputs else dtype)
            else:
                rounded[name] = value
        ks = tuple(case.ks(shape))
        rtol = chain_tolerance(case.computes_in or dtype, ks, case.accumulate).rtol
        label = " ".join(f"{k}={v}" for k, v in shape.items())
        start = time.perf_counter()
        try:
            tensors = [_to_tensor(v, "float32" if n in case.float32_inputs else dtype) for n, v in rounded.items()]
            actual = [_to_numpy(out) for out in _as_tuple(fn(*tensors))]
        except (RuntimeError, TypeError, ValueError) as error:
            _drain_pending_errors()
            status = "not runnable" if dtype == "bfloat16" else "error"
            results.append(OpResult(case.name, dtype, label, ks, float("nan"), float("nan"), rtol, status,
                                    _one_line(error), time.perf_counter() - start))
            continue
        seconds = time.perf_counter() - start
        expected = _as_tuple(case.reference_fn(*rounded.values()))
        if len(actual) != len(expected) or any(a.shape != np.shape(e) for a, e in zip(actual, expected)):
            results.append(OpResult(case.name, dtype, label, ks, float("nan"), float("nan"), rtol, "error",
                                    f"output shapes {[a.shape for a in actual]} != reference "
                                    f"{[np.shape(e) for e in expected]}", seconds))
            continue
        max_err = max(relative_error(a, e) for a, e in zip(actual, expected))
        mean_err = max(mean_relative_error(a, e) for a, e in zip(actual, expected))
        status = "pass" if max_err <= rtol else "FAIL"
        results.append(OpResult(case.name, dtype, label, ks, max_err, mean_err, rtol, status, "", seconds))
    return results


def check_all(names: Sequence[str], dtypes: Sequence[str], mode: str = "pynative", seed: int = 0,
              progress: Callable[[OpResult], None] | None = None) -> list[OpResult]:
    results = []
    for name in names:
        for dtype in dtypes:
            for result in check_case(REGISTRY[name], dtype, mode, seed):
                results.append(result)
                if progress:
                    progress(result)
    return results


HEADER = (f"{'operator':<17} {'dtype':<9} {'shape':<36} {'K chain':<16} {'max rel':>9} {'mean rel':>9} "
          f"{'rtol':>9} {'max/rtol':>8}  status")


def format_row(r: OpResult) -> str:
    ks = ",".join(str(k) for k in r.ks)
    if r.status in ("error", "not runnable"):
        return f"{r.op:<17} {r.dtype:<9} {r.shape:<36} {ks:<16} {'-':>9} {'-':>9} {r.rtol:9.2e} {'-':>8}  " \
               f"{r.status}: {r.note}"
    return (f"{r.op:<17} {r.dtype:<9} {r.shape:<36} {ks:<16} {r.max_rel_error:9.2e} {r.mean_rel_error:9.2e} "
            f"{r.rtol:9.2e} {r.max_rel_error / r.rtol:8.3f}  {r.status}")


def _usage_error(message: str) -> int:
    print(f"precision.op_check: {message}", file=sys.stderr)
    return 2


_register_defaults()


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m precision.op_check", description=__doc__.split("\n")[0])
    parser.add_argument("--ops", default="all", help=f"comma-separated, from: {','.join(REGISTRY)}")
    parser.add_argument("--dtype", nargs="+", default=["fp32", "fp16", "bf16"])
    parser.add_argument("--mode", choices=("pynative", "graph"), default="pynative")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    names = list(REGISTRY) if args.ops == "all" else [n.strip() for n in args.ops.split(",") if n.strip()]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown or not names:
        return _usage_error(f"--ops: unknown operator {unknown[0] if unknown else '(none)'!r}; expected names from "
                            f"{','.join(REGISTRY)}")
    try:
        dtypes = [dtype_name(d) for d in args.dtype]
    except ValueError:
        return _usage_error(f"--dtype: expected fp32, fp16 or bf16, got {' '.join(args.dtype)!r}")
    if "float64" in dtypes:
        return _usage_error("--dtype: float64 is the reference, not a dtype to check")

    import mindspore as ms
    ms.set_context(mode=ms.PYNATIVE_MODE)  # graph mode goes through ms.jit per operator
    print(HEADER, flush=True)
    results = check_all(names, dtypes, args.mode, args.seed, progress=lambda r: print(format_row(r), flush=True))
    failed = [r for r in results if r.failed]
    skipped = [r for r in results if r.status == "not runnable"]
    print(f"{len(results) - len(failed) - len(skipped)} passed, {len(failed)} failed, "
          f"{len(skipped)} not runnable on this backend ({ms.get_context('device_target')}, {args.mode} mode)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
