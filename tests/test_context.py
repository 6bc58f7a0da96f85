"""The launch side on Ascend: the recipe's context -> MindSpore's calls (each checked against the installed MindSpore's
signatures and set_context's accepted keys; no NPU here, so the Ascend path is recorded, not run), the CPU path run
for real, bad context values as one line, and scripts/msrun_launch.sh's msrun command line for a multi-node run."""
from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest

from telechat_moe.context import HCCL_ENV, gb_text, hccl_environment, memory_settings
from telechat_moe.recipe import load_recipe
from tests.helpers import ROOT, assert_one_line_error, run_cli, run_main

# 105b on 4 nodes of 8 (the README's launch) in MindFormers' split of it (dp=4, tp=8, ep=4, 32 micro-batches, one
# token slice): pipeline_stage=1 (pipelines do not train yet), the routed experts spread whole over the 32 devices
# (expert_parallel 4 x model_parallel 8), so that the static memory fits 55.5 GiB.
MINDFORMERS_105B = ["parallel_config.data_parallel=4", "parallel_config.model_parallel=8",
                    "parallel_config.pp_interleave_num=1", "parallel_config.expert_parallel=4",
                    "parallel_config.micro_batch_num=32", "model.moe_comm_chunks=1"]
# 105b on 8 nodes of 8: what it holds per device (35.4 GiB before activations) fits the 55.5 GB; on 4 nodes no split of
# its 104.6B parameters does (float32 weights, gradients and accumulators, the sharded optimizer: 60-79 GiB)
EIGHT_NODES = ["parallel_config.data_parallel=4", "parallel_config.model_parallel=4", "parallel_config.pipeline_stage=4",
               "parallel_config.pp_interleave_num=1", "parallel_config.expert_parallel=16",
               "parallel_config.micro_batch_num=32", "model.moe_comm_chunks=1"]
# Every Ascend-only and once-per-process setting away from its default.
ASCEND_CONTEXT = ["context.deterministic=ON", "context.memory_optimize_level=O1", "context.mempool_block_size_gb=55.5",
                  "context.hccl_connect_timeout=600", "context.hccl_exec_timeout=1800", "context.hccl_buffsize=256"]

# Run in a fresh interpreter: replaces every MindSpore function configure_mindspore calls with a recorder that binds
# the call to the real function's signature, checks set_context's keys against those MindSpore 2.9's set_context
# accepts and every argument against the types its args_type_check declares, then calls the real function where it
# can run without an NPU (all but set_device("Ascend")), so MindSpore's own validators see the values too.
RECORD = r'''
import inspect, json, os, sys
import mindspore as ms
import mindspore.context as msctx
import mindspore.log as mslog
from telechat_moe import context as tc
from telechat_moe.recipe import load_recipe

calls, problems, warnings = [], [], []

def declared_types(func):
    """The types mindspore's args_type_check declares for func's arguments ({} if it declares none)."""
    try:
        bound = inspect.getclosurevars(func).nonlocals.get("bound_types", {})
    except TypeError:
        return {}
    return bound.get("kwargs", bound)

def set_context_keys():
    """Every key mindspore.set_context accepts: its setters, its _Context attributes, public ms_ctx_param members."""
    ctx = msctx._context()
    return (set(msctx._Context.setters) | {k for k in msctx.ms_ctx_param.__members__ if not k.startswith("_")}
            | {k for k in dir(ctx) if not k.startswith("_") and not callable(getattr(ctx, k))})

def recorder(name, real, run_real):
    sig, types, keys = inspect.signature(real), declared_types(real), set_context_keys()
    def call(*args, **kwargs):
        try:
            bound = sig.bind(*args, **kwargs).arguments
        except TypeError as e:
            problems.append(f"{name}: {e}")
            bound = {}
        bound = {**{k: v for k, v in bound.items() if k != "kwargs"}, **bound.get("kwargs", {})}
        for key, value in bound.items():
            if name == "set_context" and key not in keys:
                problems.append(f"set_context: MindSpore does not accept the key {key!r}")
            if key in types and value is not None and not isinstance(value, types[key]):
                problems.append(f"{name}: {key}={value!r} is not {types[key]}")
        calls.append([name, bound])
        if run_real(bound):
            return real(*args, **kwargs)
    return call

real_warning = mslog.warning
def warning(msg, *args, **kwargs):
    warnings.append(str(msg) % args if args else str(msg))
    real_warning(msg, *args, **kwargs)
mslog.warning = warning

real_set_context = ms.set_context
ms.set_context = recorder("set_context", ms.set_context, lambda b: True)
ms.get_context = recorder("get_context", ms.get_context, lambda b: True)
ms.set_device = recorder("set_device", ms.set_device, lambda b: b.get("device_target") != "Ascend")
ms.runtime.set_memory = recorder("runtime.set_memory", ms.runtime.set_memory, lambda b: True)
ms.set_deterministic = recorder("set_deterministic", ms.set_deterministic, lambda b: True)
recipe = load_recipe(sys.argv[1], json.loads(sys.argv[2]))
for k in list(os.environ):
    if k.startswith(("HCCL_", "TE_PARALLEL")):
        del os.environ[k]
tc.configure_mindspore(recipe)
env = {k: v for k, v in os.environ.items() if k.startswith(("HCCL_", "TE_PARALLEL"))}
# the checks themselves: a key set_context does not know and a value of the wrong type are caught
ours = len(problems)
recorder("set_context", real_set_context, lambda b: False)(no_such_key=1, mode="graph")
self_check = problems[ours:]
del problems[ours:], calls[-1]
print("RESULT " + json.dumps({"calls": calls, "problems": problems, "env": env, "self_check": self_check,
                              "deprecated": [w for w in warnings if "deprecated" in w]}))
'''


