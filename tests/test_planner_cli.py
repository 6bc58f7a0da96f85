"""`python -m telechat_moe.plan`: a search that writes a loadable recipe and a picture, one-layout evaluation, and
one-line errors with exit code 2 for bad input."""
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
