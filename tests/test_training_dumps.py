"""The trainer's tensor dumps feed precision.compare: a run from other initial weights diverges first at the
embedding's forward output; a run of another model is refused with one line. (Runs that should agree do: the
data-parallel test in test_training.py compares a DP=2 run's dump with a one-process run's.)"""
from __future__ import annotations

import json
import shutil

from tests.helpers import assert_one_line_error, run_cli

SHORT = ["model.seq_length=32", "model.max_position_embeddings=32", "model.original_max_position_embeddings=32",
         "training.global_batch_size=2", "training.train_steps=2", "training.eval_interval=0",
         "training.dump_steps=1-2"]


def train(out, *extra, tokenizer=None):
    sets = SHORT + [f"output_dir={out}", *extra] + ([f"data.tokenizer={tokenizer}"] if tokenizer else [])
    proc = run_cli("run_train.py", "--recipe", "tiny", *[x for s in sets for x in ("--set", s)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "dump"


def test_dumps_compare_and_localise(tmp_path):
    a = train(tmp_path / "a")
    tok = tmp_path / "a" / "tokenizer.model"
    names = sorted(p.name for p in a.iterdir())
    assert "run.json" in names and "step_00000001.rank0.safetensors" in names and "step_00000002.rank0.json" in names
    index = json.loads((a / "step_00000001.rank0.json").read_text())
    forward = [(e["name"], e["layer"], e["operator"]) for e in index if e["kind"] == "forward"]
    # tiny: layer 0 dense, the others MoE; each layer's stream after its attention and after its FFN
    assert forward[:5] == [("embed_tokens", None, "embed_tokens"), ("layers.0.self_attn", 0, "self_attn"),
                           ("layers.0", 0, "mlp"), ("layers.1.self_attn", 1, "self_attn"), ("layers.1", 1, "moe")]
    assert forward[-1] == ("norm", None, "norm")

    c = train(tmp_path / "c", "seed=7", tokenizer=tok)
    diverged = run_cli("-m", "precision.compare", str(a), str(c), "--png", str(tmp_path / "diverged.png"))
    assert diverged.returncode == 1, diverged.stdout + diverged.stderr
    assert "embed_tokens" in diverged.stdout
    assert (tmp_path / "diverged.png").stat().st_size > 0

    # a dump of another model (its run.json hashes another model config; the hash of a real config, no training)
    from precision.dump import config_hash
    from telechat_moe.recipe import load_recipe
    d = tmp_path / "d"
    shutil.copytree(a, d)
    run = json.loads((d / "run.json").read_text())
    other = load_recipe("tiny", SHORT + ["model.moe_intermediate_size=96"]).model.function()
    run["meta"]["model_config_hash"] = config_hash(other)
    assert run["meta"]["model_config_hash"] != json.loads((a / "run.json").read_text())["meta"]["model_config_hash"]
    (d / "run.json").write_text(json.dumps(run))
    assert_one_line_error(run_cli("-m", "precision.compare", str(a), str(d), "--png", ""), "model")


def test_bad_dump_steps_is_a_recipe_error():
    proc = run_cli("run_train.py", "--recipe", "tiny", "--set", "training.dump_steps=3-1", "--dry-run")
    assert_one_line_error(proc, "training.dump_steps")
