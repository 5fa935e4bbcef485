"""The import layering of the whole tree, read from source with ``ast`` (nothing is imported).

The rule (DESIGN.md, "Processes and packages"): ``indexer`` ← ``corpusd`` (the library) ←
``holder``, ``requester`` ← ``corpusd.cli`` / ``corpusd.up`` / ``corpusd.__main__`` and
``corpusd.testing`` (the only modules that may import the daemons; ``corpusd.testing`` starts
them for tests and tools) ← ``tools`` ← ``tests``. ``holder`` and ``requester`` are siblings and
never import each other; ``indexer`` imports nothing first-party but itself. A tool never imports
``tests`` (what both need lives in ``corpusd.testing``); a test imports a tool only to test it.

And no import cycle at all: none between two modules, and none between the sub-packages of one
package (``corpusd.model`` → ``corpusd.corpus`` → ``corpusd.model`` is one even when no single
module is on a cycle): inside each package, every module counts as the child of that package it
sits in, and a cycle between children of which one is a sub-package is reported with the imports
that make it (a cycle of plain modules is already reported as a module cycle).

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

Run on another checkout: ``python tests/unit/test_layering.py ROOT``.
"""

from __future__ import annotations

import ast
import itertools
import sys
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path

PACKAGES = ("corpusd", "holder", "requester", "indexer", "tools", "tests")
SKIP = ("corpusd/v1/",)
TOP = frozenset({"corpusd.cli", "corpusd.up", "corpusd.__main__", "corpusd.testing"})
#: layer → the layers it may import
ALLOWED = {
    "indexer": {"indexer"},
    "library": {"indexer", "library"},
    "holder": {"indexer", "library", "holder"},
    "requester": {"indexer", "library", "requester"},
    "top": {"indexer", "library", "holder", "requester", "top"},
    "tools": {"indexer", "library", "holder", "requester", "top", "tools"},
    "tests": {"indexer", "library", "holder", "requester", "top", "tools", "tests"},
}


def layer(module: str) -> str:
    """``module``'s layer: a key of ``ALLOWED`` (a module under one of ``TOP`` is top too)."""
    if any(module == t or module.startswith(f"{t}.") for t in TOP):
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
        """Module cycles (first module repeated last); see :func:`_cycles`."""
        return _cycles(self.edges)

    def package_cycles(self) -> list[tuple[str, list[str], list[tuple[str, str]]]]:
        """Cycles between the children of one package, at least one of them a sub-package:
        (package, children with the first repeated last, per step the first module import that
        makes it, as (importing module, imported module))."""
        out = []
        for pkg in sorted(self.packages):
            edges: dict[str, dict[str, tuple[str, str]]] = {}
            for m in sorted(self.edges):
                if m.startswith(f"{pkg}."):
                    a = _child(pkg, m)
                    for dep in sorted(self.edges[m]):
                        b = _child(pkg, dep) if dep.startswith(f"{pkg}.") else a
                        if b != a:
                            edges.setdefault(a, {}).setdefault(b, (m, dep))
                            edges.setdefault(b, {})
            for cyc in _cycles(edges):
                if any(c in self.packages for c in cyc):
                    out.append((pkg, cyc, [edges[a][b] for a, b in itertools.pairwise(cyc)]))
        return out


def _child(package: str, module: str) -> str:
    """The child of ``package`` that ``module`` (inside it) sits in: ``corpusd``,
    ``corpusd.model.config`` → ``corpusd.model``."""
    return ".".join(module.split(".")[: package.count(".") + 2])


def _cycles(edges: Mapping[str, Mapping[str, object]]) -> list[list[str]]:
    """Shortest cycles (first node repeated last) until every node on one is on one reported: a
    knot of several cycles shows each, not just the first found."""
    out = []
    for scc in _sccs(edges):
        covered: set[str] = set()
        for start in sorted(scc) if len(scc) > 1 else []:
            if start not in covered:
                cycle = _shortest_cycle(edges, start, scc)
                covered.update(cycle)
                out.append(cycle)
    return out


def _shortest_cycle(
    edges: Mapping[str, Mapping[str, object]], start: str, scc: set[str]
) -> list[str]:
    """Breadth first from ``start`` back to it, within its strongly connected ``scc``."""
    prev: dict[str, str] = {}
    todo = deque([start])
    while todo:
        m = todo.popleft()
        if start in edges[m]:
            path = [m]
            while path[-1] != start:
                path.append(prev[path[-1]])
            return [*reversed(path), start]
        for n in sorted(edges[m]):
            if n in scc and n not in prev and n != start:
                prev[n] = m
                todo.append(n)
    raise AssertionError(f"{start} is in a strongly connected component but on no cycle")


