"""Recipes: inheritance, overrides, the dry-run report, and malformed recipes rejected with one line and exit 2."""
from __future__ import annotations

import pytest

from parallel.layout import Axis
from parallel.planner import trainable
from parallel.planner.model_shape import parameter_breakdown
from telechat_moe.errors import RecipeError
from telechat_moe.recipe import find_recipe, load_recipe
from telechat_moe.recipe_checks import check_trainable, launched_processes
from tests.helpers import assert_one_line_error, run_cli, run_main

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


def test_too_big_for_this_machine_stops_before_allocating(capfd):
    proc = run_main(capfd, "--recipe", "1t.yaml", "--set", "context.device_target=CPU",
                    "--set", "model.compute_dtype=float32")
    assert_one_line_error(proc, "--dry-run", "GiB")


# Each case: the --set assignments, then the field the one-line error must name and a hint of what was expected.
MALFORMED_SETS = [
    (["model.num_layers=4"], "model.num_layers", "did you mean model.num_hidden_layers"),
    (["model.hiden_size=64"], "model.hiden_size", "did you mean model.hidden_size"),
    (["trainig.train_steps=3"], "trainig", "did you mean training"),
    (["model.hidden_size=abc"], "model.hidden_size", "integer"),
    (["model.qk_layernorm=3"], "model.qk_layernorm", "true or false"),
    (["optimizer.learning_rate=fast"], "optimizer.learning_rate", "number"),
    # working weights in bfloat16 cannot run on CPU; below float32 they need the distributed optimizer's master
    (["model.params_dtype=bfloat16"], "model.params_dtype", "float16 on CPU"),
    (["model.params_dtype=float16", "parallel_config.optimizer_shard=false"], "model.params_dtype",
     "optimizer_shard: true"),
    (["parallel_config.ddp_bucket_size=-1"], "parallel_config.ddp_bucket_size", ">= 0"),
    (["model.num_experts_per_tok=32"], "model.num_experts_per_tok", "n_routed_experts=16"),
    (["parallel_config.expert_parallel=3"], "parallel_config.expert_parallel", "must divide"),
    # expert_parallel=8 fits data_parallel=8, so only the expert count is left to be wrong
    (["model.n_routed_experts=12", "parallel_config.expert_parallel=8", "parallel_config.data_parallel=8"],
     "parallel_config.expert_parallel", "12 experts cannot be split evenly over expert_parallel=8"),
    (["parallel_config.data_parallel=5", "parallel_config.expert_model_parallel=5", "training.global_batch_size=10"],
     "parallel_config.expert_model_parallel", "moe_intermediate_size=192"),
    (["model.qk_rope_head_dim=15"], "model.qk_rope_head_dim", "even"),
    (["parallel_config.model_parallel=3"], "model_parallel", "heads"),
    (["parallel_config.model_parallel=4", "model.intermediate_size=770"], "model.intermediate_size=770",
     "model_parallel=4"),
    (["parallel_config.model_parallel=2", "model.vocab_size=4097"], "model.vocab_size", "vocab_emb_dp"),
    (["parallel_config.context_parallel=3"], "model.seq_length", "context_parallel=3"),
    (["parallel_config.micro_batch_num=3"], "training.global_batch_size", "divisible"),
    (["training.global_batch_size=0"], "training.global_batch_size", "positive"),
    (["model.scoring_func=relu"], "model.scoring_func", "sigmoid or softmax"),
    (["model.compute_dtype=bfloat16"], "model.compute_dtype", "CPU"),
    (["model.router_dense_type=bfloat16"], "model.router_dense_type", "float32"),
    (["model.layernorm_compute_dtype=float16"], "model.layernorm_compute_dtype", "float32"),
    (["model.moe_token_dispatcher_type=all2all"], "model.moe_token_dispatcher_type", "local, alltoall"),
    (["model.moe_expert_capacity_factor=0"], "model.moe_expert_capacity_factor", "positive number or null"),
    (["model.moe_expert_capacity_factor=lots"], "model.moe_expert_capacity_factor", "positive number or null"),
    (["model.moe_token_drop_policy=random"], "model.moe_token_drop_policy", "probs, position"),
    (["parallel_config.pipeline_scheduler=zero_bubble"], "parallel_config.pipeline_scheduler", "1f1b, gpipe or dualpipev"),
    (["expert_placement.interval=-1"], "expert_placement.interval", "0 or more"),
    (["expert_placement.window=0"], "expert_placement.window", "at least 1"),
    (["expert_placement.threshold=-0.5"], "expert_placement.threshold", ">= 0"),
    (["expert_placement.interval=10"], "expert_placement.interval", "expert_parallel > 1"),
    (["expert_placement.interval=10", "parallel_config.expert_parallel=2", "parallel_config.data_parallel=2",
      "model.n_group=4", "model.topk_group=2"], "expert_placement.interval", "group-limited routing"),
    (["expert_placement.spare_slots=-1"], "expert_placement.spare_slots", "0 or more"),
    (["expert_placement.spare_slots=1", "parallel_config.expert_parallel=2", "parallel_config.data_parallel=2"],
     "expert_placement.spare_slots", "interval > 0"),
    (["expert_placement.spare_slots=1", "expert_placement.interval=2", "parallel_config.expert_parallel=2",
      "parallel_config.data_parallel=2", "model.moe_expert_capacity_factor=1.5"], "expert_placement.spare_slots",
     "dropless"),
    (["model.moe_shared_expert_intermediate_size=0"], "model.moe_shared_expert_intermediate_size", "positive"),
    (["model.n_group=3"], "model.n_group", "divide"),
    (["model.rope_theta=0"], "model.rope_theta", "above 1"),
    (["model.rotary_scaling_factor=0.5"], "model.rotary_scaling_factor", "1 (no YaRN) or more"),
    (["model.rotary_scaling_factor=4", "model.beta_fast=1", "model.beta_slow=32"], "model.beta_fast",
     "beta_slow=32"),
    (["model.rotary_scaling_factor=4", "model.beta_slow=-1"], "model.beta_slow", "> 0"),
    (["data.attention_balance=sometimes"], "data.attention_balance", "reorder"),
    (["lr_schedule.type=step"], "lr_schedule.type", "cosine"),
    (["parallel_config.pipeline_stage=8"], "micro_batch_num", "pipeline"),
    (["parallel_config.data_parallel=0"], "parallel_config.data_parallel", "positive"),
    (["model.first_k_dense_replace=9"], "model.first_k_dense_replace", "num_hidden_layers"),
    (["model.seq_length=1024"], "model.seq_length", "max_position_embeddings"),
    (["optimizer.betas=[0.9]"], "optimizer.betas", "two numbers"),
    (["data.paths=0.3 a.bin 0.7"], "data.paths", "weight/path pairs"),
    (["data.paths={a: 1}"], "data.paths", "list of paths"),
    (["training.loss_scale=huge"], "training.loss_scale", "dynamic"),
]


