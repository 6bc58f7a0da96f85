"""The fused kernels of a MindSpore IR dump: which operators each holds and the intermediate tensors it removed.

    python -m dvm_fusion.report IR_DIR [--all] [--json FILE]

IR_DIR is a `save_graphs` folder (the recipe's `fusion.save_graphs: true` writes `<output_dir>/graphs`; any
MindSpore run with MS_DEV_SAVE_GRAPHS=1 does). The report reads the built kernel graphs, `graph_build_*.ir` (one per
compiled kernel graph, in any subfolder such as rank_0/), where graph-kernel fusion has already run: each fused kernel
is a subgraph whose attributes say `graph_kernel: <ops>_fusion`, called from its graph by a node whose full name is
`.../GraphKernel_<ops>_fusion-opN` (AKG's fusions on CPU; on Ascend at jit_level O1 the same nodes are DVM's).

For each fused kernel: its name and scope, the operators inside in order, and the intermediate tensors removed:
the values its operators produce that only other operators inside it consume (every value of the subgraph but its
outputs), counted with their bytes where the IR gives shape and dtype (a dynamic shape, -1, is counted without bytes).
Those tensors would otherwise be written to memory by one kernel and read back by the next.
A folder without such files, or a file that is not MindSpore IR, is one line and exit code 2.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from oneline import InputError, OneLineParser

DTYPE_BYTES = {"Float64": 8, "Float32": 4, "Float16": 2, "BFloat16": 2, "Int64": 8, "Int32": 4, "Int16": 2,
               "Int8": 1, "UInt64": 8, "UInt32": 4, "UInt16": 2, "UInt8": 1, "Bool": 1, "Complex64": 8,
               "Complex128": 16}
IR_GLOB = "graph_build_*.ir"
# Nodes that move no data: not counted as operators of a fused kernel
STRUCTURAL = {"MakeTuple", "TupleGetItem", "Return", "Depend", "UpdateState", "Load"}

_NODE = re.compile(r"^\s+%(\w+)\([^)]*\) = (?:PrimFunc_)?([\w.]+)\((.*)$")
_CALL = re.compile(r"^\s+%(\w+)\([^)]*\) = call @([\w.]+)\(")
_RETURN = re.compile(r"^\s+Return\((.*)\)")
_SUBGRAPH = re.compile(r"^subgraph @([\w.]+)\(")
_TENSOR = re.compile(r"<Tensor\[(\w+)\], \(([-\d, ]*)\)")
_SCOPE = re.compile(r"# Fullname with scope: \((.*)\)")


class FusionReportError(InputError):
    """An IR folder that cannot be reported; one line naming it."""


@dataclass
class Tensor:
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int | None:
        if any(d < 0 for d in self.shape) or self.dtype not in DTYPE_BYTES:
            return None
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass
class Node:
    value: str                  # %0, %1 ...
    op: str                     # Mul, call, ...
    args: list[str]             # the %values it reads
    outputs: list[Tensor]
    scope: str = ""
    inputs: list[Tensor] = field(default_factory=list)  # the tensors it reads, where the IR gives their types


@dataclass
class Subgraph:
    name: str
    attrs: dict[str, str]
    nodes: list[Node] = field(default_factory=list)
    returned: list[str] = field(default_factory=list)


@dataclass
class FusedKernel:
    name: str                   # GraphKernel_Mul_Add_fusion-op3 (the calling node's name), or the fusion's name
    scope: str                  # the cell scope its operators share (else the most specific one's)
    ops: list[str]              # the operators inside, in order
    intermediates: int          # values produced and consumed inside the kernel
    intermediate_bytes: int     # their bytes (those of known shape)
    unknown_shapes: int         # intermediates whose bytes the IR does not fix (dynamic shapes)
    file: str


def _types(type_line: str, side: int) -> list[Tensor]:
    """`: (inputs) -> (outputs)` -> the input (side 0) or output (side 1) tensors."""
    if "->" not in type_line:
        return []
    return [Tensor(dtype, tuple(int(d) for d in dims.replace(" ", "").split(",") if d))
            for dtype, dims in _TENSOR.findall(type_line.split("->", 1)[side])]


def parse_ir(text: str, path: Path) -> list[Subgraph]:
    """The subgraphs of one MindSpore .ir file, each with its attributes and nodes."""
    if "# IR entry:" not in text[:2000] and "subgraph @" not in text:
        raise FusionReportError(f"{path}: not a MindSpore IR file (no '# IR entry:' header)")
    graphs, attrs, current, in_attrs, last = [], {}, None, False, None
    for line in text.splitlines():
        if line.startswith("subgraph attr:"):
            attrs, in_attrs = {}, True
            continue
        m = _SUBGRAPH.match(line)
        if m:
            current, in_attrs, last = Subgraph(m.group(1), attrs), False, None
            graphs.append(current)
            attrs = {}
            continue
        if in_attrs:
            if ":" in line:
                key, value = line.split(":", 1)
                attrs[key.strip()] = value.strip()
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current, last = None, None
            continue
        m = _CALL.match(line)
        if m:
            last = Node(m.group(1), "call", [m.group(2)], [])
            current.nodes.append(last)
            continue
        m = _NODE.match(line)
        if m:
            last = Node(m.group(1), m.group(2), re.findall(r"%(\w+)", m.group(3)), [])
            current.nodes.append(last)
            continue
        m = _RETURN.match(line)
        if m:
            current.returned = re.findall(r"%(\w+)", m.group(1))
            last = None
            continue
        stripped = line.strip()
        if last is not None and stripped.startswith(": (") and not last.outputs:     # the first: abstract types
            last.inputs, last.outputs = _types(stripped, 0), _types(stripped, 1)
        m = _SCOPE.search(stripped)
        if m and last is not None and not last.scope:
            last.scope = m.group(1)
    return graphs


def _common_scope(scopes: list[str]) -> str:
    """The deepest cell scope every one of `scopes` (full op names) lies in: where a fused kernel's operators come
    from (the call node of a kernel graph keeps only the graph's root scope)."""
    # an expander's operator (Expand/_SiLU/Mul-op0) keeps no cell scope
    parts = [s.split("/")[:-1] for s in scopes if not s.startswith("Expand/")] or [s.split("/")[:-1] for s in scopes]
    common = []
    for level in zip(*parts) if parts else ():
        if len(set(level)) > 1:
            break
        common.append(level[0])
    if len(common) > 1 or not parts:
        return "/".join(common)
    # operators of several cells: the most specific one's
    return "/".join(max(parts, key=len))


def fused_kernels(graphs: list[Subgraph], file: str) -> list[FusedKernel]:
    """The fused kernels of one IR file, in the order their calls appear."""
    bodies = {g.name: g for g in graphs if "graph_kernel" in g.attrs}
    calls: dict[str, list[str]] = {}
    for g in graphs:
        for node in g.nodes:
            if node.op == "call" and node.args and node.args[0] in bodies:
                calls.setdefault(node.args[0], []).append(node.scope)
    out = []
    for name, body in bodies.items():
        by_value = {n.value: n for n in body.nodes}
        outputs = set()
        for v in body.returned:     # a returned MakeTuple's elements are the kernel's outputs
            node = by_value.get(v)
            outputs |= set(node.args) if node is not None and node.op == "MakeTuple" else {v}
        ops = [n for n in body.nodes if n.op not in STRUCTURAL]
        inner = [n for n in ops if n.value not in outputs]
        sizes = [t.nbytes for n in inner for t in n.outputs]
        inside = _common_scope([n.scope for n in ops if n.scope])
        for scope in calls.get(name, [""]):
            where, _, call_name = scope.rpartition("/")
            out.append(FusedKernel(call_name or f"GraphKernel_{body.attrs['graph_kernel']}",
                                   inside if len(inside) > len(where) else where,
                                   [n.op for n in ops], len(inner), sum(s for s in sizes if s is not None),
                                   sum(s is None for s in sizes), file))
    return out


def read_dump(folder: Path) -> dict[str, list[FusedKernel]]:
    """Every built kernel graph's fused kernels: file (relative to `folder`) -> kernels."""
    if not folder.is_dir():
        raise FusionReportError(f"{folder}: no such folder")
    files = sorted(folder.rglob(IR_GLOB))
    if not files:
        raise FusionReportError(f"{folder}: no MindSpore IR dump ({IR_GLOB}); train with --set fusion.save_graphs=true "
                                f"(or MS_DEV_SAVE_GRAPHS=1)")
    out = {}
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise FusionReportError(f"{path}: cannot read ({e.strerror})") from None
        rel = str(path.relative_to(folder))
        out[rel] = fused_kernels(parse_ir(text, path), rel)
    return out


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 2 ** 20 else f"{n / 2 ** 20:.2f} MiB"


def report(dump: dict[str, list[FusedKernel]], show_all: bool = False, per_graph: int = 20) -> str:
    kernels = [k for ks in dump.values() for k in ks]
    lines = [f"{len(kernels)} fused kernels in {sum(bool(ks) for ks in dump.values())} of {len(dump)} kernel graphs; "
             f"{sum(k.intermediates for k in kernels)} intermediate tensors removed "
             f"({_kib(sum(k.intermediate_bytes for k in kernels))}"
             + (f"; {sum(k.unknown_shapes for k in kernels)} of dynamic shape" if any(k.unknown_shapes
                                                                                         for k in kernels) else "")
             + ")"]
    for file, ks in dump.items():
        if not ks:
            continue
        lines += ["", f"{file}: {len(ks)} fused kernels, {sum(k.intermediates for k in ks)} intermediates removed "
                      f"({_kib(sum(k.intermediate_bytes for k in ks))})"]
        shown = ks if show_all else sorted(ks, key=lambda k: -k.intermediate_bytes)[:per_graph]
        for k in shown:
            lines.append(f"  {k.name}: {' -> '.join(k.ops)}; {k.intermediates} intermediate"
                         f"{'s' if k.intermediates != 1 else ''} removed ({_kib(k.intermediate_bytes)})"
                         + (f"  [{k.scope}]" if k.scope else ""))
        if len(shown) < len(ks):
            lines.append(f"  ... {len(ks) - len(shown)} more (--all lists every one)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m dvm_fusion.report", description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="a save_graphs folder (fusion.save_graphs_path, default <output_dir>/graphs)")
    ap.add_argument("--all", action="store_true", help="every fused kernel (default: the 20 that remove the most "
                                                       "bytes per graph)")
    ap.add_argument("--json", help="also write every fused kernel as JSON")
    args = ap.parse_args(argv)
    try:
        dump = read_dump(Path(args.folder))
    except InputError as e:
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return 2
    print(report(dump, args.all))
    if args.json:
        Path(args.json).write_text(json.dumps({f: [asdict(k) for k in ks] for f, ks in dump.items()}, indent=1),
                                   encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
