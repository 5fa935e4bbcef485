"""Shared fixtures: the tiny checkpoint (written once per session) and the transformers oracle;
a guard that fails any test leaving global state behind; ``--shuffle`` and ``--torch-threads``
to run the suite in another order and at another thread count (``.ci/run`` does both, under
pytest-xdist)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, TypeVar

import pytest
import torch

# Not a test's leak, so the guard below leaves them be: pytest's own (it names the running
# test), and what code sets at import, by design, once per process (the SGLang plugin's default
# for SGLang, requester/sglang/deepseek_v32.py; torch's inductor cache directory, which
# ``torch._dynamo`` sets when a test's first ``nn.init`` under a device context imports it).
_PYTEST_OWN = frozenset({"PYTEST_CURRENT_TEST"})
# set by an import (SGLang's, and DeepGEMM's and OpenMP's under it, on a GPU host); a test
# that imports them first cannot undo it
_SET_AT_IMPORT = frozenset({
    "SGLANG_NSA_FUSE_TOPK", "TORCHINDUCTOR_CACHE_DIR", "DG_JIT_CACHE_DIR", "DG_JIT_USE_NVRTC",
    "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK",
})  # fmt: skip


class _HasNodeid(Protocol):
    @property
    def nodeid(self) -> str: ...


_Item = TypeVar("_Item", bound=_HasNodeid)
_SEED = pytest.StashKey["int | None"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("corpusd")
    group.addoption(
        "--shuffle",
        nargs="?",
        const="random",
        default=None,
        metavar="SEED",
        help="run the modules, and the tests inside each, in a random order (the seed is "
        "printed; --shuffle=SEED repeats an order). Write --shuffle=SEED or put --shuffle "
        "after the paths, or it takes the next argument as its seed.",
    )
    group.addoption(
        "--torch-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch.set_num_threads(N) before any test (default: torch's own choice)",
    )


def shuffle_seed(value: str | None) -> int | None:
    """``--shuffle``'s value as a seed: None when not shuffling, a fresh one for a bare
    ``--shuffle``; UsageError for a value that is not an integer (a path it swallowed)."""
    if value is None:
        return None
    if value == "random":
        return random.SystemRandom().randrange(2**32)
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(
            f"--shuffle took {value!r} as its seed: write --shuffle=SEED, or put --shuffle "
            "after the paths"
        ) from None


def pytest_configure(config: pytest.Config) -> None:
    threads = config.getoption("--torch-threads")
    if threads is not None:
        if threads < 1:
            raise pytest.UsageError(f"--torch-threads {threads}: give at least 1")
        torch.set_num_threads(threads)
    workerinput = getattr(config, "workerinput", None)  # set in a pytest-xdist worker
    if workerinput is not None and "corpusd_shuffle_seed" in workerinput:
        # every worker must collect the same order: the controller's seed, not one of its own
        config.stash[_SEED] = workerinput["corpusd_shuffle_seed"]
    else:
        config.stash[_SEED] = shuffle_seed(config.getoption("--shuffle"))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: object) -> None:
    """pytest-xdist (``-n``): hand the controller's shuffle seed to each worker."""
    node.workerinput["corpusd_shuffle_seed"] = node.config.stash.get(_SEED, None)  # type: ignore[attr-defined]


def _order_line(config: pytest.Config) -> str:
    seed = config.stash.get(_SEED, None)
    order = "in file order" if seed is None else f"shuffled: repeat with --shuffle={seed}"
    return f"torch threads: {torch.get_num_threads()}; tests {order}"


def pytest_report_header(config: pytest.Config) -> str:
    return _order_line(config)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The seed again at the end, where ``-q`` (no header) still shows it."""
    terminalreporter.write_line(_order_line(terminalreporter.config))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seed = config.stash.get(_SEED, None)
    if seed is not None:
        items[:] = shuffled(items, seed)


#: modules whose tests are the steps of one scenario, in file order: a process tier module's
#: tests share its module-scoped daemons, and a later step reads what an earlier one left there
#: (a corpus pinned, then removed; request counters)
SCENARIOS = "tests/procs/"


def shuffled(items: list[_Item], seed: int) -> list[_Item]:
    """Shuffle modules, then the tests inside each module except a scenario's (SCENARIOS): a
    module's tests stay together, so module-scoped fixtures are still set up once, while any
    order dependence between modules, and between the tests of an in-process module, shows.
    The same seed gives the same order."""
    rng = random.Random(seed)
    modules: dict[str, list[_Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = list(modules.items())
    rng.shuffle(order)
    for path, group in order:
        if not path.startswith(SCENARIOS):
            rng.shuffle(group)
    return [item for _, group in order for item in group]


@pytest.fixture(autouse=True)
def _no_global_state_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that changes torch's thread count, the environment or the working directory
    and leaves it changed (all three change later tests' arithmetic or paths); restore them
    first so the next test starts clean. ``monkeypatch`` undoes its changes before this runs."""
    threads, environ, cwd = torch.get_num_threads(), dict(os.environ), os.getcwd()
    yield
    leaks = []
    if torch.get_num_threads() != threads:
        leaks.append(f"torch threads {threads} → {torch.get_num_threads()}")
        torch.set_num_threads(threads)
    now = dict(os.environ)
    changed = sorted(k for k in environ.keys() | now.keys() if environ.get(k) != now.get(k))
    changed = [
        k
        for k in changed
        if k not in _PYTEST_OWN and not (k in _SET_AT_IMPORT and k not in environ)
    ]
    if changed:
        leaks.append(f"environment variables {changed}")
        for key in changed:
            if key in environ:
                os.environ[key] = environ[key]
            else:
                os.environ.pop(key, None)
    if os.getcwd() != cwd:
        leaks.append(f"working directory {cwd} → {os.getcwd()}")
        os.chdir(cwd)
    if leaks:
        pytest.fail(f"{request.node.nodeid} left global state behind: {'; '.join(leaks)}")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU default (``corpusd model init``): BPE tokenizer, 16 × 64 indexer."""
    from corpusd.model.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def sglang_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``corpusd model init --preset sglang``: byte tokens, V3.2's 64 × 128 indexer."""
    from corpusd.model.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("sglang-model"), preset="sglang")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path):  # type: ignore[no-untyped-def]
    from corpusd.model import load_model

    return load_model(tiny_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_model(tiny_dir: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip(
        "transformers", reason="transformers is the test oracle: pip install -e '.[test]'"
    )
    model = transformers.DeepseekV32ForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One real etcd member on loopback for the session (tests take a fresh key prefix each)."""
    from corpusd.coordinator.etcd_local import etcd_binary, start_etcd

    if etcd_binary() is None:
        pytest.skip("no etcd binary: apt-get install etcd-server (the etcd state store's tests)")
    cluster = start_etcd(tmp_path_factory.mktemp("etcd"), 1)
    yield cluster
    cluster.stop()


def _state_flags(request: pytest.FixtureRequest) -> tuple[str, ...]:
    if request.param == "sqlite":
        return ()
    import uuid

    cluster = request.getfixturevalue("etcd")
    return ("--state", cluster.url(f"t{uuid.uuid4().hex[:12]}"))


@pytest.fixture(params=["sqlite", "etcd"])
def state_flags(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """``corpusd serve`` flags for each state store: none (SQLite, the default), then
    ``--state etcd://…/<fresh prefix>`` on the session's etcd (skipped without etcd)."""
    return _state_flags(request)


@pytest.fixture(scope="module", params=["sqlite", "etcd"])
def module_state_flags(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """``state_flags`` for a module's shared coordinator."""
    return _state_flags(request)