def record(recipe: str, sets: list[str]) -> dict:
    proc = run_cli("-c", RECORD, recipe, json.dumps(sets), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_ascend_recipe_becomes_these_mindspore_calls():
    """105b's context (device Ascend, jit_level O1, 55.5 GB) with every Ascend setting on: the calls, their arguments
    and the HCCL environment, each call bound to the installed MindSpore's signature and accepted by its checks."""
    out = record("105b", EIGHT_NODES + ASCEND_CONTEXT)
    assert out["problems"] == []
    assert len(out["self_check"]) == 2 and "no_such_key" in out["self_check"][0] and "mode" in out["self_check"][1]
    made = [(name, args) for name, args in out["calls"] if name != "get_context"]
    assert made == [
        ("set_context", {"mode": 0, "jit_config": {"jit_level": "O1"}}),
        ("set_device", {"device_target": "Ascend"}),
        ("runtime.set_memory", {"max_size": "55.5GB", "increase_size": "55.5GB", "optimize_level": "O1"}),
        ("set_deterministic", {"deterministic": True}),
    ]
    assert ["get_context", {"attr_key": "device_target"}] in out["calls"]
    # the recipe's HCCL settings, and what MindSpore's set_deterministic sets beside them
    assert out["env"] == {"HCCL_CONNECT_TIMEOUT": "600", "HCCL_EXEC_TIMEOUT": "1800", "HCCL_BUFFSIZE": "256",
                          "HCCL_DETERMINISTIC": "true", "TE_PARALLEL_COMPILER": "1"}
    # only MindSpore 2.9's current APIs: none of the calls is one its set_context deprecates
    assert out["deprecated"] == []


def test_ascend_defaults_make_only_the_device_calls():
    """105b as written: no deterministic, memory level O0, no HCCL settings: the cap on the memory pool and the
    device, nothing else, no HCCL variable set."""
    out = record("105b", EIGHT_NODES)
    assert out["problems"] == [] and out["deprecated"] == []
    made = [(name, args) for name, args in out["calls"] if name != "get_context"]
    assert made == [("set_context", {"mode": 0, "jit_config": {"jit_level": "O1"}}),
                    ("set_device", {"device_target": "Ascend"}),
                    ("runtime.set_memory", {"max_size": "55.5GB"})]
    assert out["env"] == {}


def test_graph_kernel_switch_is_a_key_set_context_accepts():
    """enable_graph_kernel (the CPU's fusion switch: jit_level O1 alone fuses nothing there) is a key MindSpore 2.9
    accepts and deprecates in favour of jit_level O1, which is what Ascend recipes use."""
    out = record("tiny", ["context.enable_graph_kernel=true"])
    assert out["problems"] == []
    assert ["set_context", {"enable_graph_kernel": True}] in out["calls"]
    assert len(out["deprecated"]) == 1 and "enable_graph_kernel" in out["deprecated"][0]


def test_every_mindspore_call_of_configure_mindspore_is_recorded():
    """The recorder replaces exactly the MindSpore functions telechat_moe/context.py calls (read from its source),
    so no call on the Ascend path escapes the signature checks above."""
    tree = ast.parse((ROOT / "telechat_moe" / "context.py").read_text())
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "ms":
                used.add(".".join(reversed(chain)))
    used -= {c.rsplit(".", 1)[0] for c in used if "." in c}      # ms.runtime of ms.runtime.set_memory
    assert used == {"set_context", "get_context", "set_device", "runtime.set_memory", "set_deterministic"}


def test_the_mapping_without_mindspore():
    a = load_recipe("105b", EIGHT_NODES + ASCEND_CONTEXT).context
    assert hccl_environment(a) == {"HCCL_CONNECT_TIMEOUT": "600", "HCCL_EXEC_TIMEOUT": "1800", "HCCL_BUFFSIZE": "256"}
    assert set(HCCL_ENV.values()) == set(hccl_environment(a))
    cpu = load_recipe("tiny", ["context.hccl_connect_timeout=600", "context.max_device_memory_gb=3",
                               "context.mempool_block_size_gb=1"]).context
    assert hccl_environment(cpu) == {} and memory_settings(cpu) == {}     # Ascend-only: not applied on CPU
    assert memory_settings(load_recipe("tiny", ["context.memory_optimize_level=O1"]).context) == \
        {"optimize_level": "O1"}
    assert [gb_text(x) for x in (55.5, 64, 0.5, 1e-6)] == ["55.5GB", "64GB", "0.5GB", "0.000001GB"]


# The CPU path for real, in a fresh interpreter (set_memory and set_deterministic are once per process): configure,
# run a compiled step, configure again with the same recipe, then try to change a once-per-process setting.
CPU_REAL = r'''
import json, os, sys
import numpy as np
import mindspore as ms
from mindspore import ops
from telechat_moe.context import configure_mindspore
from telechat_moe.recipe import load_recipe
for k in list(os.environ):
    if k.startswith("HCCL_"):
        del os.environ[k]
sets = ["context.deterministic=ON", "context.memory_optimize_level=O1", "context.hccl_connect_timeout=600",
        "context.max_device_memory_gb=1.5", "context.jit_level=O1"]
r = load_recipe("tiny", sets)
configure_mindspore(r)
@ms.jit
def step(x):
    return ops.matmul(x, x).sum()
value = float(step(ms.Tensor(np.ones((4, 4), np.float32))).asnumpy())
configure_mindspore(r)
jit_level = ms.get_context("jit_config").get("jit_level")
try:
    configure_mindspore(load_recipe("tiny", sets[:1]))
    refused = ""
except RuntimeError as e:
    refused = str(e)
print("RESULT " + json.dumps({"value": value, "device": ms.get_context("device_target"),
                              "jit_level": jit_level, "unchanged": ms.get_context("jit_config").get("jit_level"),
                              "hccl": {k: v for k, v in os.environ.items() if k.startswith("HCCL_")},
                              "refused": refused}))
'''


def test_cpu_path_runs_for_real(tmp_path):
    script = tmp_path / "cpu_context.py"          # graph mode compiles a function from its source file
    script.write_text(CPU_REAL)
    proc = run_cli(str(script), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    assert out["value"] == 64.0 and out["device"] == "CPU" and out["jit_level"] == "O1"
    # a change MindSpore would refuse is refused before anything of the new recipe is applied
    assert out["unchanged"] == "O1"
    # deterministic ON sets HCCL_DETERMINISTIC (MindSpore's doing); the recipe's HCCL timeout is not set on CPU
    assert out["hccl"] == {"HCCL_DETERMINISTIC": "true"}
    assert "mindspore.runtime.set_memory" in out["refused"] and "once per process" in out["refused"]


# ---- bad context values: one line naming the field, exit 2 --------------------------------------------------------
BAD_CONTEXT = [
    ("context.jit_level=O3", "context.jit_level", "O0, O1 or O2"),
    ("context.deterministic=maybe", "context.deterministic", "ON or OFF"),
    ("context.deterministic=1", "context.deterministic", "ON or OFF"),
    ("context.memory_optimize_level=O2", "context.memory_optimize_level", "O0 or O1"),
    ("context.max_device_memory_gb=-1", "context.max_device_memory_gb", "size in GB"),
    ("context.max_device_memory_gb=.nan", "context.max_device_memory_gb", "size in GB"),
    ("context.mempool_block_size_gb=1e-9", "context.mempool_block_size_gb", "at least"),
    ("context.hccl_connect_timeout=60", "context.hccl_connect_timeout", "120 to 7200"),
    ("context.hccl_connect_timeout=10s", "context.hccl_connect_timeout", "integer"),
    ("context.hccl_exec_timeout=-5", "context.hccl_exec_timeout", "seconds"),
    ("context.hccl_buffsize=-1", "context.hccl_buffsize", "MB"),
    ("context.peak_tflops=-3", "context.peak_tflops", "finite"),
    ("context.max_device_memory=55.5GB", "context.max_device_memory", "did you mean context.max_device_memory_gb"),
    ("context.jit_config=O1", "context.jit_config", "did you mean context.jit_level"),
    ("context.device_target=GPU", "context.device_target", "CPU or Ascend"),
]


@pytest.mark.parametrize("assignment,field,hint", BAD_CONTEXT, ids=[b[0] for b in BAD_CONTEXT])
def test_bad_context_value_is_one_line(assignment, field, hint, capfd):
    assert_one_line_error(run_main(capfd, "--recipe", "tiny", "--dry-run", "--set", assignment), field, hint)


def test_bad_context_value_is_one_line_in_a_fresh_process():
    assert_one_line_error(run_cli("run_train.py", "--recipe", "105b", "--dry-run", "--set", "context.jit_level=O9"),
                          "context.jit_level", "O0, O1 or O2")


@pytest.mark.parametrize("value,expected", [("ON", "ON"), ("on", "ON"), ("'OFF'", "OFF"), ("true", "ON"),
                                            ("false", "OFF")])
def test_deterministic_takes_yaml_booleans_and_both_spellings(value, expected):
    assert load_recipe("tiny", [f"context.deterministic={value}"]).context.deterministic == expected


# ---- scripts/msrun_launch.sh with a fake msrun that prints what it was given ---------------------------------------
FAKE_MSRUN = """#!/bin/sh
for a in "$@"; do echo "ARG $a"; done
env | grep '^HCCL_' | sed 's/^/ENV /'
"""


def launch(tmp_path: Path, env: dict, *args: str):
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "msrun").write_text(FAKE_MSRUN)
    (fake / "msrun").chmod(0o755)
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("HCCL_", "NNODES", "NODE_RANK", "DEVICES_PER_NODE", "MASTER_", "LOG_DIR",
                                 "BIND_", "ASCEND_HOME_PATH", "CLUSTER_TIME_OUT"))}
    # this interpreter's folder next: the script's check runs `python` as msrun's workers would
    full = {**base, "PATH": f"{fake}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}", **env}
    import subprocess
    return subprocess.run(["bash", str(ROOT / "scripts" / "msrun_launch.sh"), *args], capture_output=True, text=True,
                          env=full, cwd=str(tmp_path), timeout=300)


