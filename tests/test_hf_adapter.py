"""The HF converter without running a model: its table against transformers' and our parameter names and shapes,
exact round trips (in memory, through files in float32 and bfloat16, through a MindSpore training checkpoint),
config mapping, and the command line's handling of bad input (one line, exit code 2, nothing overwritten)."""
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the test dependency that runs transformers")
transformers = pytest.importorskip("transformers", reason="transformers provides the reference checkpoints")

from precision.tolerance import assert_close, tolerance  # noqa: E402
from telechat_moe import hf_adapter as hfa  # noqa: E402
from telechat_moe import hf_config as hfc  # noqa: E402
from telechat_moe.config import ModelConfig  # noqa: E402
from telechat_moe.safetensors_io import read_hf_dir  # noqa: E402
from tests.helpers import assert_one_line_error, run_cli  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
            kv_lora_rank=12, q_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8,
            first_k_dense_replace=1, max_position_embeddings=32)
HF_VARIANTS = {
    "v3": ("DeepseekV3", dict(BASE, n_group=2, topk_group=1)),
    "v3_q_proj_tied": ("DeepseekV3", dict(BASE, q_lora_rank=None, tie_word_embeddings=True, n_group=1,
                                          topk_group=1)),
    "v3_yarn_two_shared": ("DeepseekV3", dict(BASE, n_shared_experts=2, n_group=1, topk_group=1,
                                              rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 0.7,
                                                            "mscale_all_dim": 0.7,
                                                            "original_max_position_embeddings": 8})),
    # rope rows already in rotate-half order: copied both ways, the flag kept
    "v3_rope_not_interleaved": ("DeepseekV3", dict(BASE, n_group=1, topk_group=1, rope_interleave=False)),
    "v2_grouped": ("DeepseekV2", dict(BASE, topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                      n_shared_experts=1)),
}


def hf_model(variant: str, seed: int = 0):
    arch, kwargs = HF_VARIANTS[variant]
    torch.manual_seed(seed)
    model = getattr(transformers, f"{arch}ForCausalLM")(getattr(transformers, f"{arch}Config")(**kwargs))
    with torch.no_grad():
        for p in model.state_dict().values():
            p.copy_(torch.randn_like(p))
    return model.eval()


def hf_config(model) -> dict:
    return {**model.config.to_dict(), "architectures": [type(model).__name__]}


def with_mtp(state: dict, config: dict, rng) -> dict:
    """Add MTP depth 1 the way DeepSeek-V3 stores it: decoder layer L plus enorm/hnorm/eh_proj/shared_head."""
    layer, out = config["num_hidden_layers"] - 1, dict(state)
    mtp = f"model.layers.{config['num_hidden_layers']}."
    for name, v in state.items():
        if name.startswith(f"model.layers.{layer}."):
            out[mtp + name[len(f"model.layers.{layer}."):]] = rng.standard_normal(v.shape).astype(np.float32)
    h = config["hidden_size"]
    for name, shape in (("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)),
                        ("shared_head.norm.weight", (h,))):
        out[mtp + name] = rng.standard_normal(shape).astype(np.float32)
    out[mtp + "embed_tokens.weight"] = state["model.embed_tokens.weight"]
    out[mtp + "shared_head.head.weight"] = state["lm_head.weight"]
    return out


def convert(*args):
    """The converter's command line, as a user runs it."""
    return run_cli("-m", "scripts.convert_hf_checkpoint", *map(str, args))


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


# ---- the table ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_table_names_are_transformers_names(variant):
    model = hf_model(variant)
    config = hf_config(model)
    cfg = hfc.model_config(hfc.config_from_hf(config))
    table = {e.hf for e in hfa.entries(cfg, hfc.hf_family(config)) if e.hf is not None}
    assert table == set(model.state_dict())


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": 0}, {"qk_layernorm": False}, {"tie_word_embeddings": True},
                                       {"num_nextn_predict_layers": 0, "first_k_dense_replace": 2},
                                       {"n_shared_experts": 2}])
