"""Recipes: YAML files with `base:` inheritance and `--set a.b=c` overrides, read into the dataclasses of
recipe_schema.py and checked by recipe_checks.py.

Every error is a `RecipeError` whose message is one line naming the key; the entry point turns it into exit code 2.
"""
from __future__ import annotations

import copy
import difflib
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

import yaml

from telechat_moe.errors import RecipeError
from telechat_moe.recipe_checks import validate
from telechat_moe.recipe_schema import OnOff, Recipe

# Names users bring from other frameworks, pointed at ours.
ALIASES = {"top_k": "num_experts_per_tok", "num_layers": "num_hidden_layers", "num_experts": "n_routed_experts",
           "n_experts": "n_routed_experts", "num_heads": "num_attention_heads", "ffn_hidden_size": "intermediate_size",
           "tensor_parallel": "model_parallel", "pipeline_parallel": "pipeline_stage", "lr": "learning_rate",
           "max_steps": "train_steps", "batch_size": "global_batch_size",
           "max_device_memory": "max_device_memory_gb", "mempool_block_size": "mempool_block_size_gb",
           "jit_config": "jit_level", "train_precision_sync": "deterministic"}
RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"
# Sections nest two levels (model.hidden_size); lists of lists a few more. Deeper is not a recipe (and would
# exhaust the recursion of merging and copying).
MAX_DEPTH = 16


def find_recipe(path: str) -> Path:
    """`1t.yaml`, `1t` and `recipes/1t.yaml` all name the same file."""
    candidates = [Path(path), RECIPE_DIR / path, RECIPE_DIR / f"{path}.yaml"]
    for c in candidates:
        if c.is_file():
            return c
    raise RecipeError(f"--recipe: no recipe file {path!r} (looked in . and {RECIPE_DIR})")


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise RecipeError(f"{path}:{where} is not valid YAML ({getattr(e, 'problem', e)})") from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not a text file (byte {e.start} is not UTF-8); a recipe is YAML text") from None
    except RecursionError:
        raise RecipeError(f"{path}: nested too deeply to be a recipe (sections nest at most {MAX_DEPTH} "
                          f"levels)") from None
    except OSError as e:
        raise RecipeError(f"{path}: cannot read ({e.strerror})") from None
    if data is None:
        raise RecipeError(f"{path}: the recipe file is empty (start it with base: base.yaml, or name a recipe "
                          f"in {RECIPE_DIR})")
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    if _depth(data) > MAX_DEPTH:
        raise RecipeError(f"{path}: nested too deeply to be a recipe (sections nest at most {MAX_DEPTH} levels)")
    return data


def _depth(data) -> int:
    """How deep mappings and lists nest in `data`, up to MAX_DEPTH + 1, counted without recursion; a node that YAML
    anchors share is visited once."""
    deepest, todo, seen = 0, [(data, 1)], set()
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (dict, list)) and id(node) not in seen:
            seen.add(id(node))
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _resolve(path: Path, seen: tuple = ()) -> dict:
    if path.resolve() in seen:
        raise RecipeError(f"{path}: base: chain loops back to itself")
    data = _read_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise RecipeError(f"{path}: base: expected a recipe file name, got {base!r}")
    base_path = path.parent / base
    if not base_path.is_file():
        raise RecipeError(f"{path}: base: no such recipe {base!r} next to it")
    return deep_merge(_resolve(base_path, seen + (path.resolve(),)), data)


def apply_override(raw: dict, assignment: str) -> None:
    """`a.b.c=value`, value parsed as YAML (so 2, 1e-3, true, [1,2] keep their types)."""
    if "=" not in assignment:
        raise RecipeError(f"--set {assignment!r}: expected key.path=value")
    key, value = assignment.split("=", 1)
    parts = key.strip().split(".")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise RecipeError(f"--set {key}: {p} is not a section")
    node[parts[-1]] = parsed


def _coerce(value, tp, key: str):
    if tp is OnOff:
        if isinstance(value, bool):
            return "ON" if value else "OFF"
        if isinstance(value, str) and value.upper() in ("ON", "OFF"):
            return value.upper()
        raise RecipeError(f"{key}: expected ON or OFF, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise RecipeError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise RecipeError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise RecipeError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise RecipeError(f"{key}: expected a string, got {value!r}")
    if tp is list:
        if isinstance(value, list):
            return value
        raise RecipeError(f"{key}: expected a list, got {value!r}")
    return value


def _build(cls, raw, prefix: str):
    if not isinstance(raw, dict):
        raise RecipeError(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = [ALIASES[key]] if ALIASES.get(key) in names else \
                difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.6)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise RecipeError(f"{full}: unknown key{hint}")
        tp = hints[key]
        kwargs[key] = _build(tp, value, f"{full}.") if is_dataclass(tp) else _coerce(value, tp, full)
    return cls(**kwargs)


def load_recipe(path: str, overrides: list[str] = ()) -> Recipe:
    file = find_recipe(path)
    raw = _resolve(file)
    for assignment in overrides:
        apply_override(raw, assignment)
    raw.setdefault("name", file.stem)
    recipe = _build(Recipe, raw, "")
    validate(recipe)
    return recipe