# A node of the Ascend cluster: CANN's environment names its toolkit (what telechat_moe.launch.has_ascend reads).
ASCEND_NODE = {"ASCEND_HOME_PATH": "/usr/local/Ascend/ascend-toolkit/latest"}


def test_eight_node_105b_launch_gives_msrun_these_arguments(tmp_path):
    env = {**ASCEND_NODE, "NNODES": "8", "DEVICES_PER_NODE": "8", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "8200", "CLUSTER_TIME_OUT": "900"}
    sets = [x for s in EIGHT_NODES for x in ("--set", s)]
    proc = launch(tmp_path, env, str(ROOT / "recipes" / "105b.yaml"), *sets, "--resume")
    assert proc.returncode == 0, proc.stderr
    args = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ARG ")]
    assert args == ["--worker_num=64", "--local_worker_num=8", "--master_addr=10.0.0.1", "--master_port=8200",
                    "--node_rank=1", "--log_dir=output/msrun_logs/node_1", "--join=True", "--cluster_time_out=900",
                    "--bind_core=True", "run_train.py", "--recipe", str(ROOT / "recipes" / "105b.yaml"),
                    "--set", "parallel_config.devices_per_node=8", *sets, "--resume"]
    hccl = {line[4:].split("=", 1)[0]: line[4:].split("=", 1)[1] for line in proc.stdout.splitlines()
            if line.startswith("ENV ")}
    assert hccl == {"HCCL_CONNECT_TIMEOUT": "600", "HCCL_EXEC_TIMEOUT": "1836"}


