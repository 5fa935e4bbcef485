"""The import layering of the four packages, read from source with ``ast`` (nothing is imported).

The rule (DESIGN.md, "Processes and packages"): ``indexer`` ← ``corpusd`` (the library) ←
``holder``, ``requester`` ← ``corpusd.cli`` / ``corpusd.up`` / ``corpusd.__main__`` (the only
modules that may import the daemons). ``holder`` and ``requester`` are siblings and never import
each other; ``indexer`` imports nothing first-party but itself. And no import cycle at all, between
any two modules.

What counts as an import: every ``import``/``from … import`` statement anywhere in a file —
at module level, inside functions (lazy imports), under ``TYPE_CHECKING``, in ``try`` — and
relative ones (``from . import x``, ``from .a import y``). How one resolves to a module:

- ``import a.b.c`` → ``a.b.c``.
- ``from a.b import x`` → ``a.b.x`` when that is a module; else, when ``a.b`` is a package, the
  module its ``__init__`` took ``x`` from (followed through further re-exports); else ``a.b``.
  So a package ``__init__`` that re-exports its submodules has edges to them, and a submodule
  that imports a re-exported name through its package (``from corpusd.model import X``) has an
  edge to the submodule defining ``X``, not to the ``__init__`` — the facade alone never makes a
  cycle, while a name the ``__init__`` defines itself is an edge to the ``__init__`` (a real
  cycle if that ``__init__`` imports the submodule).
- The parent packages Python imports implicitly are no edges; a module importing itself is none.
- Third-party modules and ``corpusd/v1`` (generated) are skipped.

``tools/`` and ``tests/`` are outside the rule. Run on another checkout:
``python tests/unit/test_layering.py ROOT``.
"""

from __future__ import annotations

import ast
import itertools
import sys
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path

PACKAGES = ("corpusd", "holder", "requester", "indexer")
SKIP = ("corpusd/v1/",)
TOP = frozenset({"corpusd.cli", "corpusd.up", "corpusd.__main__"})
#: layer → the layers it may import
ALLOWED = {
    "indexer": {"indexer"},
    "library": {"indexer", "library"},
    "holder": {"indexer", "library", "holder"},
    "requester": {"indexer", "library", "requester"},
    "top": {"indexer", "library", "holder", "requester", "top"},
}


def layer(module: str) -> str:
    if module in TOP:
        return "top"
    root = module.split(".")[0]
    return "library" if root == "corpusd" else root


def module_name(path: str) -> str:
    """``corpusd/model/__init__.py`` → ``corpusd.model``; ``corpusd/env.py`` → ``corpusd.env``."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_sources(root: Path) -> dict[str, str]:
    """Relative POSIX path → source, for every first-party module under ``root``."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            if not rel.startswith(SKIP):
                out[rel] = f.read_text()
    return out


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from … import`` reads from, relative levels resolved in ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(tree: ast.Module, package: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line, absolute module, names) per statement anywhere in ``tree`` (``package``: the one
    relative imports start from); ``names`` is empty for ``import a.b``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, _absolute(node, package), [a.name for a in node.names]


class ImportGraph:
    """Module → {imported module: first line importing it}, over ``sources`` (path → text)."""

    def __init__(self, sources: Mapping[str, str]) -> None:
        self.path = {module_name(p): p for p in sources}
        self.packages = {module_name(p) for p in sources if p.endswith("/__init__.py")}
        trees = {module_name(p): ast.parse(src, filename=p) for p, src in sources.items()}
        # package → name → (module it came from, its name there), from top-level statements
        self.reexports: dict[str, dict[str, tuple[str, str]]] = {}
        for pkg in self.packages:
            got = self.reexports[pkg] = {}
            for stmt in trees[pkg].body:
                if isinstance(stmt, ast.ImportFrom):
                    target = _absolute(stmt, pkg)
                    for alias in stmt.names:
                        got[alias.asname or alias.name] = (target, alias.name)
        self.edges: dict[str, dict[str, int]] = {m: {} for m in trees}
        for m, tree in trees.items():
            package = m if m in self.packages else m.rpartition(".")[0]
            for line, target, names in _imports(tree, package):
                for dep in [self._from(target, n, set()) for n in names] or [target]:
                    if dep in self.edges and dep != m:
                        self.edges[m].setdefault(dep, line)

    def _from(self, target: str, name: str, seen: set[tuple[str, str]]) -> str | None:
        """The module ``from target import name`` depends on (None: not first-party)."""
        if f"{target}.{name}" in self.path:
            return f"{target}.{name}"
        if (
            target in self.packages
            and name in self.reexports[target]
            and (target, name) not in seen
        ):
            seen.add((target, name))
            return self._from(*self.reexports[target][name], seen)
        return target if target in self.path else None

    def where(self, a: str, b: str) -> str:
        return f"{self.path[a]}:{self.edges[a][b]}"

    def cycles(self) -> list[list[str]]:
        """Shortest cycles (first module repeated last) until every module on one is on one
        reported: a knot of several cycles shows each, not just the first found."""
        out = []
        for scc in _sccs(self.edges):
            covered: set[str] = set()
            for start in sorted(scc) if len(scc) > 1 else []:
                if start not in covered:
                    cycle = self._shortest_cycle(start, scc)
                    covered.update(cycle)
                    out.append(cycle)
        return out

    def _shortest_cycle(self, start: str, scc: set[str]) -> list[str]:
        """Breadth first from ``start`` back to it, within its strongly connected ``scc``."""
        prev: dict[str, str] = {}
        todo = deque([start])
        while todo:
            m = todo.popleft()
            if start in self.edges[m]:
                path = [m]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            for n in sorted(self.edges[m]):
                if n in scc and n not in prev and n != start:
                    prev[n] = m
                    todo.append(n)
        raise AssertionError(f"{start} is in a strongly connected component but on no cycle")


