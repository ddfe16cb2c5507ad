"""The package's layout rules, read from the source: no import cycles between kvcache's
modules (lazy imports inside functions count), and no module imports another's private
names (``from kvcache.x import _name``; the native ``kvcache._core`` is the exception: its
names are the bindings)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "kvcache"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str, int]]:
    """``(module, imported name or "", line)`` for every kvcache import of the module,
    type-checking-only imports left out (they run no code)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom):
                module = child.module or ""
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    module = ".".join([*base, module] if module else base)
                if module.split(".")[0] == "kvcache":
                    found.extend((module, a.name, child.lineno) for a in child.names)
            elif isinstance(child, ast.Import):
                kv = [a.name for a in child.names if a.name.startswith("kvcache")]
                found.extend((module, "", child.lineno) for module in kv)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, imported, _ in _imports(name, path):
            if imported == "_core":
                continue  # the native extension imports nothing of the package
            target = f"{module}.{imported}" if f"{module}.{imported}" in MODULES else module
            if target in MODULES and target != name:
                graph[name].add(target)
            # ``import kvcache.x.y`` runs kvcache and kvcache.x first: not an edge to follow
            # (a package's __init__ importing its own modules is no cycle of the layout).
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_checks_see_the_package() -> None:
    assert {"kvcache", "kvcache.cache.manager", "kvcache.simulate.loop"} <= set(MODULES)
    graph = _graph()
    assert "kvcache.cache.manager" in graph["kvcache.serving.resource_manager"]
    assert graph["kvcache.engine"] == {"kvcache.reference.engine"}  # a documented path
    assert (_room("kvcache.engine"), _room("kvcache.fleet.router")) == ("kvcache", "fleet")
    assert "kvcache.simulate.fleet" in graph["kvcache.simulate.command"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_no_module_imports_another_modules_private_names() -> None:
    bad = []
    for name, path in MODULES.items():
        for module, imported, line in _imports(name, path):
            private = imported.startswith("_") and not imported.startswith("__")
            if private and imported != "_core" and f"{module}.{imported}" not in MODULES:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module}.{imported}")
    assert bad == []


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("kvcache.cache.fields", ["check_type", "MAX_TOKEN", "optional_int", "positive_int"]),
        ("kvcache.cache.block_keys", ["block_hashes", "key_kwargs"]),
        ("kvcache.simulate.options", ["EngineOptions", "engine_options"]),
    ],
)
def test_shared_helpers_are_public_where_they_live(module: str, names: list[str]) -> None:
    """What several modules use lives once, under a public name, in one module."""
    source = MODULES[module].read_text(encoding="utf-8")
    tree = ast.parse(source)
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert set(names) <= defined


#: The rooms in layers: a module may import its own room, the package's top-level modules
#: and the rooms of lower layers only (the arrows of docs/design.md).
LAYERS = [
    {"cache"},
    {"models", "serving"},
    {"fleet", "reference"},
    {"simulate", "vllm"},
    {"cli"},
]


def _room(module: str) -> str:
    parts = module.split(".")
    if (
        len(parts) == 2
        and f"kvcache.{parts[1]}" in MODULES
        and not (PACKAGE / parts[1] / "__init__.py").exists()
    ):
        return "kvcache"  # a top-level module: the package API or a documented path
    return parts[1] if len(parts) > 1 else "kvcache"


def test_rooms_import_only_lower_layers() -> None:
    layer = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
    rooms = {_room(m) for m in MODULES} - {"kvcache"}
    assert rooms == set(layer)  # every room has its place
    bad = []
    for name, targets in _graph().items():
        here = _room(name)
        for target in targets:
            there = _room(target)
            if here == "kvcache" or there in ("kvcache", here):
                continue
            if layer[there] >= layer[here]:
                bad.append(f"{name} -> {target}")
    assert bad == []
