"""Convert transformers DeepseekV3/DeepseekV2 checkpoints to TeleChatMoE parameters and back.

    python -m scripts.convert_hf_checkpoint --to-ours HF_DIR OUT.safetensors
    python -m scripts.convert_hf_checkpoint --to-hf CKPT.safetensors HF_OUT_DIR [--recipe R] [--dtype bfloat16]

--to-ours reads HF_DIR/config.json and its safetensors (one file or indexed shards) and writes our parameters in
float32 with the model config (and DeepseekV3's rope_interleave) in the file's metadata, plus OUT.model.yaml: the
`model:` section for a recipe, whose seq_length is max_position_embeddings (a recipe may train at less).
--to-hf writes config.json and model.safetensors (sharded past --max-shard-gb); the model config comes from CKPT's
metadata or, for a training checkpoint, from --recipe. Softmax-routed models become DeepseekV2, sigmoid-routed
ones DeepseekV3 (rope_interleave as the converted checkpoint had it; true for a training checkpoint). Bad input:
one line on stderr, exit code 2; an existing output is never overwritten without --force.
"""
from __future__ import annotations

import json
import os
import sys

import yaml

from oneline import InputError, OneLineParser
from telechat_moe import hf_adapter as hfa
from telechat_moe import hf_config as hfc
from telechat_moe.config import ModelConfig
from telechat_moe.safetensors_io import read_hf_dir, read_safetensors, write_hf_dir, write_safetensors

CONFIG_KEY = "telechat_moe.model_config"
ROPE_KEY = "telechat_moe.hf_rope_interleave"  # "false": the rope rows are in DeepseekV3's rope_interleave=false order
PROG = "convert_hf_checkpoint"


def parse_args(argv):
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to-ours", nargs=2, metavar=("HF_DIR", "OUT"))
    mode.add_argument("--to-hf", nargs=2, metavar=("CKPT", "HF_OUT_DIR"))
    p.add_argument("--recipe", help="--to-hf: recipe whose model section describes CKPT (if CKPT carries no config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="--to-hf: recipe override")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="--to-hf: dtype of the written weights")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="--to-hf: largest safetensors shard")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    return p.parse_args(argv)


def to_ours(hf_dir: str, out: str, force: bool) -> None:
    if not out.endswith(".safetensors"):
        raise hfa.ConversionError(f"--to-ours OUT: expected a .safetensors file name, got {out!r}")
    yaml_path = out[:-len(".safetensors")] + ".model.yaml"
    for path in (out, yaml_path):
        if os.path.exists(path) and not force:
            raise hfa.ConversionError(f"{path}: exists; pass --force to overwrite it")
    hf_config, state = read_hf_dir(hf_dir)
    family = hfc.hf_family(hf_config)
    kwargs = hfc.config_from_hf(hf_config)
    cfg = hfc.model_config(kwargs)
    print(f"read {len(state)} tensors of a {hfa.ARCHITECTURES[family]} from {hf_dir}", flush=True)
    for gap in hfc.semantic_gaps(hf_config):
        print(f"note: {gap}", file=sys.stderr)
    print(f"converting to {cfg.num_hidden_layers} layers + {cfg.num_nextn_predict_layers} MTP ...", flush=True)
    interleaved = hfc.hf_rope_interleaved(hf_config)
    ours = hfa.hf_to_ours(state, cfg, family, interleaved)
    if cfg.yarn_enabled and cfg.original_max_position_embeddings < cfg.seq_length:
        print(f"note: model.seq_length={cfg.seq_length} (max_position_embeddings, YaRN x{cfg.rotary_scaling_factor:g} "
              f"over {cfg.original_max_position_embeddings}): set it lower in a recipe to train at a shorter length",
              file=sys.stderr)
    meta = {CONFIG_KEY: json.dumps(kwargs, sort_keys=True), ROPE_KEY: json.dumps(interleaved)}
    write_safetensors(out, ours, meta, dtype="float32")
    with open(yaml_path, "w") as f:
        yaml.safe_dump({"model": kwargs}, f, sort_keys=False)
    print(f"wrote {len(ours)} parameters to {out} and the model section to {yaml_path}")


def checkpoint_config(meta: dict, recipe: str | None, overrides: list[str], ckpt: str) -> ModelConfig:
    if recipe:
        from telechat_moe.recipe import load_recipe
        return load_recipe(recipe, overrides).model  # a bad recipe: RecipeError, one line
    if CONFIG_KEY not in meta:
        raise hfa.ConversionError(f"{ckpt}: carries no model config; pass --recipe with the model it was trained as")
    return hfc.model_config(json.loads(meta[CONFIG_KEY]))


def to_hf(ckpt: str, out_dir: str, recipe: str | None, overrides: list[str], dtype: str, max_shard_gb: float,
          force: bool) -> None:
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not force:
        raise hfa.ConversionError(f"{out_dir}: exists and is not empty; pass --force to write into it")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise hfa.ConversionError(f"--to-hf HF_OUT_DIR: {out_dir} is a file, expected a folder")
    if max_shard_gb <= 0:
        raise hfa.ConversionError(f"--max-shard-gb: expected a positive size, got {max_shard_gb}")
    if not os.path.isfile(ckpt):
        raise hfa.ConversionError(f"--to-hf CKPT: no such file {ckpt}")
    state, meta = read_safetensors(ckpt)
    cfg = checkpoint_config(meta, recipe, overrides, ckpt)
    interleaved = meta.get(ROPE_KEY) != "false" or cfg.scoring_func != "sigmoid"  # DeepseekV2: always
    hf_config = hfc.hf_config_from(cfg, interleaved)
    for gap in hfc.semantic_gaps(hf_config):
        print(f"note: {gap}", file=sys.stderr)
    family = hfc.hf_family(hf_config)
    hf = hfa.ours_to_hf(state, cfg, family, interleaved)
    used = {e.ours for e in hfa.entries(cfg, family)}
    skipped = sorted(set(state) - used)
    if skipped:
        print(f"note: skipped {len(skipped)} entries that are not model parameters (e.g. {skipped[0]})",
              file=sys.stderr)
    names = write_hf_dir(out_dir, hf_config, hf, dtype, int(max_shard_gb * 2 ** 30))
    print(f"wrote {len(hf)} tensors of a {hf_config['architectures'][0]} ({dtype}) to {out_dir} "
          f"in {len(names)} file(s)")


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        if args.to_ours:
            to_ours(*args.to_ours, args.force)
        else:
            to_hf(*args.to_hf, args.recipe, args.set, args.dtype, args.max_shard_gb, args.force)
    except InputError as exc:  # conversion, checkpoint file or recipe: the message names the field or file
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
