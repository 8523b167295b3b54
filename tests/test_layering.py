"""Imports point one way: an `ast` scan of every module under k31c/ (imports inside functions
count too: a lazy import is still a dependency).

Rooms, bottom up; a module may import its own room and the rooms its room lists:
    base      config (+ config_values, presets), errors, paths, fsutil, host, tokenizer,
              checkpoint_files, dynamo_registry, compile_cache
    (graph)   checkpoint.py, checkpoint_save.py sit with graph/: reading and writing build the model
    graph     k31c/graph/            base
    lowering  k31c/lowering/         base, graph
    passes    k31c/passes/           base, graph, lowering
    runtime   k31c/runtime/          base, graph, lowering
    api       api.py, options.py, cached_program.py, compile_report.py, backend.py: everything below
    cli       cli/, __main__, the package's __init__ (lazy re-exports): everything
Besides: no import cycle between modules, no private name (`_x`) imported from another module
(modules share code through public contracts), and no torch.fx in k31c/runtime/ (the runtime
executes programs; graphs are the compiler's business).

KNOWN lists what is being fixed on another branch; each entry fails the test once it is gone, so
the list cannot outlive the fix.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "k31c"
BASE = {"k31c.config", "k31c.config_values", "k31c.presets", "k31c.errors", "k31c.paths", "k31c.fsutil",
        "k31c.tokenizer", "k31c.host", "k31c.checkpoint_files", "k31c.dynamo_registry", "k31c.compile_cache"}
GRAPH_LEVEL = {"k31c.checkpoint", "k31c.checkpoint_save"}   # they build the model (graph/model.py)
TOP = {"k31c", "k31c.__main__"}
ORDER = ("base", "graph", "lowering", "passes", "runtime", "api", "cli")
ALLOWED = {
    "base": {"base"},
    "graph": {"base", "graph"},
    "lowering": {"base", "graph", "lowering"},
    "passes": {"base", "graph", "lowering", "passes"},
    "runtime": {"base", "graph", "lowering", "runtime"},
    "api": set(ORDER) - {"cli"},
    "cli": set(ORDER),
}

# Knots being untied elsewhere (branch: what): (importer, imported) for room breaks, a frozenset
# of modules for a cycle.
KNOWN_ROOM_BREAKS: set = set()
KNOWN_PRIVATE_IMPORTS: set = set()
KNOWN_CYCLES: set = set()


def room(module: str) -> str:
    if module in BASE:
        return "base"
    if module in GRAPH_LEVEL:
        return "graph"
    if module in TOP:
        return "cli"
    if module in ("k31c.api", "k31c.options", "k31c.cached_program", "k31c.compile_report", "k31c.backend"):
        return "api"
    part = module.split(".")[1]
    if part in ("graph", "lowering", "passes", "runtime"):
        return part
    if part == "cli":
        return "cli"
    raise AssertionError(f"{module}: no room for it in tests/test_layering.py; add it to one")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def scan(root: Path = ROOT) -> dict[str, dict]:
    """module -> {"imports": {k31c modules it imports}, "private": {(module, _name) it imports},
    "fx": [lines using torch.fx]}."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    out = {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        imports, private, fx = set(), set(), []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "torch.fx" or alias.name.startswith("torch.fx."):
                        fx.append(node.lineno)
                    if alias.name.startswith("k31c"):
                        imports.add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                if src == "torch.fx" or src.startswith("torch.fx.") or \
                        (src == "torch" and any(a.name == "fx" for a in node.names)):
                    fx.append(node.lineno)
                if src.startswith("k31c"):
                    for alias in node.names:     # `from . import ops` imports the module k31c.graph.ops
                        sub = f"{src}.{alias.name}"
                        imports.add(sub if sub in files else src)
                        if alias.name.startswith("_") and not alias.name.startswith("__") and sub not in files:
                            private.add((src, alias.name))
            elif isinstance(node, ast.Attribute) and node.attr == "fx" and \
                    isinstance(node.value, ast.Name) and node.value.id == "torch":
                fx.append(node.lineno)
        out[mod] = {"imports": {i for i in imports if i in files and i != mod},
                    "private": {(m, n) for m, n in private if m != mod}, "fx": fx}
    return out


def room_breaks(modules: dict[str, dict]) -> set[tuple[str, str]]:
    return {(mod, dep) for mod, info in modules.items() for dep in info["imports"]
            if room(dep) not in ALLOWED[room(mod)]}