# In this process through run_train.main (a new interpreter per case would cost a MindSpore import each); the CLI
# itself, in a fresh process, is covered by the case below and by test_cli_errors_are_one_line_in_a_fresh_process.
@pytest.mark.parametrize("assignments,field,hint", MALFORMED_SETS, ids=[" ".join(m[0]) for m in MALFORMED_SETS])
def test_malformed_override_exits_2_with_one_line(assignments, field, hint, capfd):
    sets = [arg for a in assignments for arg in ("--set", a)]
    assert_one_line_error(run_main(capfd, "--recipe", "tiny", "--dry-run", *sets), field, hint)


def test_malformed_override_exits_2_with_one_line_in_a_fresh_process():
    assert_one_line_error(run_cli("run_train.py", "--recipe", "tiny", "--dry-run", "--set", "model.hiden_size=64"),
                          "model.hiden_size", "did you mean model.hidden_size")


def test_yarn_with_its_ramp_in_order_is_accepted():
    r = load_recipe("tiny", ["model.rotary_scaling_factor=4", "model.beta_fast=8", "model.beta_slow=8",
                             "model.seq_length=512"])
    assert r.model.yarn_enabled


def test_uneven_vocabulary_accepted_when_embedding_is_not_split():
    assert load_recipe("tiny", ["parallel_config.model_parallel=2", "model.vocab_size=4097",
                                "parallel_config.vocab_emb_dp=true"]).model.vocab_size == 4097


