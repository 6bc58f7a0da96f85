"""Recipes: inheritance, overrides, the dry-run report, and malformed recipes rejected with one line and exit 2."""
from __future__ import annotations

import pytest

from parallel.planner.model_shape import parameter_breakdown
from telechat_moe.errors import RecipeError
from telechat_moe.recipe import find_recipe, load_recipe
from tests.helpers import assert_one_line_error, run_cli

ALL = ["tiny", "small", "105b", "370b", "1t"]


@pytest.mark.parametrize("name", ALL)
def test_every_recipe_loads_and_validates(name):
    r = load_recipe(name)
    assert r.name == name and r.layout.world_size >= 1


def test_recipe_found_by_name_file_or_path():
    assert find_recipe("1t") == find_recipe("1t.yaml") == find_recipe("recipes/1t.yaml").resolve()


def test_base_inheritance_and_set_overrides():
    r = load_recipe("1t", ["model.num_hidden_layers=80", "training.train_steps=7", "optimizer.betas=[0.8, 0.9]"])
    assert r.model.hidden_size == 4096            # from 370b.yaml
    assert r.model.q_lora_rank == 1536            # from 105b.yaml
    assert r.model.rms_norm_eps == 1e-5           # from base.yaml
    assert r.model.num_hidden_layers == 80 and r.training.train_steps == 7 and r.optimizer.betas == [0.8, 0.9]


def test_sizes_match_the_brief():
    b105 = parameter_breakdown(load_recipe("105b").model.to_model_shape())
    assert abs(b105["total"] / 105e9 - 1) <= 0.02 and abs(b105["active"] / 4.7e9 - 1) <= 0.05
    b1t = parameter_breakdown(load_recipe("1t").model.to_model_shape())
    mid = parameter_breakdown(load_recipe("370b").model.to_model_shape())
    assert b1t["total"] >= 1.0e12
    assert b105["total"] < mid["total"] < b1t["total"]


def test_dry_run_prints_breakdown_flops_and_memory():
    proc = run_cli("run_train.py", "--recipe", "recipes/1t.yaml", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for part in ("embedding", "attention", "dense_ffn", "routed_experts", "shared_experts", "mtp", "head", "total",
                 "active", "training FLOPs per token", "weights", "gradients", "optimizer"):
        assert part in out, part
    assert "1110.578 B" in out


def test_too_big_for_this_machine_stops_before_allocating():
    proc = run_cli("run_train.py", "--recipe", "1t.yaml", "--set", "context.device_target=CPU",
                   "--set", "model.compute_dtype=float32")
    assert_one_line_error(proc, "--dry-run", "GiB")


MALFORMED_SETS = [
    ("model.num_layers=4", "model.num_layers", "did you mean model.num_hidden_layers"),
    ("model.hiden_size=64", "model.hiden_size", "did you mean model.hidden_size"),
    ("trainig.train_steps=3", "trainig", "did you mean training"),
    ("model.hidden_size=abc", "model.hidden_size", "integer"),
    ("model.qk_layernorm=3", "model.qk_layernorm", "true or false"),
    ("optimizer.learning_rate=fast", "optimizer.learning_rate", "number"),
    ("model.num_experts_per_tok=32", "model.num_experts_per_tok", "n_routed_experts=16"),
    ("parallel_config.expert_parallel=3", "expert_parallel", ""),
    ("model.qk_rope_head_dim=15", "model.qk_rope_head_dim", "even"),
    ("parallel_config.model_parallel=3", "model_parallel", "heads"),
    ("parallel_config.micro_batch_num=3", "training.global_batch_size", "divisible"),
    ("training.global_batch_size=0", "training.global_batch_size", "positive"),
    ("model.scoring_func=relu", "model.scoring_func", "sigmoid or softmax"),
    ("model.compute_dtype=bfloat16", "model.compute_dtype", "CPU"),
    ("model.n_group=3", "model.n_group", "divide"),
    ("data.attention_balance=sometimes", "data.attention_balance", "reorder"),
    ("lr_schedule.type=step", "lr_schedule.type", "cosine"),
    ("parallel_config.pipeline_stage=8", "micro_batch_num", "pipeline"),
    ("parallel_config.data_parallel=0", "parallel_config.data_parallel", "positive"),
    ("model.first_k_dense_replace=9", "model.first_k_dense_replace", "num_hidden_layers"),
    ("model.seq_length=1024", "model.seq_length", "max_position_embeddings"),
    ("optimizer.betas=[0.9]", "optimizer.betas", "two numbers"),
    ("data.paths=notalist", "data.paths", "list"),
    ("training.loss_scale=huge", "training.loss_scale", "dynamic"),
]


@pytest.mark.parametrize("assignment,field,hint", MALFORMED_SETS, ids=[m[0] for m in MALFORMED_SETS])
def test_malformed_override_rejected(assignment, field, hint):
    with pytest.raises(RecipeError) as err:
        load_recipe("tiny", [assignment])
    message = str(err.value)
    assert field in message and hint in message and "\n" not in message


MALFORMED_FILES = {
    "bad_yaml": ("model: [unclosed\n", "not valid YAML"),
    "top_level_list": ("- a\n- b\n", "expected a mapping"),
    "missing_base": ("base: nowhere.yaml\n", "base: no such recipe"),
    "section_not_mapping": ("base: tiny.yaml\nmodel: 5\n", "model: expected a mapping"),
    "unknown_section": ("base: tiny.yaml\nmodle:\n  hidden_size: 8\n", "did you mean model"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_FILES))
def test_malformed_recipe_file_exits_2_with_one_line(case, tmp_path):
    text, hint = MALFORMED_FILES[case]
    (tmp_path / "tiny.yaml").write_text(find_recipe("tiny").read_text().replace("base: base.yaml", "base: base2.yaml"))
    (tmp_path / "base2.yaml").write_text(find_recipe("base").read_text())
    path = tmp_path / f"{case}.yaml"
    path.write_text(text)
    assert_one_line_error(run_cli("run_train.py", "--recipe", str(path), "--dry-run"), hint)


def test_base_loop_rejected(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    assert_one_line_error(run_cli("run_train.py", "--recipe", str(tmp_path / "a.yaml"), "--dry-run"), "loops")


@pytest.mark.parametrize("args,hint", [
    (["--recipe", "no_such_recipe"], "no recipe file"),
    (["--recipe", "tiny", "--set", "novalue"], "key.path=value"),
    (["--recipe", "tiny", "--set", "model.top_k=3"], "did you mean model.num_experts_per_tok"),
    (["--recipe", "tiny", "--bogus-flag"], "unrecognized arguments"),
])
def test_cli_errors_are_one_line(args, hint):
    assert_one_line_error(run_cli("run_train.py", *args, "--dry-run"), hint)
