"""No import cycles among archscale's modules, and no import from a low layer up (`LAYERS`).

An edge a -> b is any `import` of b in a: at module level AND inside functions (a lazy import is still a
dependency; the cycles this test was written against, data.tokenizer <-> data.prepare and studies.plans ->
cli -> studies, were all lazy ones). Imports under `if TYPE_CHECKING:` never run and do not count. Importing
`archscale.x.y` is an edge to that module only, not to its parent packages' `__init__`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Cycles still to be broken, each as the set of modules in it. Empty this when they are gone; the test then
# fails for any cycle at all. (config <-> models: the mixer registry removes it.)
KNOWN_CYCLES: list[set[str]] = []


# The low layers and what each may import of archscale besides itself: the kernels are the bottom (maths only;
# `errors` for their one-line refusals), the models sit on the kernels and the config. Nothing in a layer reaches
# up (a kernel importing a model, a model importing the trainer); the layers above are not listed.
LAYERS: dict[str, set[str]] = {
    "archscale.errors": set(),
    "archscale.kernels": {"archscale.errors"},
    "archscale.models": {"archscale.errors", "archscale.kernels", "archscale.config"},
}


def module_files(root: Path) -> dict[str, Path]:
    mods = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:  # relative: resolve against this module's package
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target] + [f"{target}.{a.name}" for a in node.names]  # `from pkg import mod` imports pkg.mod


def _import_nodes(tree: ast.Module):
    """Every import statement that can run (all of them except those under `if TYPE_CHECKING:`)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path) -> dict[str, set[str]]:
    mods = module_files(root)
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for node in _import_nodes(tree):
            targets.update(_imported_names(node, name, path.name == "__init__.py"))
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_violations(graph: dict[str, set[str]], layers: dict[str, set[str]]) -> list[str]:
    """Every edge from a module of a listed layer to an archscale module outside that layer and its allowed set."""
    out = []
    for module, targets in sorted(graph.items()):
        for layer, allowed in layers.items():
            if _within(module, layer):
                out += [f"{module} -> {t}" for t in sorted(targets)
                        if t.startswith("archscale") and not any(_within(t, p) for p in allowed | {layer})]
    return out


def test_low_layers_import_nothing_above_them():
    assert layer_violations(import_graph(SRC), LAYERS) == []


def test_the_layer_check_sees_an_upward_import():
    """Negative control: a kernel's lazy import of a model module, and a model's of the trainer, are found."""
    graph = {"archscale.kernels.k": {"archscale.errors", "archscale.kernels.dispatch", "archscale.models.block"},
             "archscale.models.m": {"archscale.kernels.k", "archscale.train.trainer"},
             "archscale.train.t": {"archscale.models.m"}}
    assert layer_violations(graph, LAYERS) == ["archscale.kernels.k -> archscale.models.block",
                                               "archscale.models.m -> archscale.train.trainer"]


def test_no_import_cycles_in_src():
    found = cycles(import_graph(SRC))
    new = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not new, f"import cycles: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"these cycles are gone (or changed): remove them from KNOWN_CYCLES: {gone}"


def test_the_cycle_finder_sees_lazy_and_relative_imports(tmp_path):
    """Negative control: a cycle made only of a function-level import and a relative import is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n    return b\n")
    (pkg / "b.py").write_text("from . import c\n")
    (pkg / "c.py").write_text("from pkg.a import f\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "e.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path)
    assert graph["pkg.d"] == set() and graph["pkg.e"] == {"pkg.a"}
    assert cycles(graph) == [{"pkg.a", "pkg.b", "pkg.c"}]


def test_importing_config_imports_no_model_module():
    """`import archscale.config` stays light: no model module (config's own lazy imports do not run)."""
    code = ("import sys, archscale.config; "
            "print(sorted(m for m in sys.modules if m.startswith('archscale.models')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC), "PATH": ""}).stdout.strip()
    assert out == "[]", out