def test_table_shapes_are_our_parameter_shapes(overrides):
    from telechat_moe.model import TeleChatMoE
    cfg = ModelConfig(**{**dict(vocab_size=64, seq_length=8, max_position_embeddings=8, hidden_size=32,
                                num_hidden_layers=3, num_attention_heads=2, intermediate_size=48, q_lora_rank=16,
                                kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                moe_shared_expert_intermediate_size=8, num_nextn_predict_layers=1), **overrides})
    model = TeleChatMoE(cfg)
    assert hfa.our_shapes(cfg) == {p.name: tuple(p.shape) for p in model.get_parameters()}


def test_rope_permutation_takes_pairs_to_halves():
    assert hfa.rope_deinterleave(8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    # rotating pair (x[2i], x[2i+1]) as a complex number equals rotate-half on the de-interleaved vector
    rng = np.random.default_rng(0)
    x, theta = rng.standard_normal(8), rng.standard_normal(4)
    pairs = (x[0::2] + 1j * x[1::2]) * np.exp(1j * theta)
    y = x[hfa.rope_deinterleave(8)]
    cos, sin = np.cos(np.concatenate([theta, theta])), np.sin(np.concatenate([theta, theta]))
    rotated = y * cos + np.concatenate([-y[4:], y[:4]]) * sin
    # float64 both ways, each output a two-term sum (x_even cos -+ x_odd sin), in another order on each side
    assert_close(rotated, np.concatenate([pairs.real, pairs.imag]), tolerance("float64", 2), "rotate-half")


# ---- exact round trips --------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_hf_to_ours_to_hf_is_bitwise(variant):
    model = hf_model(variant)
    config = hf_config(model)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if variant == "v3":
        config["num_nextn_predict_layers"] = 1
        state = with_mtp(state, config, np.random.default_rng(1))
    family, interleaved = hfc.hf_family(config), hfc.hf_rope_interleaved(config)
    cfg = hfc.model_config(hfc.config_from_hf(config))
    back = hfa.ours_to_hf(hfa.hf_to_ours(state, cfg, family, interleaved), cfg, family, interleaved)
    if cfg.tie_word_embeddings:  # state_dict() lists the tied head, save_pretrained and we leave it out
        state.pop("lm_head.weight")
    assert back.keys() == state.keys()
    for name, value in state.items():
        assert back[name].shape == value.shape and np.array_equal(bits(back[name]), bits(value)), name


def test_config_round_trip():
    for variant in sorted(HF_VARIANTS):
        cfg = ModelConfig(**hfc.config_from_hf(hf_config(hf_model(variant))))
        assert ModelConfig(**hfc.config_from_hf(hfc.hf_config_from(cfg))) == cfg, variant


def test_cli_round_trip_bfloat16_with_mtp_loads_in_transformers(tmp_path):
    """HF dir (bf16, DeepSeek-V3 layout with MTP) -> ours (fp32, loadable by MindSpore) -> HF dir (bf16): same
    bits, and transformers loads the result without missing keys."""
    import mindspore as ms
    from safetensors.torch import save_file
    model = hf_model("v3")
    config = {**hf_config(model), "num_nextn_predict_layers": 1}
    state = with_mtp({k: v.numpy() for k, v in model.state_dict().items()}, config, np.random.default_rng(2))
    src = tmp_path / "hf"
    src.mkdir()
    bf16 = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in state.items()}
    half = len(bf16) // 2
    shards = {"model-00001-of-00002.safetensors": dict(list(bf16.items())[:half]),
              "model-00002-of-00002.safetensors": dict(list(bf16.items())[half:])}
    for name, shard in shards.items():
        save_file(shard, str(src / name), metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, shard in shards.items() for k in shard}}))
    (src / "config.json").write_text(json.dumps(config))

    ours = tmp_path / "ours.safetensors"
    r = convert("--to-ours", src, ours)
    assert r.returncode == 0, r.stderr
    loaded = ms.load_checkpoint(str(ours), format="safetensors")
    cfg = hfc.model_config(hfc.config_from_hf(config))
    assert {k: tuple(v.shape) for k, v in loaded.items()} == hfa.our_shapes(cfg)
    assert (tmp_path / "ours.model.yaml").exists()

    out = tmp_path / "back"
    r = convert("--to-hf", ours, out, "--dtype", "bfloat16", "--max-shard-gb", 0.00005)
    assert r.returncode == 0, r.stderr
    written = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert written.keys() == bf16.keys() and len(set(written.values())) > 1
    from safetensors.torch import load_file
    for shard in set(written.values()):
        for k, v in load_file(str(out / shard)).items():
            assert v.dtype == torch.bfloat16 and torch.equal(v.view(torch.int16), bf16[k].view(torch.int16)), k
    reloaded, info = type(model).from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"]