# ---- what a training run needs beyond a valid recipe ------------------------------------------------------------
def test_launched_processes_come_from_msrun():
    assert launched_processes({}) == 1
    assert launched_processes({"MS_WORKER_NUM": "2"}) == 2
    with pytest.raises(RecipeError, match="MS_WORKER_NUM"):
        launched_processes({"MS_WORKER_NUM": "two"})


def test_layout_must_match_the_processes_launched():
    dp2 = load_recipe("tiny", ["parallel_config.data_parallel=2"])
    check_trainable(dp2, launched_processes({"MS_WORKER_NUM": "2"}))      # msrun --worker_num=2, as test_training
    with pytest.raises(RecipeError, match=r"parallel_config: .* = 2 devices, but 1 process was launched"):
        check_trainable(dp2, launched_processes({}))
    with pytest.raises(RecipeError, match=r"parallel_config: .* = 1 device, but 2 processes were launched"):
        check_trainable(load_recipe("tiny"), launched_processes({"MS_WORKER_NUM": "2"}))


def test_tensor_and_sequence_parallel_layouts_are_trainable():
    """model_parallel > 1 trains (with or without sequence parallelism, beside data and expert parallelism): one
    process per device of the layout."""
    for sets, world in ((["parallel_config.model_parallel=2"], 2),
                        (["parallel_config.model_parallel=2", "parallel_config.use_seq_parallel=true"], 2),
                        (["parallel_config.model_parallel=4", "parallel_config.use_seq_parallel=true"], 4),
                        (["parallel_config.model_parallel=2", "parallel_config.data_parallel=2",
                          "parallel_config.expert_parallel=2", "parallel_config.use_seq_parallel=true"], 4)):
        check_trainable(load_recipe("tiny", sets), processes=world)
    with pytest.raises(RecipeError, match=r"= 2 devices, but 1 process was launched"):
        check_trainable(load_recipe("tiny", ["parallel_config.model_parallel=2"]), processes=1)


def _set(r, **model):
    for key, value in model.items():
        setattr(r.model, key, value)
    return r


TP2 = ["parallel_config.model_parallel=2"]
SP2 = TP2 + ["parallel_config.use_seq_parallel=true"]
# What tensor parallelism cannot train, each one line naming the field. Some a valid recipe never has (validate()
# refuses them for any plan): those are set on the loaded recipe, as a recipe that skipped that check would hold them.
TP_REFUSALS = [
    (TP2, {"num_attention_heads": 3}, "model.num_attention_heads", ("3 heads", "model_parallel=2")),
    (["parallel_config.model_parallel=4", "model.seq_length=126"], {}, "model.seq_length",
     ("126", "each rank's share of the tokens")),
    (SP2, {"seq_length": 127}, "model.seq_length", ("127", "sequence shards of sequence parallelism")),
    (TP2 + ["model.vocab_size=4097", "parallel_config.vocab_emb_dp=true"], {}, "model.vocab_size",
     ("4097", "by vocabulary")),
    (TP2, {"intermediate_size": 771}, "model.intermediate_size", ("771", "dense FFN")),
    (TP2, {"moe_shared_expert_intermediate_size": 191}, "model.moe_shared_expert_intermediate_size",
     ("191 x n_shared_experts=1 = 191", "model_parallel=2")),
    (TP2, {"moe_shared_expert_intermediate_size": 97, "n_shared_experts": 3},
     "model.moe_shared_expert_intermediate_size", ("97 x n_shared_experts=3 = 291", "model_parallel=2")),
    (TP2 + ["model.tie_word_embeddings=true"], {}, "model.tie_word_embeddings",
     ("not trained yet under tensor parallelism",)),
    (SP2 + ["model.tie_word_embeddings=true"], {}, "model.tie_word_embeddings", ("model_parallel=2",)),
]


@pytest.mark.parametrize("sets,model,field,hints", TP_REFUSALS,
                         ids=[f"{t[2]}-{i}" for i, t in enumerate(TP_REFUSALS)])