def cycles(graph: dict[str, set[str]]) -> set[frozenset]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], set()
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = set()
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        scc.add(m)
                        if m == node:
                            break
                    if len(scc) > 1:
                        found.add(frozenset(scc))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


@pytest.fixture(scope="module")
def modules():
    return scan()


def test_every_module_has_a_room(modules):
    assert len(modules) > 40
    for mod in modules:
        room(mod)


def test_imports_follow_the_room_order(modules):
    breaks = room_breaks(modules)
    new = sorted(breaks - KNOWN_ROOM_BREAKS)
    assert not new, "imports against the room order:\n" + "\n".join(
        f"  {a} ({room(a)}) imports {b} ({room(b)})" for a, b in new)
    fixed = sorted(KNOWN_ROOM_BREAKS - breaks)
    assert not fixed, f"fixed, remove from KNOWN_ROOM_BREAKS: {fixed}"


def test_no_import_cycles(modules):
    found = cycles({m: info["imports"] for m, info in modules.items()})
    new = [sorted(c) for c in found - KNOWN_CYCLES]
    assert not new, f"import cycles: {new}"
    fixed = [sorted(c) for c in KNOWN_CYCLES - found]
    assert not fixed, f"fixed, remove from KNOWN_CYCLES: {fixed}"


def test_no_private_names_across_modules(modules):
    found = {(mod, src) for mod, info in modules.items() for src, _ in info["private"]}
    new = sorted(found - KNOWN_PRIVATE_IMPORTS)
    assert not new, "private names imported from another module:\n" + "\n".join(
        f"  {a} imports {sorted(n for m, n in modules[a]['private'] if m == b)} from {b}" for a, b in new)
    fixed = sorted(KNOWN_PRIVATE_IMPORTS - found)
    assert not fixed, f"fixed, remove from KNOWN_PRIVATE_IMPORTS: {fixed}"


def test_runtime_does_not_use_torch_fx(modules):
    users = {m: info["fx"] for m, info in modules.items() if room(m) == "runtime" and info["fx"]}
    assert not users, f"torch.fx in the runtime: {users}"


def test_every_public_name_of_the_package_resolves():
    """`k31c.X` for each name in `k31c.__all__`, in a fresh process (a lazy re-export pointing at
    a module that no longer defines the name fails only when someone uses it)."""
    code = "import k31c; missing = [n for n in k31c.__all__ if not hasattr(k31c, n)]; print(missing)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT.parent)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# ---- the checks themselves, on synthetic module maps ------------------------------------------

def test_a_deliberate_cycle_is_found():
    graph = {"k31c.graph.a": {"k31c.graph.b"}, "k31c.graph.b": {"k31c.graph.c"},
             "k31c.graph.c": {"k31c.graph.a"}, "k31c.graph.d": {"k31c.graph.a"}}
    assert cycles(graph) == {frozenset({"k31c.graph.a", "k31c.graph.b", "k31c.graph.c"})}
    graph["k31c.graph.c"] = set()
    assert cycles(graph) == set()


def test_a_deliberate_room_break_and_fx_use_are_found(tmp_path):
    pkg = tmp_path / "k31c"
    for folder in ("graph", "lowering", "runtime"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("")
    (pkg / "graph" / "model.py").write_text("from ..config import x, _hidden\n")
    (pkg / "lowering" / "kernel.py").write_text("def f():\n    from k31c.runtime import engine\n")
    (pkg / "runtime" / "engine.py").write_text("import torch\nfrom ..lowering import kernel\n"
                                               "def g(gm):\n    return torch.fx.GraphModule\n")
    (pkg / "runtime" / "run.py").write_text("from torch.fx import Graph\n")
    modules = scan(pkg)
    assert room_breaks(modules) == {("k31c.lowering.kernel", "k31c.runtime.engine")}
    assert cycles({m: i["imports"] for m, i in modules.items()}) == \
        {frozenset({"k31c.lowering.kernel", "k31c.runtime.engine"})}
    assert modules["k31c.runtime.engine"]["fx"] == [4] and modules["k31c.runtime.run"]["fx"] == [1]
    assert modules["k31c.graph.model"]["imports"] == {"k31c.config"}
    assert modules["k31c.graph.model"]["private"] == {("k31c.config", "_hidden")}
