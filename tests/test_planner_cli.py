"""`python -m telechat_moe.plan`: a search that writes a loadable recipe and a picture, one-layout evaluation, and
one-line errors with exit code 2 for bad input."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from telechat_moe.plan import main
from telechat_moe.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, "-m", "telechat_moe.plan", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_search_writes_a_recipe_the_trainer_loads(tmp_path, capsys):
    out, png = tmp_path / "105b_64.yaml", tmp_path / "plan.png"
    assert main(["--recipe", "105b", "--devices", "64", "--global-batch", "128", "--top", "3",
                 "--write", str(out), "--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert "layouts/minute" in text and "best:" in text and "event-driven simulator" in text
    assert out.read_text().startswith("# Written by: python -m telechat_moe.plan --recipe 105b --devices 64 ")
    recipe = load_recipe(str(out))
    assert recipe.layout.world_size == 64
    assert recipe.training.global_batch_size == 128
    assert recipe.model.hidden_size == 2560  # inherited through base:
    assert png.stat().st_size > 10_000


def test_evaluate_one_layout(capsys):
    assert main(["--recipe", "105b", "--devices", "256", "--evaluate",
                 "tp=8,pp=8,vpp=2,ep=4,mbs=1,recompute=full,ep_overlap=1"]) == 0
    text = capsys.readouterr().out
    assert "even split, analytic" in text and "even split, simulated" in text and "ILP-balanced" in text


def test_evaluate_a_published_layout_with_dense_layers_past_the_first_chunk(tmp_path, capsys):
    """DeepSeek-V3's depth (61 layers, 3 dense) at pp=16 x vpp=2: stage 0's even share (4 layers, 2 per chunk)
    cannot hold the 3 dense layers in its first chunk; the even split puts the third in stage 1, and the ILP's
    free chunking scores at least as well."""
    recipe = tmp_path / "61_layers.yaml"
    recipe.write_text(f"base: {ROOT / 'recipes' / '1t.yaml'}\nmodel:\n  first_k_dense_replace: 3\n"
                      "  num_hidden_layers: 61\n")
    assert main(["--recipe", str(recipe), "--devices", "4096", "--evaluate", "tp=8,pp=16,vpp=2,ep=32,mbs=1"]) == 0
    text = capsys.readouterr().out
    even = float(re.search(r"even split, simulated  : step ([\d.]+) s", text).group(1))
    ilp = float(re.search(r"ILP-balanced, simulated: step ([\d.]+) s", text).group(1))
    assert ilp <= even * (1 + 1e-9), text


def test_the_same_search_gives_the_same_plan_on_a_busy_machine():
    """The solver's budgets are nodes, not seconds: a search beside two processes that keep both cores busy prints
    the plan of one on a quiet machine (only the lines saying how long it took differ)."""
    def plan() -> list[str]:
        # 105b on 256 devices: balancing 1t's deep interleaved layouts takes 1.5-2.5 minutes a search here
        r = run("--recipe", "105b", "--devices", "256", "--top", "5")
        assert r.returncode == 0, r.stderr
        return [line for line in r.stdout.splitlines() if not re.search(r" in [\d.]+ s", line)]

    quiet = plan()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        busy = plan()
    finally:
        for b in burners:
            b.kill()
    assert busy == quiet
    ranks = [int(line.split()[0]) for line in quiet if re.match(r"\s+\d+\s+\d+\s", line)]
    assert ranks == [1, 2, 3, 4, 5], "the top list comes back full"


def test_a_named_dense_model_is_searched_under_the_recipes_training_settings(capsys):
    """--model swaps the recipe's model for a named planner shape (TeleChat3-36B, dense GQA): the search scores only
    ep=1 layouts and lists a full top."""
    assert main(["--recipe", "1t", "--model", "telechat3-36b", "--devices", "2048", "--seq", "8192",
                 "--global-batch", "1024", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("model telechat3-36b: 64 layers, dense; 2048 x ascend910b")
    rows = [line.split() for line in text.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    assert all(r[5] == "1" for r in rows), "ep=1 on a dense model"


def test_a_named_dense_model_scores_its_published_layout(capsys):
    assert main(["--recipe", "1t", "--model", "telechat3-36b", "--devices", "2048",
                 "--evaluate", "tp=8,pp=2,dp=128"]) == 0
    text = capsys.readouterr().out
    assert "layout tp=8,pp=2,vpp=1,dp=128,ep=1" in text and ", 1f1b schedule" in text
    assert "ILP-balanced, simulated" in text


def test_deepseek_v3_on_dualpipev(capsys):
    """DeepSeek-V3's published layout under DualPipeV (bench.planner_published's run, from the command line): the
    V is balanced and simulated, and beats the interleaved schedule on the same layout."""
    base = ["--recipe", "1t", "--model", "deepseek-v3", "--cluster", "h800", "--dtype", "fp8", "--seq", "4096",
            "--devices", "2048", "--global-batch", "16384", "--evaluate",
            "tp=1,pp=16,vpp=2,ep=64,recompute=selective,ep_scheme=node_dedup,ep_overlap=1"]
    steps = {}
    for schedule in ("dualpipev", "interleaved"):
        assert main(base[:-1] + [base[-1] + f",schedule={schedule}"]) == 0
        text = capsys.readouterr().out
        assert f", {schedule} schedule" in text
        steps[schedule] = float(re.search(r"ILP-balanced, simulated: step ([\d.]+) s", text).group(1))
    assert steps["dualpipev"] < steps["interleaved"]


DEEPSEEK = ["--recipe", "1t", "--model", "deepseek-v3", "--devices", "2048"]


@pytest.mark.parametrize("args, expect", [
    (["--recipe", "1t", "--model", "gpt-5"], "--model: unknown model 'gpt-5'; known: telechat3-36b, deepseek-v3"),
    (DEEPSEEK + ["--evaluate", "tp=3"], "tp*pp = 3 does not divide --devices 2048"),
    (DEEPSEEK + ["--evaluate", "tp=1,pp=3"], "tp*pp = 3 does not divide --devices 2048"),
    (["--recipe", "1t", "--model", "deepseek-v3", "--devices", "1536", "--global-batch", "1536", "--evaluate",
      "tp=1,pp=16,ep=3"], "ep=3 does not divide the 256 routed experts"),
    (DEEPSEEK + ["--evaluate", "tp=1,pp=8,vpp=4,ep=64,schedule=dualpipev"], "schedule=dualpipev runs 2 chunks"),
    (DEEPSEEK + ["--evaluate", "tp=1,pp=16,vpp=2,ep=64,schedule=dualpipev"], "needs m >= 2*pp = 32"),
    (DEEPSEEK + ["--evaluate", "tp=1,pp=16,vpp=2,ep=64,schedule=zigzag"], "schedule expects one of"),
    (DEEPSEEK + ["--evaluate", "tp=1,pp=16,vpp=2,ep=64,schedule=1f1b"], "schedule=1f1b runs one chunk per stage"),
    (DEEPSEEK + ["--write", "out.yaml"], "--write: a recipe inheriting --recipe trains the recipe's model"),
    (DEEPSEEK + ["--global-batch", "4096", "--evaluate", "tp=1,pp=16,vpp=2,ep=64,schedule=dualpipev",
                 "--export-mindformers", "out.yaml"], "MindFormers has no DualPipeV scheduler"),
    (["--recipe", "1t", "--devices", "4096", "--evaluate", "tp=4,pp=16,vpp=2,ep=1,etp=2,m=32", "--write",
      "out.yaml"], "--write: the trainer does not run this plan: parallel_config.expert_model_parallel: 2 needs "
                   "expert_parallel > 1"),
    (["--recipe", "1t", "--model", "telechat3-36b", "--devices", "2048", "--evaluate", "tp=8,pp=2,ep=8"],
     "a dense model has no routed experts"),
    (["--recipe", "1t", "--model", "telechat3-36b", "--devices", "2048", "--evaluate", "tp=8,pp=2,etp=2"],
     "--evaluate: ep=1,etp=2: a dense model has no routed experts to split; give ep=1,etp=1"),
    (["--recipe", "1t", "--model", "telechat3-36b", "--devices", "1536", "--global-batch", "1536", "--evaluate",
      "tp=6,pp=2"], "--evaluate: tp=6 neither divides the 8 KV heads nor is a multiple of them"),
])
def test_bad_model_and_schedule_input_is_one_line_and_exit_code_2(args, expect, tmp_path):
    r = subprocess.run([sys.executable, "-m", "telechat_moe.plan", *args], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], r.stderr
    assert not (tmp_path / "out.yaml").exists()


@pytest.mark.parametrize("args, expect", [
    (["--recipe", "105b", "--cluster", "tpu9000"], "unknown cluster"),
    (["--recipe", "105b", "--devices", "257"], "nearest device counts with layouts: 256"),
    (["--recipe", "1t", "--devices", "8"], "fits nowhere: the leanest layout needs"),
    (["--recipe", "105b", "--devices", "256", "--evaluate", "tp=3"], "tp*pp = 3 does not divide"),
    (["--recipe", "105b", "--devices", "256", "--evaluate", "tq=8"], "is not key=value with key in"),
    (["--recipe", "105b", "--devices", "256", "--evaluate", "tp=8,recompute=sometimes"], "recompute expects"),
    (["--recipe", "105b", "--devices", "256", "--evaluate", "tp=8,ep=5"], "expert_parallel"),
    (["--recipe", "nope.yaml"], "no recipe file"),
    (["--recipe", "105b", "--devices", "-4"], "--devices: expected a positive integer"),
    (["--recipe", "105b", "--devices", "many"], "invalid int value"),
    (["--recipe", "105b", "--dtype", "fp8"], "no peak for fp8"),
    (["--recipe", "105b", "--write", "recipes/105b.yaml"], "refusing to overwrite the input recipe"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, expect):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_failed_run_leaves_an_existing_output_untouched(tmp_path):
    out = tmp_path / "keep.yaml"
    out.write_text("precious: true\n")
    r = run("--recipe", "1t", "--devices", "8", "--write", str(out))
    assert r.returncode == 2
    assert out.read_text() == "precious: true\n"
