"""The import directions between k3's top-level packages, and no import cycles between its modules.

Layers, lowest first (a package may import its own layer's packages only where no cycle results, and any lower
layer): {config, tables, fs} <- ops <- model <- {quant, checkpoint} <- {data, vision} <- {train, infer,
distributed, convert} <- {audit, plan, bench} <- cli. ``fs`` (atomic writes) is at the bottom so that writing a
file couples nothing to checkpoints; ``checkpoint`` (formats, loading, run checkpoints) is below everything that
reads or writes one. Every import counts, also one inside a function (a lazy import still couples the packages).
The package ``k3`` itself (its ``__init__``: the public shortcuts) and ``k3.__main__`` are exempt."""

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "k3"
LAYERS = [
    ("config", "tables", "fs"),
    ("ops",),
    ("model",),
    ("quant", "checkpoint"),
    ("data", "vision"),
    ("train", "infer", "distributed", "convert"),
    ("audit", "plan", "bench"),
    ("cli",),
]
LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _module(path: Path) -> str:
    parts = ["k3", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the k3 modules it imports (``from a.b import c`` counts a.b, and a.b.c where that is a module)."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    out: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            out[name].update(t for t in targets if t in modules and t != name)
    return out


IMPORTS = _imports()


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else None


def test_every_package_has_a_layer():
    packages = {p for m in IMPORTS for p in [_package(m)] if p}
    assert packages <= set(LEVEL), f"packages without a layer: {sorted(packages - set(LEVEL))}"


def upward(imports: dict[str, set[str]]) -> list[str]:
    """``module -> target`` for every import of a package in a higher layer than the importer's."""
    return sorted(
        f"{m} -> {t}"
        for m, targets in imports.items()
        for t in targets
        if _package(m) and _package(t) and LEVEL[_package(t)] > LEVEL[_package(m)]
    )


def test_imports_point_down_the_layers():
    wrong = upward(IMPORTS)
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "importer,target,wrong",
    [
        ("k3.checkpoint.run", "k3.train.trainer", True),  # checkpoints are below training
        ("k3.checkpoint.load", "k3.infer.load", True),
        ("k3.fs", "k3.checkpoint.format", True),  # atomic writes import nothing above the bottom
        ("k3.fs", "k3.config.config", False),
        ("k3.checkpoint.format", "k3.quant.packed", False),
        ("k3.train.trainer", "k3.checkpoint.run", False),
        ("k3.convert", "k3.checkpoint.load", False),
        ("k3.convert", "k3.cli.main", True),
    ],
)
def test_an_upward_import_is_found(importer, target, wrong):
    assert (upward({importer: {target}}) == [f"{importer} -> {target}"]) == wrong


def test_checkpoint_and_fs_sit_where_the_layers_say():
    """Everything that reads or writes a checkpoint is above it; atomic writes are at the bottom."""
    assert LEVEL["fs"] == LEVEL["config"] == 0
    assert LEVEL["model"] < LEVEL["checkpoint"] == LEVEL["quant"]
    assert all(LEVEL["checkpoint"] < LEVEL[p] for p in ("data", "train", "infer", "distributed", "convert"))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its nodes in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for t in sorted(graph.get(n, ())):
            if state.get(t) == 1:
                return stack[stack.index(t) :] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_cycle_between_packages():
    graph: dict[str, set[str]] = defaultdict(set)
    for m, targets in IMPORTS.items():
        for t in targets:
            if _package(m) and _package(t) and _package(m) != _package(t):
                graph[_package(m)].add(_package(t))
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_cycle_between_modules():
    """A package's ``__init__`` re-exporting its submodules is no cycle: edges into a package's own children from
    its ``__init__`` are left out."""
    graph = {m: {t for t in targets if not t.startswith(m + ".")} for m, targets in IMPORTS.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_infer_does_not_import_train():
    assert not [m for m, ts in IMPORTS.items() if _package(m) == "infer" for t in ts if _package(t) == "train"]


@pytest.mark.parametrize(
    "graph,cyclic", [({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True), ({"a": {"b", "c"}, "b": {"c"}}, False)]
)
def test_cycle_finder(graph, cyclic):
    assert (_cycle(graph) is not None) == cyclic


def test_no_private_name_is_imported_across_packages():
    """A leading underscore means "this package's own": no other top-level package imports it."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        pkg = path.relative_to(ROOT).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("k3."):
                other = node.module.split(".")[1]
                bad += [
                    f"{path.relative_to(ROOT.parent)}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and other != pkg
                ]
    assert not bad, "\n".join(bad)


def test_code_cites_the_architecture_doc_not_an_outside_spec():
    """Mechanisms are cited as docs/architecture.md#<anchor> (anchors that exist), not by an outside spec's
    section numbers."""
    anchors = {
        "#" + re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^## (.+)$", (ROOT.parent / "docs" / "architecture.md").read_text(), re.M)
    }
    bad = []
    for path in sorted([*ROOT.rglob("*.py"), *(ROOT.parent / "tests").rglob("*.py")]):
        text = path.read_text()
        bad += [f"{path.relative_to(ROOT.parent)}: spec section" for _ in re.findall(r"\bspec §\d", text)]
        bad += [
            f"{path.relative_to(ROOT.parent)}: {a}"
            for a in re.findall(r"docs/architecture\.md(#[a-z0-9-]+)", text)
            if a not in anchors
        ]
    assert not bad, "\n".join(bad)


def test_no_module_reads_the_repository():
    """The installed package reads only its own files and what it is given: no path built from ``__file__`` leaves
    the package (``parents[N]`` towards a checkout's benchmarks/ or docs/)."""
    found = [
        f"{p.relative_to(ROOT.parent)}:{i}"
        for p in ROOT.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"parents\[\d+\]", line) and not line.lstrip().startswith("#")
    ]
    assert not found, f"paths outside the package: {found}"


def hidden_attributes(root: Path) -> list[str]:
    """Where the modules under ``root`` read or write an ``x._k3_*`` attribute, directly or by name through
    setattr / getattr / hasattr / delattr."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "getattr", "hasattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
            ):
                name = node.args[1].value
            if isinstance(name, str) and name.startswith("_k3_"):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {name}")
    return found


def test_no_state_hidden_in_k3_attributes_of_tensors_or_modules():
    """State lives in explicit values and classes (k3.ops.segments.Segments, the CP shard, Recomputed sub-layers),
    not in ``_k3_*`` attributes attached to tensors or modules."""
    found = hidden_attributes(ROOT)
    assert not found, "hidden attributes:\n" + "\n".join(found)


def test_hidden_attribute_finder(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("t._k3_host = [0]\nok = is_k3_shaped(t)\n")
    (pkg / "b.py").write_text("v = getattr(m, '_k3_cp', None)\n")
    assert hidden_attributes(pkg) == ["pkg/a.py:1 _k3_host", "pkg/b.py:1 _k3_cp"]
