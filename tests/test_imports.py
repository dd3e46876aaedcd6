"""maxlite's modules import each other one way: no import cycle, at module level or inside a function.

A cycle hidden in a function-local import still means two modules that each need the other (one
cannot be read, tested or moved without the other); the recipe's schema is a leaf."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _modules(root: pathlib.Path = ROOT, package: str = "maxlite") -> dict[str, pathlib.Path]:
    out = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """module → the maxlite modules it imports anywhere in its body (`import a.b`, `from a import b`,
    relative ones), each named by the module file that defines it. A module importing its own
    package is left out: Python runs a package's __init__ before any of its modules anyway."""
    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {owner(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                found |= {owner(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else owner(base)
                          for a in node.names}
        graph[name] = {m for m in found if m and m != name and not name.startswith(m + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each as one cycle through it."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while not group or w != v:
                w = stack.pop()
                on.discard(w)
                group.add(w)
            if len(group) > 1:
                groups.append(_path(graph, group))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _path(graph, group: set[str]) -> list[str]:
    """One cycle within `group`, from its first module back to it (breadth-first)."""
    start = min(group)
    came = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while came[path[-1]] is not None:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(group)


def test_no_import_cycle_between_maxlite_modules():
    found = cycles(imports(_modules()))
    assert found == [], "import cycles: " + "; ".join(" → ".join(c) for c in found)


def test_the_walk_sees_function_local_relative_and_dotted_imports(tmp_path):
    """The walk itself, on a package made for it: each way of importing makes its edge, a module
    importing its own package does not, and the cycles are named in order."""
    files = {"__init__.py": "from pkg import sub\n",
             "a.py": "def f():\n    from . import b  # function-local, relative\n",
             "b.py": "import pkg.c\n",
             "c.py": "from pkg.a import f\nimport pkg\n",
             "d.py": "from pkg.sub.e import g\n",
             "sub/__init__.py": "", "sub/e.py": "from ..d import x\nfrom pkg import sub\n"}
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    graph = imports(_modules(tmp_path, "pkg"))
    assert graph == {"pkg": {"pkg.sub"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"},
                     "pkg.d": {"pkg.sub.e"}, "pkg.sub": set(), "pkg.sub.e": {"pkg.d"}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"], ["pkg.d", "pkg.sub.e", "pkg.d"]]


def test_the_schema_is_a_leaf_and_loading_a_recipe_imports_no_jax():
    assert imports(_modules())["maxlite.schema"] == set()
    code = ("import sys, maxlite.config, maxlite.config_checks; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
