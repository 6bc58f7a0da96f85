"""Imports point one way (the README's map): `oneline` below everything; the libraries data_sched, dvm_fusion,
parallel and precision import nothing from the application or the entry points; telechat_moe imports no entry
point; no module imports itself through others (no import circle). Every import is read from the source (ast),
those inside functions included, so a lazy import cannot hide a dependency. And modules stay of one concern: none
above MAX_MODULE_LINES lines, no function above MAX_FUNCTION_LINES."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("data_sched", "dvm_fusion", "parallel", "precision")
APPLICATION = ("telechat_moe",)
ENTRY_POINTS = ("run_train", "scripts", "bench")
PROJECT = ("oneline",) + LIBRARIES + APPLICATION + ENTRY_POINTS
# Each module and function of these (the application, the libraries, the entry points) within the limits.
SIZED = PROJECT + ("run_train.py",)
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100
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


def project_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for top in SIZED for p in ([root / top] if top.endswith(".py") else (root / top).rglob("*.py"))
                  if p.is_file())


def oversized(root: Path = ROOT) -> list[str]:
    """Modules above MAX_MODULE_LINES lines and functions (methods included) above MAX_FUNCTION_LINES."""
    found = []
    for path in project_files(root):
        text = path.read_text()
        name = path.relative_to(root)
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Project module -> the project modules it imports; `from package import module` is an edge to the module,
    `from module import name` to the module."""
    modules = {module_name(p, root): p for p in project_files(root)}
    graph = {}
    for name, path in modules.items():
        targets = set()
        tree = ast.parse(path.read_text(), str(path))
        package = path.relative_to(root).with_suffix("").parts[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ((node.module,) if node.module else ()))
                for a in node.names:
                    if f"{base}.{a.name}" in modules:
                        targets.add(f"{base}.{a.name}")
                    elif base in modules:
                        targets.add(base)
        graph[name] = targets - {name}
    return graph


def import_circles(root: Path = ROOT) -> list[list[str]]:
    """The strongly connected components of more than one module in the import graph (Tarjan's algorithm,
    iterative), each sorted."""
    graph = import_graph(root)
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_modules_and_functions_stay_within_the_limits():
    found = oversized()
    assert not found, f"above {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function:\n" + "\n".join(found)


def test_no_import_circle():
    circles = import_circles()
    assert not circles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_checks_see_long_modules_long_functions_and_circles(tmp_path):
    app = tmp_path / "telechat_moe"
    app.mkdir()
    (app / "__init__.py").write_text("")
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (app / "long.py").write_text("def f():\n" + body + "\n" + "\n" * MAX_MODULE_LINES)
    (app / "short.py").write_text("def g():\n" + "\n".join(f"    y{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1)) + "\n")
    (app / "a.py").write_text("from telechat_moe import b\n")
    (app / "b.py").write_text("def late():\n    from telechat_moe.c import h\n    return h\n")
    (app / "c.py").write_text("from .a import b\nh = b\n")
    (app / "d.py").write_text("import telechat_moe.a\nfrom telechat_moe.short import g\n")
    lines = MAX_FUNCTION_LINES + 1 + MAX_MODULE_LINES
    assert oversized(tmp_path) == [f"telechat_moe/long.py: {lines} lines",
                                   f"telechat_moe/long.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]
    assert import_graph(tmp_path)["telechat_moe.c"] == {"telechat_moe.a"}
    assert import_circles(tmp_path) == [["telechat_moe.a", "telechat_moe.b", "telechat_moe.c"]]