@pytest.mark.parametrize("interleave", [True, False])
def test_cli_round_trip_keeps_rope_interleave(interleave, tmp_path):
    """save_pretrained with either rope_interleave -> ours -> HF: the same bits and the same flag (issue 19)."""
    from safetensors.numpy import load_file
    model = hf_model("v3")
    model.config.rope_interleave = interleave
    model.save_pretrained(str(tmp_path / "hf"))
    assert convert("--to-ours", tmp_path / "hf", tmp_path / "ours.safetensors").returncode == 0
    r = convert("--to-hf", tmp_path / "ours.safetensors", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_interleave"] is interleave
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == state.keys()
    for name, value in state.items():
        assert np.array_equal(bits(back[name]), bits(value)), name


def test_yarn_model_section_takes_max_position_embeddings(hf_dir, tmp_path):
    """A YaRN model converted from transformers runs the lengths transformers' does (issue 19: it was built for
    original_max_position_embeddings only); the note says a recipe may train shorter."""
    src = broken_copy(hf_dir, tmp_path, lambda c: c.update(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}))
    r = convert("--to-ours", src, tmp_path / "ours.safetensors")
    assert r.returncode == 0, r.stderr
    assert "model.seq_length=32" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    import yaml
    model = yaml.safe_load((tmp_path / "ours.model.yaml").read_text())["model"]
    assert model["seq_length"] == model["max_position_embeddings"] == 32
    assert model["original_max_position_embeddings"] == 8
    cfg = hfc.model_config(model)
    cfg.validate()


def test_cli_to_hf_from_a_mindspore_training_checkpoint(tmp_path):
    """A checkpoint MindSpore wrote (no converter metadata) plus the recipe it was trained with."""
    import mindspore as ms
    from telechat_moe.model import TeleChatMoE
    from telechat_moe.recipe import load_recipe
    sets = ["model.num_hidden_layers=2", "model.vocab_size=256", "model.n_routed_experts=4"]
    cfg = load_recipe("tiny", sets).model
    model = TeleChatMoE(cfg)
    ckpt = tmp_path / "weights.safetensors"
    ms.save_checkpoint(model, str(ckpt), format="safetensors")
    r = convert("--to-hf", ckpt, tmp_path / "hf")
    assert_one_line_error(r, "--recipe")
    r = convert("--to-hf", ckpt, tmp_path / "hf", "--recipe", "tiny", *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 0, r.stderr
    assert "eps" in r.stderr  # the recipe's rms_norm_eps is not transformers' latent-norm eps: said, not hidden
    params = {p.name: p.asnumpy() for p in model.get_parameters()}
    _, hf = read_hf_dir(str(tmp_path / "hf"))
    assert np.array_equal(hfa.hf_to_ours(hf, cfg)["layers.1.mlp.experts.w1"], params["layers.1.mlp.experts.w1"])


# ---- bad input ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    model = hf_model("v3")
    path = tmp_path_factory.mktemp("hf_v3")
    model.save_pretrained(str(path))
    return path


def broken_copy(hf_dir, tmp_path, config_change=None, state_change=None):
    from safetensors.numpy import load_file, save_file
    dst = tmp_path / "broken"
    shutil.copytree(hf_dir, dst)
    if config_change:
        config = json.loads((dst / "config.json").read_text())
        config_change(config)
        (dst / "config.json").write_text(json.dumps(config))
    if state_change:
        state = load_file(str(dst / "model.safetensors"))
        state_change(state)
        save_file(state, str(dst / "model.safetensors"))
    return dst


BAD_HF = {
    "not a deepseek": (lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]), None,
                       ["model_type"]),
    "attention bias": (lambda c: c.update(attention_bias=True), None, ["attention_bias"]),
    "gqa heads": (lambda c: c.update(num_key_value_heads=1), None, ["num_key_value_heads"]),
    "linear rope": (lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 2.0}), None,
                    ["rope_scaling"]),
    "missing tensor": (None, lambda s: s.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
                       ["model.layers.1.mlp.experts.3.up_proj.weight", "missing"]),
    "wrong shape": (None, lambda s: s.update({"model.norm.weight": np.ones(5, np.float32)}),
                    ["model.norm.weight", "(5,)"]),
    "unknown tensor": (None, lambda s: s.update({"model.layers.7.enorm.weight": np.ones(32, np.float32)}),
                       ["model.layers.7.enorm.weight"]),
    "fp8": (None, lambda s: s.update({"model.layers.1.self_attn.o_proj.weight_scale_inv": np.ones(1, np.float32)}),
            ["FP8"]),
    "mtp head differs": (lambda c: c.update(num_nextn_predict_layers=1),
                         lambda s: s.update(with_mtp(s, {"num_hidden_layers": 3, "hidden_size": 32},
                                                     np.random.default_rng(0)),
                                            **{"model.layers.3.embed_tokens.weight": np.zeros((64, 32), np.float32)}),
                         ["model.layers.3.embed_tokens.weight", "shares"]),
    # DeepSeek-V3's config.json through transformers' save_pretrained: num_nextn_predict_layers kept, MTP weights not
    "mtp not saved by transformers": (lambda c: c.update(num_nextn_predict_layers=1), None,
                                      ["num_nextn_predict_layers: 0", "no MTP weights"]),
}


