"""tests/conftest.py's own machinery: the guard that fails a test leaving torch's thread count,
the environment or the working directory changed, and ``--shuffle`` / ``--torch-threads`` (what
``.ci/run`` runs the suite with, under pytest-xdist). Each runs pytest on a small file in a fresh
process, with the suite's conftest as a plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import shuffle_seed, shuffled

ROOT = Path(__file__).resolve().parents[2]

LEAKS = """
import os
import torch

def test_threads():
    torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2)

def test_env():
    os.environ["CORPUSD_GUARD_LEAK"] = "1"

def test_cwd():
    os.chdir("/")

def test_clean(monkeypatch):
    monkeypatch.setenv("CORPUSD_GUARD_CLEAN", "1")
    monkeypatch.chdir("/")

def test_threads_seen():
    assert torch.get_num_threads() == int(os.environ["WANT_THREADS"])
"""


def _pytest(tmp_path: Path, *args: str, threads: int = 2) -> str:
    (tmp_path / "test_leaks.py").write_text(LEAKS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANT_THREADS": str(threads)}
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            "test_leaks.py",
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout + done.stderr


def test_a_test_that_leaves_global_state_fails_and_the_next_starts_clean(tmp_path: Path) -> None:
    out = _pytest(tmp_path, "--torch-threads", "2", threads=2)
    assert "test_leaks.py::test_threads left global state behind: torch threads 2 → 1" in out, out
    assert "test_env left global state behind: environment variables ['CORPUSD_GUARD_LEAK']" in out
    assert "test_cwd left global state behind: working directory" in out
    # restored: the tests after each leak see the original state, and monkeypatch's own undo
    # is not a leak
    assert (
        "PASSED test_leaks.py::test_clean" in out
        and "PASSED test_leaks.py::test_threads_seen" in out
    )
    assert "5 passed, 3 errors" in out, out


def test_shuffle_keeps_modules_together_and_repeats_an_order_by_its_seed() -> None:
    items = [SimpleNamespace(nodeid=f"tests/{m}.py::t{i}") for m in "abcd" for i in range(4)]
    orders = [shuffled(list(items), seed) for seed in range(6)]
    for order in orders:
        assert sorted(x.nodeid for x in order) == sorted(x.nodeid for x in items)
        modules = [x.nodeid.split("::")[0] for x in order]
        assert all(len(set(modules[i : i + 4])) == 1 for i in range(0, 16, 4)), modules
    assert any(order != items for order in orders), "six seeds all kept the file order"
    assert len({tuple(x.nodeid for x in order) for order in orders}) > 1
    assert shuffled(list(items), 3) == orders[3]
    steps = [SimpleNamespace(nodeid=f"tests/procs/{m}.py::t{i}") for m in "ab" for i in range(5)]
    for seed in range(6):  # a process module's tests are one scenario's steps: file order
        order = [x.nodeid for x in shuffled(list(steps), seed)]
        assert [n for n in order if "/a.py" in n] == [x.nodeid for x in steps[:5]], order
    assert shuffle_seed(None) is None and shuffle_seed("7") == 7
    assert isinstance(shuffle_seed("random"), int)
    with pytest.raises(pytest.UsageError, match="took 'tests/unit' as its seed"):
        shuffle_seed("tests/unit")


def test_shuffle_and_threads_options_reach_the_run(tmp_path: Path) -> None:
    out = _pytest(tmp_path, "--shuffle", "--torch-threads", "1", threads=1)
    assert "torch threads: 1; tests shuffled: repeat with --shuffle=" in out, out
    assert "PASSED test_leaks.py::test_threads_seen" in out, out


MANY = "\n".join(f"def test_{i}():\n    pass\n" for i in range(40))


def test_shuffle_under_xdist_gives_every_worker_the_controllers_order(tmp_path: Path) -> None:
    """``.ci/run`` shuffles under ``-n 2``: a worker that drew its own seed would collect
    another order, and xdist stops with "Different tests were collected"."""
    pytest.importorskip("xdist", reason="pytest-xdist is in the test extra")
    for name in "abc":
        (tmp_path / f"test_many_{name}.py").write_text(MANY)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-q", "-n", "2", "--dist", "loadfile", ".", "--shuffle"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "120 passed" in out, out