def test_what_tensor_parallelism_cannot_train_is_one_line(sets, model, field, hints):
    r = _set(load_recipe("tiny", sets), **model)
    with pytest.raises(RecipeError) as e:
        check_trainable(r, processes=r.layout.world_size)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{field}:"), message
    for hint in hints:
        assert hint in message, message


def test_the_same_sizes_train_without_tensor_parallelism():
    """Each size refused above trains at model_parallel=1 (the rules are tensor parallelism's)."""
    for sets, model, _, _ in TP_REFUSALS:
        plain = [s for s in sets if not s.startswith("parallel_config.")]
        check_trainable(_set(load_recipe("tiny", plain), **model), processes=1)


@pytest.mark.parametrize("sets", [["parallel_config.expert_model_parallel=2", "parallel_config.expert_parallel=2",
                                   "parallel_config.data_parallel=4"]], ids=["expert_model_parallel"])
def test_layouts_not_trained_yet_are_one_line(sets, monkeypatch):
    """An engine whose switch is off (parallel/planner/trainable.py) is refused in one line naming its key."""
    monkeypatch.setattr(trainable, "EXPERT_TENSOR_PARALLEL_TRAINS", False)
    r = load_recipe("tiny", sets)
    key = sets[0].split("=")[0]
    with pytest.raises(RecipeError, match=rf"^{key}: 2 is not trained yet \(data, tensor, sequence, expert and "
                                          rf"pipeline parallelism are\); use --dry-run"):
        check_trainable(r, processes=r.layout.world_size)


PIPELINE = ["parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=2"]


def test_what_the_pipeline_does_not_run_is_one_line():
    r = load_recipe("tiny", PIPELINE + ["model.tie_word_embeddings=true"])
    with pytest.raises(RecipeError) as e:
        check_trainable(r, processes=r.layout.world_size)
    assert all(n in str(e.value) for n in ["model.tie_word_embeddings", "pipeline_stage=2"]) \
        and "\n" not in str(e.value), str(e.value)
    check_trainable(load_recipe("tiny", PIPELINE + ["training.dump_steps=1"]), processes=2)


def test_tied_head_under_tensor_parallelism_stops_before_mindspore(tmp_path):
    """Through the command line, as msrun's two workers would each start it: one line, exit 2, MindSpore never
    imported, nothing written."""
    out = tmp_path / "out"
    proc = run_cli("-c", MAIN_AND_MINDSPORE, "--recipe", "tiny", "--set", "parallel_config.model_parallel=2",
                   "--set", "model.tie_word_embeddings=true", "--set", f"output_dir={out}",
                   env={"MS_WORKER_NUM": "2"})
    assert_one_line_error(proc, "model.tie_word_embeddings", "tensor parallelism")
    assert proc.stdout.strip() == "False" and not out.exists()


def test_expert_parallel_over_tp_spreads_whole_experts_over_the_tensor_ranks(capfd):
    """TP-extends-EP: tp=2 x ep=2 on 4 devices puts the 16 routed experts 4 per device, unsplit, the EP group
    taking in both tensor-parallel ranks and both data-parallel ones; without the option expert_parallel=2 is the
    EP group of the two tensor ranks (MindFormers' folding with expert_model_parallel=1), replicated over dp."""
    base = ["parallel_config.data_parallel=2", "parallel_config.model_parallel=2", "parallel_config.expert_parallel=2"]
    over = load_recipe("tiny", [*base, "parallel_config.expert_parallel_over_tp=true"]).layout
    assert (over.ep, over.etp, over.edp) == (4, 1, 1)
    assert over.group_of(Axis.EP, 0) == [0, 1, 2, 3] and over.group_of(Axis.TP, 0) == [0, 1]
    plain = load_recipe("tiny", base).layout
    assert (plain.ep, plain.edp) == (2, 2) and plain.group_of(Axis.EP, 0) == [0, 1]
    dry = run_main(capfd, "--recipe", "tiny", "--dry-run", *[x for a in base for x in ("--set", a)],
                   "--set", "parallel_config.expert_parallel_over_tp=true")
    assert dry.returncode == 0 and "in routed experts (1/4 of each layer's)" in dry.stdout, dry.stdout
    with pytest.raises(RecipeError, match="expert_parallel_over_tp"):
        load_recipe("tiny", [*base, "parallel_config.expert_parallel_over_tp=true",
                             "parallel_config.expert_model_parallel=2"])