def _sccs(edges: Mapping[str, Mapping[str, object]]) -> list[set[str]]:
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
    for pkg, cyc, via in g.package_cycles():
        steps = ", ".join(f"{g.where(a, b)} imports {b}" for a, b in via)
        problems.append(f"sub-package cycle in {pkg}: {' → '.join(cyc)}  ({steps})")
    for m in sorted(g.edges):
        for dep in sorted(g.edges[m]):
            if layer(dep) not in ALLOWED[layer(m)]:
                problems.append(
                    f"{g.where(m, dep)}: {m} ({layer(m)}) imports {dep} ({layer(dep)}), "
                    f"which may import only {sorted(ALLOWED[layer(m)])}"
                )
    return problems


ROOT = Path(__file__).resolve().parents[2]


def test_layering_of_this_tree() -> None:
    """Over corpusd, holder, requester, indexer, tools and tests: no import cycle between modules
    or sub-packages, and every import in its layer."""
    sources = read_sources(ROOT)
    assert {"tools/fuzz.py", "tests/conftest.py", "corpusd/testing/holders.py"} <= set(sources)
    problems = layering_problems(sources)
    assert not problems, "\n".join(problems)


def test_planted_cycle_in_tools_of_this_tree_is_reported() -> None:
    """This tree, with two tools that import each other (one lazily) planted in it: exactly that
    cycle is reported, so the clean verdict above is not blindness to tools/."""
    sources = {
        **read_sources(ROOT),
        "tools/planted_a.py": "from tools import planted_b\n",
        "tools/planted_b.py": "def main():\n    import tools.planted_a\n",
    }
    assert layering_problems(sources) == [
        "import cycle: tools.planted_a → tools.planted_b → tools.planted_a  "
        "(tools/planted_a.py:1, tools/planted_b.py:2)"
    ]


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


def test_planted_cycle_between_sub_packages_is_reported() -> None:
    """corpusd.model and corpusd.corpus importing each other through different modules: no
    module is on a cycle, the two sub-packages are (the shape issue 34 found)."""
    sources = _tree(
        {
            "corpusd/model/__init__.py": "",
            "corpusd/model/rows.py": "from corpusd.corpus.names import KV\nX = KV\n",
            "corpusd/corpus/__init__.py": "",
            "corpusd/corpus/names.py": "KV = 1\n",
            "corpusd/corpus/pin.py": "from corpusd.model.rows import X\n",
        }
    )
    assert layering_problems(sources) == [
        "sub-package cycle in corpusd: corpusd.corpus → corpusd.model → corpusd.corpus  "
        "(corpusd/corpus/pin.py:1 imports corpusd.model.rows, "
        "corpusd/model/rows.py:1 imports corpusd.corpus.names)"
    ]
    sources["corpusd/model/rows.py"] = "X = 1\n"  # the name moved below both: clean
    assert layering_problems(sources) == []


def test_tools_tests_and_the_testing_helpers_keep_their_layers() -> None:
    """A tool importing tests, and the library importing corpusd.testing, are reported; a test
    importing a tool, and corpusd.testing starting a holder, are not."""
    sources = _tree(
        {
            "tools/fuzz.py": "from tests.support import fuzzing\n",
            "tools/bench.py": "from corpusd.testing.holders import start_holder\n",
            "tests/support/__init__.py": "",
            "tests/support/fuzzing.py": "",
            "tests/unit/__init__.py": "",
            "tests/unit/test_bench.py": "import tools.bench\nfrom corpusd.testing import holders\n",
            "corpusd/testing/__init__.py": "",
            "corpusd/testing/holders.py": "from holder.launch import start_holder\n",
            "corpusd/env.py": "def f():\n    from corpusd.testing.holders import start_holder\n",
            "holder/launch.py": "",
        }
    )
    assert [p.split(": ", 1)[1].split(", which")[0] for p in layering_problems(sources)] == [
        "corpusd.env (library) imports corpusd.testing.holders (top)",
        "tools.fuzz (tools) imports tests.support.fuzzing (tests)",
    ]


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