def test_launch_options_pass_through(tmp_path):
    """A relative recipe path is resolved where the command runs; core and NUMA binding maps; HCCL values of the
    environment win over the script's defaults."""
    (tmp_path / "mine.yaml").write_text("base: " + str(ROOT / "recipes" / "tiny.yaml") + "\n")
    bind = '{"device0":["0-11"],"device1":["12-23"]}'
    proc = launch(tmp_path, {"NNODES": "1", "DEVICES_PER_NODE": "2", "BIND_CORE": bind, "BIND_NUMA": "True",
                             "LOG_DIR": "/tmp/x", "HCCL_CONNECT_TIMEOUT": "1200"},
                  "mine.yaml", "--set", "parallel_config.data_parallel=2")
    assert proc.returncode == 0, proc.stderr
    args = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ARG ")]
    assert f"--bind_core={bind}" in args and "--bind_numa=True" in args and "--log_dir=/tmp/x" in args
    assert "--master_addr=127.0.0.1" in args and "--worker_num=2" in args
    assert args[args.index("--recipe") + 1] == str(tmp_path / "mine.yaml")
    assert "ENV HCCL_CONNECT_TIMEOUT=1200" in proc.stdout


LAUNCH_ERRORS = [
    # 105b as written is MindFormers' 256-device layout
    ({"NNODES": "4", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}, [],
     ["parallel_config", "= 256 devices", "NNODES*DEVICES_PER_NODE = 4*8 = 32", "NNODES=32"]),
    # 32 devices, but the experts split only 4 ways: it does not fit the 55.5 GB of each device
    ({"NNODES": "4", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"}, [*MINDFORMERS_105B, "parallel_config.pipeline_stage=1"],
     ["315.9 GiB per device", "context.max_device_memory_gb=55.5"]),
    ({"NNODES": "8", "NODE_RANK": "1"}, EIGHT_NODES, ["MASTER_ADDR", "NNODES=8"]),
    ({"NNODES": "8", "NODE_RANK": "8", "MASTER_ADDR": "10.0.0.1"}, EIGHT_NODES, ["NODE_RANK", "0 to 7"]),
    ({"NNODES": "four"}, EIGHT_NODES, ["NNODES", "integer"]),
    ({"NNODES": "8", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "80"}, EIGHT_NODES,
     ["MASTER_PORT", "1024 to 65535"]),
    ({"NNODES": "8", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"}, [*EIGHT_NODES, "context.jit_level=O7"],
     ["context.jit_level"]),
]


def test_the_105b_recipe_as_written_launches_on_32_nodes(tmp_path):
    """MindFormers' 256-device layout (pp=8 with tp, ep and dp): the preflight passes, msrun gets its node's 8."""
    proc = launch(tmp_path, {**ASCEND_NODE, "NNODES": "32", "NODE_RANK": "3", "MASTER_ADDR": "10.0.0.1"}, "105b")
    assert proc.returncode == 0, proc.stderr
    args = proc.stdout.split()
    assert "--worker_num=256" in args and "--local_worker_num=8" in args and "--node_rank=3" in args, proc.stdout


@pytest.mark.parametrize("env,sets,needles", LAUNCH_ERRORS, ids=[" ".join(e[2][:1]) + str(i)
                                                                 for i, e in enumerate(LAUNCH_ERRORS)])
def test_launch_that_cannot_train_stops_with_one_line_before_msrun(tmp_path, env, sets, needles):
    proc = launch(tmp_path, {**ASCEND_NODE, **env}, "105b", *[x for s in sets for x in ("--set", s)])
    assert_one_line_error(proc, *needles)
    assert "ARG" not in proc.stdout                        # msrun never started


def test_launch_on_a_machine_without_npu_stops_with_one_line(tmp_path):
    proc = launch(tmp_path, {"NNODES": "8", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"}, "105b",
                  *[x for s in EIGHT_NODES for x in ("--set", s)])
    assert_one_line_error(proc, "targets Ascend", "no Ascend device")
    assert "ARG" not in proc.stdout


def test_run_train_sets_the_blas_environment_before_numpy_loads():
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT when it loads (dvm_fusion.BLAS_ENVIRONMENT): run_train.py must set it
    before anything imports NumPy, and keep a value the user gave."""
    import subprocess
    from dvm_fusion import BLAS_ENVIRONMENT
    probe = ("import os, sys, run_train\n"
             "loaded = 'numpy' in sys.modules\n"
             "run_train.main(['--recipe', 'tiny', '--dry-run'])\n"
             "print(loaded, os.environ['OPENBLAS_THREAD_TIMEOUT'])\n")
    env = {k: v for k, v in os.environ.items() if k not in BLAS_ENVIRONMENT}
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["False", BLAS_ENVIRONMENT["OPENBLAS_THREAD_TIMEOUT"]]
    given = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                           env=dict(env, OPENBLAS_THREAD_TIMEOUT="20"))
    assert given.returncode == 0, given.stderr[-2000:]
    assert given.stdout.split()[-2:] == ["False", "20"]
