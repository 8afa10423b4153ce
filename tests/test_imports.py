"""The package's import graph: every module imports in a fresh interpreter, and no two modules import
each other, directly or around a loop, at module level, inside a function or under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import elr_lightning

PACKAGE = Path(elr_lightning.__file__).parent


def package_modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {"elr_lightning": PACKAGE / "__init__.py"}
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="elr_lightning."):
        path = PACKAGE.joinpath(*info.name.split(".")[1:])
        found[info.name] = path / "__init__.py" if info.ispkg else path.with_suffix(".py")
    return found


def import_graph() -> dict[str, set[str]]:
    """``module -> package modules it imports``, anywhere: module level, in a function, under ``TYPE_CHECKING``.

    A type-only import is an edge too: it still says which module knows which, and a circle of them is
    a circle of modules that cannot be read (or split) one without the other.
    """
    modules = package_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    edges.add(target)
                    break
        graph[name] = edges
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as ``[a, b, ..., a]``, or ``[]``; a package's ``__init__`` re-exports are edges too."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"p": {"p.x"}, "p.x": {"q"}, "q": set()}) == []
    assert find_cycle({"p": {"p.x"}, "p.x": {"q"}, "q": {"p"}}) == ["p", "p.x", "q", "p"]


def test_no_module_of_the_package_is_part_of_an_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 25 and "elr_lightning.data.datamodule" in graph
    assert "elr_lightning.module" in graph["elr_lightning.lightning_cli"]
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))


#: Modules built on an extra that a development venv may lack, with the package they need: outside CI (which
#: installs every extra) they are left out of the fresh-interpreter import when that package is missing.
NEEDS_EXTRA = {"elr_lightning.vllm.model": "vllm.engine"}


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    import importlib.util
    import os

    def available(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            return False

    names = sorted(n for n in package_modules() if os.environ.get("CI") or available(NEEDS_EXTRA.get(n, "elr_lightning")))
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint(len(sys.argv) - 1)"
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(len(names))


def reexported_names() -> dict[str, list[str]]:
    """Per module (packages' ``__init__`` aside), the names in its ``__all__`` that it imports instead of defining."""
    found = {}
    for name, path in package_modules().items():
        if path.name == "__init__.py":  # a package's public face may gather its modules' names
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {node.name for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
        defined |= {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
        defined |= {node.target.id for node in tree.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                names = [n for n in ast.literal_eval(node.value) if n not in defined]
                if names:
                    found[name] = names
    return found


def test_a_module_exports_only_what_it_defines():
    """Every name has one import path: a module's ``__all__`` lists its own definitions."""
    found = reexported_names()
    assert not found, f"re-exported under a second import path: {found}"
def test_type_only_imports_are_edges() -> None:
    graph = import_graph()
    assert "elr_lightning.cache_store" in graph["elr_lightning.context"]  # under TYPE_CHECKING only


def test_the_layer_seams_sit_below_the_model_config() -> None:
    """config -> mixer seams -> loop context -> cache store, never back: the seams and the context do not
    know the config, which imports the seams to check the mixer classes its patterns name."""
    graph = import_graph()
    assert "elr_lightning.mixers.base" in graph["elr_lightning.config"]
    for low in ("elr_lightning.mixers.base", "elr_lightning.context", "elr_lightning.cache_store"):
        assert "elr_lightning.config" not in reachable(graph, low) | {low}, low
    assert reachable(graph, "elr_lightning.cache_store") == set()


#: The package's layers, lowest first: a module imports its own layer and the layers below it, never one
#: above (except the :data:`LAZY_HOOKS`). A module belongs to the layer of the longest name that prefixes it.
LAYERS: list[tuple[str, list[str]]] = [
    ("foundations", ["_moved", "errors", "roles", "recompute", "cache_store", "plugin_config", "loop_points",
                     "batches", "step_logging", "tokenizers", "files", "arguments"]),
    ("model", ["mixers", "config", "context", "layers", "conditioning", "updates", "sampling", "core", "model",
               "flops", "optim", "parameter_usage"]),
    ("checkpoints", ["checkpoints"]),
    ("training", ["module", "module_checks", "callbacks", "strategies", "data"]),
    ("inference", ["inference"]),
    ("tools", ["inference.command", "depth", "reasoning", "eval", "hf", "serve", "estimate", "ablate", "lightning_cli",
               "vllm"]),
    ("entry", ["cli", ""]),
]  # fmt: skip

#: Imports up the layers, each inside a function and marked "Lazy hook" on the line above it: importer -> imported.
LAZY_HOOKS = {"elr_lightning.callbacks.depth_accuracy": "elr_lightning.depth.score"}

def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (a dotted name), by the longest prefix that names it."""
    rel = module.removeprefix("elr_lightning").removeprefix(".")
    found = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
             if rel == prefix or (prefix and rel.startswith(prefix + "."))]  # fmt: skip
    assert found, f"{module} is in no layer of tests/test_imports.py's LAYERS: add it where it belongs"
    return max(found)[1]


def test_the_layer_finder_takes_the_longest_prefix() -> None:
    assert layer_of("elr_lightning.inference.generate") == 4
    assert layer_of("elr_lightning.inference.command") == 5
    assert layer_of("elr_lightning") == layer_of("elr_lightning.cli") == 6


def test_no_module_imports_a_layer_above_its_own() -> None:
    graph = import_graph()
    up = [f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
          for a in sorted(graph) for b in sorted(graph[a])
          if layer_of(b) > layer_of(a) and LAZY_HOOKS.get(a) != b]  # fmt: skip
    assert not up, "imports up the layers:\n" + "\n".join(up)


def test_every_lazy_hook_is_inside_a_function_and_named_in_a_comment() -> None:
    modules = package_modules()
    for importer, imported in LAZY_HOOKS.items():
        source = modules[importer].read_text(encoding="utf-8")
        tree = ast.parse(source)
        top = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == imported]
        assert not top, f"{importer} imports {imported} at module level"
        lines = source.splitlines()
        hooks = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == imported]
        assert hooks and all("Lazy hook" in lines[n.lineno - 2] for n in hooks), (importer, imported)


def test_the_package_root_holds_at_most_30_modules() -> None:
    root = {path.stem for path in PACKAGE.glob("*.py")}
    assert {"module", "updates", "sampling", "conditioning", "plugin_config"} <= root  # the seams never move
    assert len(root) <= 30, sorted(root)


def test_the_tests_mirror_the_package() -> None:
    """Each folder of tests/ is named after a package of elr_lightning and is on pytest's pythonpath (its
    tests import each other's helpers by module name)."""
    import tomllib

    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders and folders <= packages, folders - packages
    config = tomllib.loads((tests.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert {f"tests/{name}" for name in folders} | {"tests"} == set(config["pythonpath"])
