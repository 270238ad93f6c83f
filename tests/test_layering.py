"""The package's imports run one way: each folder (or top-level module) imports only from its own
layer or the layers below it, and no two of them import each other, directly or around a loop.
Function-level imports count as much as module-level ones. The table is docs/architecture.md's.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ds4ref"

# Bottom to top: a unit (a folder of ds4ref/, or a top-level module) may import its own layer
# and the layers below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("settings", "console"),  # DS4REF_* variables; counts in messages, --help, progress bars
    ("gguf",),                # the model file: config, metadata, tensors, quant codes, reader/writer,
                              # weights, tokenizer, the embedded tiny model
    ("numerics",),            # the canonical float32 arithmetic, the FP8/FP4 grids, the tables derived
                              # from the config (RoPE, Hadamard): what both backends compute
    ("convert",),             # HF checkpoints to GGUF
    ("backend",),             # the protocol between the scheduler and the backends
    ("paging",),              # pages, block tables, page layout, compact rows, the memory plan
    ("reference",),           # the exact model and NumpyBackend
    ("scheduler",),           # SeqEngine, Scheduler, sampling, Engine
    ("hip",),                 # the GPU backend
    ("harness",),             # the GPU op twins and the op-case table, checked against the reference
    ("model",),               # ds4ref.load: a model file with its backends
    ("serve",),               # the OpenAI-compatible server
    ("cli",),                 # command-line tools
    ("diff",),                # cross-engine dumps of intermediates and their comparison
)
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path) -> set[str]:
    """Every ds4ref module `path` imports, anywhere in the file, resolved to absolute names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "ds4ref"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ds4ref":
                continue
            for alias in node.names:  # `from . import ops` imports the module ops
                sub = f"{target}.{alias.name}"
                found.add(sub if is_module(sub) else target)
    return found


def unit(module: str) -> str | None:
    """The folder or top-level module a module belongs to (None: the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def unit_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod, deps in modules.items():
        if unit(mod) is None:
            continue
        graph.setdefault(unit(mod), set()).update(u for u in map(unit, deps) if u not in (None, unit(mod)))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A loop of edges in `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (loop := visit(nxt, path + [node])):
                return loop
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (loop := visit(start, [])):
            return loop
    return None


def upward_imports(modules: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(modules.items()):
        here = unit(mod)
        for dep in sorted(deps):
            there = unit(dep)
            if here is not None and (there is None or LAYER_OF[there] > LAYER_OF[here]):
                bad.append(f"{mod} imports {dep} ({there or 'the package root'} is above {here})")
    return bad


@pytest.fixture(scope="module")
def modules() -> dict[str, set[str]]:
    return {module_name(p): imported_modules(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_unit_has_a_layer(modules):
    assert set(unit_graph(modules)) <= set(LAYER_OF), set(unit_graph(modules)) - set(LAYER_OF)
    assert {unit(m) for m in modules} - {None} == set(LAYER_OF), "a layer names a unit the package lacks"


def test_imports_point_down_the_layers(modules):
    assert upward_imports(modules) == []


def test_no_import_cycle_between_units(modules):
    assert find_cycle(unit_graph(modules)) is None


def test_no_import_cycle_between_modules(modules):
    graph = {m: {d for d in deps if d != m and not (m.startswith(d + ".") and is_package(d))}
             for m, deps in modules.items()}
    assert find_cycle(graph) is None


def is_package(name: str) -> bool:
    return (PACKAGE.parent.joinpath(*name.split(".")) / "__init__.py").is_file()


def test_the_gpu_backend_builds_on_the_numerics_not_on_the_reference(modules):
    """hip/ shares the arithmetic and the config's tables with the reference through numerics/;
    the comparison with NumPy lives in the harness and the tests."""
    bad = sorted(f"{m} imports {d}" for m, deps in modules.items() if unit(m) == "hip"
                 for d in deps if unit(d) == "reference")
    assert bad == []


def test_the_checks_catch_an_upward_import_and_a_cycle():
    up = {"ds4ref.gguf.config": {"ds4ref.hip.launch"}, "ds4ref.hip.launch": {"ds4ref.gguf.config"}}
    assert upward_imports(up) == ["ds4ref.gguf.config imports ds4ref.hip.launch (hip is above gguf)"]
    assert find_cycle(unit_graph(up)) in (["gguf", "hip", "gguf"], ["hip", "gguf", "hip"])
    assert upward_imports({"ds4ref.paging.plan": {"ds4ref"}}) != []


def test_the_architecture_page_carries_the_table():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for i, units in enumerate(LAYERS):
        assert f"| {i} | {', '.join(f'`{u}`' for u in units)} |" in text, units
