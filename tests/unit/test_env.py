"""The ``CORPUSD_*`` registry (corpusd/env.py): typed values and precise errors, nothing else in
the tree reads those variables from ``os.environ``, and the README's table is the registry's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from corpusd import env

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("corpusd", "holder", "requester", "indexer", "tools")
REGISTRY = ROOT / "corpusd" / "env.py"
PREFIX = "CORPUSD_"


def _constants(trees: list[ast.Module]) -> dict[str, str]:
    """Every ``NAME = "CORPUSD_…"`` (also tuple-unpacked) at module or class level, by name: a
    read through ``ENV_X`` or ``mod.ENV_X`` is resolved through them."""
    out: dict[str, str] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                pairs: list[tuple[ast.expr, ast.expr]] = [(target, node.value)]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(target.elts, node.value.elts, strict=False))
                for t, v in pairs:
                    if (
                        isinstance(t, ast.Name)
                        and isinstance(v, ast.Constant)
                        and isinstance(v.value, str)
                        and v.value.startswith(PREFIX)
                    ):
                        out[t.id] = v.value
    return out


def _key(node: ast.expr | None, consts: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value if node.value.startswith(PREFIX) else None
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    if isinstance(node, ast.Attribute):
        return consts.get(node.attr)
    return None


def _environ(node: ast.expr) -> bool:
    """``os.environ`` (or ``environ`` imported from os)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _getenv(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr == "getenv" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "getenv"


def violations(tree: ast.Module, consts: dict[str, str]) -> list[str]:
    """Lines that read a ``CORPUSD_*`` variable from the process environment: ``os.getenv(K)``,
    ``os.environ.get(K)``, ``os.environ[K]``, ``K in os.environ``; and ``os.environ`` (or its
    ``get``) bound to a name or a parameter default, which hides such a read. Writes (setting a
    variable for a child process) and other variables are not reads of corpusd's settings."""
    out = []
    for node in ast.walk(tree):
        key: str | None = None
        if isinstance(node, ast.Call):
            f = node.func
            arg = node.args[0] if node.args else None
            if _getenv(f) or (
                isinstance(f, ast.Attribute) and f.attr == "get" and _environ(f.value)
            ):
                key = _key(arg, consts)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if _environ(node.value):
                key = _key(node.slice, consts)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            if isinstance(node.ops[0], ast.In | ast.NotIn) and _environ(node.comparators[0]):
                key = _key(node.left, consts)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and _environ_or_get(node.value):
            out.append(f"{node.lineno}: binds os.environ to a name")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
            _environ(d) for d in [*node.args.defaults, *node.args.kw_defaults] if d
        ):
            out.append(f"{node.lineno}: {node.name}() defaults a parameter to os.environ")
        if key is not None:
            out.append(f"{getattr(node, 'lineno', 0)}: reads {key}")
    return out


def _environ_or_get(v: ast.expr | None) -> bool:
    if v is None:
        return False
    return _environ(v) or (isinstance(v, ast.Attribute) and v.attr == "get" and _environ(v.value))


def _scan() -> dict[str, list[str]]:
    files = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py")) if p != REGISTRY]
    trees = {p: ast.parse(p.read_text(), str(p)) for p in files}
    consts = _constants(list(trees.values()))
    found = {str(p.relative_to(ROOT)): violations(t, consts) for p, t in trees.items()}
    return {p: v for p, v in found.items() if v}


def test_only_the_registry_reads_corpusd_variables() -> None:
    assert _scan() == {}, "read CORPUSD_* through corpusd.env.get, never os.environ"


PLANTED = """
import os
from os import environ, getenv
ENV_X = "CORPUSD_X"
a = os.environ.get("CORPUSD_HOME")
b = os.environ["CORPUSD_STORE"]
c = os.getenv(ENV_X)
d = getenv("CORPUSD_MODEL", "")
e = "CORPUSD_TOKEN" in os.environ
f = environ.get(other.ENV_X)
g = os.environ.get
def h(env=os.environ): ...
ok1 = os.environ.get("TRITON_INTERPRET")
os.environ["CORPUSD_HOME"] = "/tmp"
ok2 = {**os.environ, "CORPUSD_STORE": "x"}
"""


def test_the_scan_finds_each_planted_read_and_nothing_else() -> None:
    tree = ast.parse(PLANTED)
    found = violations(tree, _constants([tree]))
    lines = sorted(int(v.split(":")[0]) for v in found)
    assert lines == list(range(5, 13)), found


def test_values_are_typed_and_errors_name_the_variable() -> None:
    e = {"CORPUSD_SGLANG_WINDOW": "4096", "CORPUSD_HOME": "~/x", "CORPUSD_SGLANG_PATH": " Host "}
    assert env.get("CORPUSD_SGLANG_WINDOW", e) == 4096
    assert env.get("CORPUSD_SGLANG_ARENA", e) == 65536  # unset: the registry's default
    assert env.get("CORPUSD_SGLANG_ARENA", {"CORPUSD_SGLANG_ARENA": "  "}) == 65536  # blank
    assert env.get("CORPUSD_HOME", e) == Path("~/x").expanduser()
    assert env.get("CORPUSD_SGLANG_PATH", e) == "host"
    assert env.get("CORPUSD_SGLANG_METRICS_PORT", {}) is None
    for name, raw, says in (
        ("CORPUSD_SGLANG_WINDOW", "16k", "a whole number >= 1"),
        ("CORPUSD_SGLANG_WINDOW", "0", "a whole number >= 1"),
        ("CORPUSD_SGLANG_PATH", "gpu", "one of auto, device, host"),
        ("CORPUSD_SGLANG_TABLE_REFRESH_S", "nan", "seconds between re-reads"),
        ("CORPUSD_SGLANG_METRICS_PORT", "65536", "a TCP port"),
    ):
        with pytest.raises(env.EnvError, match=re.escape(f"{name}={raw!r}: {says}")):
            env.get(name, {name: raw})
    with pytest.raises(KeyError, match="CORPUSD_NOPE is not a corpusd variable"):
        env.get("CORPUSD_NOPE", {})


def test_bool_and_every_default_parse() -> None:
    flag = env.Var("CORPUSD_T", "bool", "a test flag", default="off")
    assert flag.value(None) is False and flag.value("Yes") is True
    with pytest.raises(env.EnvError, match=r"CORPUSD_T='2': a boolean"):
        flag.value("2")
    for v in env.VARIABLES:  # every default is a valid value of its own type
        v.value(None)


def test_readme_table_is_the_registry() -> None:
    text = (ROOT / "README.md").read_text()
    begin, end = "<!-- env-table: python -m corpusd.env --markdown -->\n", "<!-- /env-table -->"
    assert begin in text and end in text, "README.md: the env-table markers are missing"
    table = text.split(begin, 1)[1].split(end, 1)[0]
    assert table == env.markdown(), (
        "README.md's variable table differs from corpusd/env.py: paste the output of "
        "`python -m corpusd.env --markdown` between the env-table markers"
    )
    assert max(len(line) for line in table.splitlines()) <= 400
