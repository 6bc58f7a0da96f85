"""Imports point one way (the README's map): `oneline` below everything; the libraries data_sched, dvm_fusion,
parallel and precision import nothing from the application or the entry points; telechat_moe imports no entry
point. Every import is read from the source (ast), those inside functions included, so a lazy import cannot hide
a dependency."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("data_sched", "dvm_fusion", "parallel", "precision")
APPLICATION = ("telechat_moe",)
ENTRY_POINTS = ("run_train", "scripts", "bench")
PROJECT = ("oneline",) + LIBRARIES + APPLICATION + ENTRY_POINTS
# What each layer may not import.
FORBIDDEN = {"oneline": PROJECT,
             **{lib: APPLICATION + ENTRY_POINTS for lib in LIBRARIES},
             "telechat_moe": ENTRY_POINTS}


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; relative imports resolved against its package."""
    package = path.relative_to(root).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                found.append((node.lineno, ".".join(base + ((node.module,) if node.module else ()))))
            elif node.module:
                found.append((node.lineno, node.module))
    return found


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for layer, forbidden in FORBIDDEN.items():
        for path in sorted((root / layer).rglob("*.py")):
            for line, module in imported_modules(path, root):
                if module.split(".")[0] in forbidden:
                    bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


def test_imports_point_one_way():
    bad = violations()
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_check_sees_function_local_and_relative_imports(tmp_path):
    lib = tmp_path / "parallel" / "planner"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("")
    (lib / "sneaky.py").write_text("def f():\n    from telechat_moe.trainer import Trainer\n    return Trainer\n")
    (lib / "fine.py").write_text("from . import sneaky\nfrom parallel.layout import ParallelLayout\n")
    assert imported_modules(lib / "fine.py", tmp_path) == [(1, "parallel.planner"), (2, "parallel.layout")]
    assert violations(tmp_path) == ["parallel/planner/sneaky.py:2 imports telechat_moe.trainer"]