def _sccs(edges: Mapping[str, Mapping[str, int]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit to mind)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    scc = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        scc.add(w)
                        if w == v:
                            break
                    out.append(scc)
    return out


def layering_problems(sources: Mapping[str, str]) -> list[str]:
    """Every import cycle and every import against the layering, one line each (empty: clean)."""
    g = ImportGraph(sources)
    problems = []
    for cyc in g.cycles():
        steps = ", ".join(g.where(a, b) for a, b in itertools.pairwise(cyc))
        problems.append(f"import cycle: {' → '.join(cyc)}  ({steps})")
    for m in sorted(g.edges):
        for dep in sorted(g.edges[m]):
            if layer(dep) not in ALLOWED[layer(m)]:
                problems.append(
                    f"{g.where(m, dep)}: {m} ({layer(m)}) imports {dep} ({layer(dep)}), "
                    f"which may import only {sorted(ALLOWED[layer(m)])}"
                )
    return problems


def test_layering_of_this_tree() -> None:
    problems = layering_problems(read_sources(Path(__file__).resolve().parents[2]))
    assert not problems, "\n".join(problems)


def _tree(files: dict[str, str]) -> dict[str, str]:
    """Fake sources: ``files`` and an empty ``__init__.py`` for each package."""
    return {**{f"{p}/__init__.py": "" for p in PACKAGES}, **files}


def test_planted_cycle_is_reported() -> None:
    sources = _tree(
        {
            "corpusd/fake_a.py": "def f():\n    from corpusd import fake_b  # lazy counts too\n",
            "corpusd/fake_b.py": "from .fake_a import f\nfrom . import fake_c\n",
            "corpusd/fake_c.py": "import corpusd.fake_b\n",
        }
    )
    problems = layering_problems(sources)
    assert problems == [  # one knot, two cycles: both shown
        "import cycle: corpusd.fake_a → corpusd.fake_b → corpusd.fake_a  "
        "(corpusd/fake_a.py:2, corpusd/fake_b.py:1)",
        "import cycle: corpusd.fake_c → corpusd.fake_b → corpusd.fake_c  "
        "(corpusd/fake_c.py:1, corpusd/fake_b.py:2)",
    ], problems


def test_planted_upward_and_sideways_imports_are_reported() -> None:
    sources = _tree(
        {
            "indexer/x.py": "import corpusd.env\n",
            "corpusd/env.py": "def f():\n    from corpusd.up import running\n",
            "corpusd/up.py": "import holder.launch\nimport requester.launch\n",
            "holder/launch.py": "from requester import launch\n",
            "requester/launch.py": "",
        }
    )
    problems = layering_problems(sources)
    assert [p.split(": ", 1)[1].split(" (")[0] for p in problems] == [
        "corpusd.env",  # → corpusd.up
        "holder.launch",  # → requester.launch
        "indexer.x",  # → corpusd.env
    ], problems
    assert "corpusd/env.py:2: corpusd.env (library) imports corpusd.up (top)" in problems[0]


def test_package_facade_is_not_a_cycle_but_a_name_it_defines_is() -> None:
    facade = _tree(
        {
            "corpusd/model/__init__.py": "from .a import X\nfrom corpusd.model.b import Y\n",
            "corpusd/model/a.py": "X = 1\n",
            "corpusd/model/b.py": "from corpusd.model import X\nY = X\n",
        }
    )
    assert layering_problems(facade) == []
    own = _tree(
        {
            "corpusd/model/__init__.py": "from .b import Y\nZ = 1\n",
            "corpusd/model/b.py": "from . import Z\nY = Z\n",
        }
    )
    assert [p.split("  ")[0] for p in layering_problems(own)] == [
        "import cycle: corpusd.model → corpusd.model.b → corpusd.model"
    ]


if __name__ == "__main__":
    found = layering_problems(read_sources(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
    print("\n".join(found) or "layering: clean")
    sys.exit(1 if found else 0)