@pytest.mark.parametrize("case", sorted(BAD_HF))
def test_cli_rejects_bad_hf_checkpoint(case, hf_dir, tmp_path):
    config_change, state_change, fragments = BAD_HF[case]
    src = broken_copy(hf_dir, tmp_path, config_change, state_change)
    out = tmp_path / "ours.safetensors"
    assert_one_line_error(convert("--to-ours", src, out), *fragments)
    assert not out.exists()


def test_cli_rejects_bad_arguments_and_keeps_existing_outputs(hf_dir, tmp_path):
    assert_one_line_error(convert(), "--to-ours")
    assert_one_line_error(convert("--to-ours", tmp_path / "nowhere", tmp_path / "o.safetensors"), "config.json")
    assert_one_line_error(convert("--to-ours", hf_dir, tmp_path / "o.ckpt"), ".safetensors")
    existing = tmp_path / "keep.safetensors"
    existing.write_bytes(b"precious")
    assert_one_line_error(convert("--to-ours", hf_dir, existing), "--force")
    assert existing.read_bytes() == b"precious"
    no_mtp = broken_copy(hf_dir, tmp_path, lambda c: c.update(num_nextn_predict_layers=1))
    assert_one_line_error(convert("--to-ours", no_mtp, existing, "--force"), "num_nextn_predict_layers: 0")
    assert existing.read_bytes() == b"precious"  # refused before anything is written, --force or not
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    assert_one_line_error(convert("--to-hf", garbage, tmp_path / "out"), "garbage.safetensors")
    assert_one_line_error(convert("--to-hf", tmp_path / "absent.safetensors", tmp_path / "out"), "absent")
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text("{}")
    assert_one_line_error(convert("--to-hf", garbage, full), "--force")
    assert (full / "config.json").read_text() == "{}"
    ours = tmp_path / "ok.safetensors"
    assert convert("--to-ours", hf_dir, ours).returncode == 0
    assert_one_line_error(convert("--to-hf", ours, tmp_path / "o2", "--dtype", "int8"), "--dtype")
    assert_one_line_error(convert("--to-hf", ours, tmp_path / "o3", "--recipe", "no_such_recipe"), "no_such_recipe")