# Runs main() in a fresh interpreter and reports whether MindSpore was ever imported.
MAIN_AND_MINDSPORE = "import sys, run_train; rc = run_train.main(sys.argv[1:]); print('mindspore' in sys.modules); " \
                     "sys.exit(rc)"


def test_data_parallel_without_msrun_stops_before_mindspore(tmp_path):
    out = tmp_path / "out"
    proc = run_cli("-c", MAIN_AND_MINDSPORE, "--recipe", "tiny", "--set", "parallel_config.data_parallel=2",
                   "--set", f"output_dir={out}")
    assert_one_line_error(proc, "parallel_config", "2 devices", "1 process", "msrun --worker_num=2")
    assert proc.stdout.strip() == "False" and not out.exists()


def test_local_dispatcher_under_expert_parallelism_is_refused_before_mindspore(tmp_path):
    """'local' keeps every expert on every rank: with expert_parallel > 1 it is one line, before any process waits
    for its peers."""
    out = tmp_path / "out"
    proc = run_cli("-c", MAIN_AND_MINDSPORE, "--recipe", "tiny", "--set", "model.moe_token_dispatcher_type=local",
                   "--set", "parallel_config.data_parallel=2", "--set", "parallel_config.expert_parallel=2",
                   "--set", f"output_dir={out}")
    assert_one_line_error(proc, "model.moe_token_dispatcher_type", "'local'", "alltoall or hierarchical")
    assert proc.stdout.strip() == "False" and not out.exists()


MALFORMED_FILES = {
    "bad_yaml": ("model: [unclosed\n", "not valid YAML"),
    "top_level_list": ("- a\n- b\n", "expected a mapping"),
    "missing_base": ("base: nowhere.yaml\n", "base: no such recipe"),
    "section_not_mapping": ("base: tiny.yaml\nmodel: 5\n", "model: expected a mapping"),
    "unknown_section": ("base: tiny.yaml\nmodle:\n  hidden_size: 8\n", "did you mean model"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_FILES))
def test_malformed_recipe_file_exits_2_with_one_line(case, tmp_path, capfd):
    text, hint = MALFORMED_FILES[case]
    (tmp_path / "tiny.yaml").write_text(find_recipe("tiny").read_text().replace("base: base.yaml", "base: base2.yaml"))
    (tmp_path / "base2.yaml").write_text(find_recipe("base").read_text())
    path = tmp_path / f"{case}.yaml"
    path.write_text(text)
    assert_one_line_error(run_main(capfd, "--recipe", str(path), "--dry-run"), hint)


def test_base_loop_rejected(tmp_path, capfd):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    assert_one_line_error(run_main(capfd, "--recipe", str(tmp_path / "a.yaml"), "--dry-run"), "loops")


CLI_ERRORS = [
    (["--recipe", "no_such_recipe"], "no recipe file"),
    (["--recipe", "tiny", "--set", "novalue"], "key.path=value"),
    (["--recipe", "tiny", "--set", "model.top_k=3"], "did you mean model.num_experts_per_tok"),
    (["--recipe", "tiny", "--bogus-flag"], "unrecognized arguments"),
]


@pytest.mark.parametrize("args,hint", CLI_ERRORS)
def test_cli_errors_are_one_line(args, hint, capfd):
    assert_one_line_error(run_main(capfd, *args, "--dry-run"), hint)


# The real command line: argparse's usage error and a recipe error each leave a fresh interpreter with one line, exit 2.
@pytest.mark.parametrize("args,hint", [CLI_ERRORS[0], CLI_ERRORS[3]])
def test_cli_errors_are_one_line_in_a_fresh_process(args, hint):
    assert_one_line_error(run_cli("run_train.py", *args, "--dry-run"), hint)
