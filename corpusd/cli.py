"""The ``corpusd`` command line. Flags derive from the config dataclasses' defaults.

Exit codes: 0 success; 2 bad input or usage (one ``corpusd: error: …`` line on stderr);
1 an unexpected failure (with its traceback).

Nothing heavy is imported here at module level: the parser is built from torch-free config
modules, and each command imports the model, the store or a daemon when it runs. So ``--help``,
``down``, ``status`` and a ``pin`` whose coordinator is unreachable answer without loading torch
(``tests/unit/test_cli_imports.py`` holds this).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import grpc

import corpusd
from corpusd import env
from corpusd.cli_corpora import cmd_ls, cmd_rm, cmd_status, cmd_unpin
from corpusd.cli_pin import cmd_demo, cmd_pin
from corpusd.cli_pin import count as count  # re-exported: tests/unit/test_pin.py imports it here
from corpusd.coordinator.client import CoordinatorError
from corpusd.coordinator.config import CoordinatorConfig, PublishConfig, StatusConfig
from corpusd.corpus.config import PinConfig
from corpusd.security import SecurityConfig
from corpusd.up_config import UpConfig
from holder.config import HolderConfig
from requester.config import AgentConfig, WorkerConfig

#: Errors a user's input causes (exit 2, one line) beyond ValueError, which covers CorpusError,
#: ModelConfigError, CheckpointError, PortInUse and every config check. As (module, class):
#: looked up only in modules already imported, since an error of a module never loaded cannot
#: have been raised, and importing it to look would load torch for every command.
_USER_ERRORS = (("corpusd.corpus.store", "StoreError"), ("requester.client", "AgentError"))
#: indexer.ARITHS, named here so that ``model init --help`` needs no torch (a test holds them equal)
INDEX_ARITHS = ("exact", "fp8")


def user_error(e: BaseException) -> bool:
    """Whether ``e`` is bad input (answered with one line and exit code 2)."""
    if isinstance(e, ValueError):
        return True
    for module, name in _USER_ERRORS:
        m = sys.modules.get(module)
        if m is not None and isinstance(e, getattr(m, name)):
            return True
    return False


def cmd_serve(a: argparse.Namespace) -> int:
    from corpusd.coordinator.server import run

    run(CoordinatorConfig.from_flags(a))
    return 0


def cmd_calibrate(a: argparse.Namespace) -> int:
    from holder.launch import start_holder
    from requester.calibrate import run

    run(a.model, a.store, a.out, a.holder, a.corpus, a.repeats, start_holder, a.quick)
    return 0


def cmd_agent(a: argparse.Namespace) -> int:
    from corpusd.corpus.pin import default_model
    from corpusd.daemon import claim
    from requester.config import AgentConfig, WorkerConfig
    from requester.server import ports, run

    cfg = AgentConfig.from_flags(
        a, coordinator=env.coordinator(a.coordinator) if not a.holders else ""
    )
    wcfg = WorkerConfig(**{f.name: getattr(a, f.name) for f in fields(WorkerConfig)})
    if not (cfg.coordinator or cfg.holders):
        raise ValueError(f"{env.NO_COORDINATOR}; or give an agent --holders")
    claim(Path(cfg.state_dir), "agent", cfg.host, ports(cfg))  # before the model is written
    run(cfg, wcfg, Path(cfg.model) if cfg.model else default_model(sys.stderr))
    return 0


def cmd_up(a: argparse.Namespace) -> int:
    from corpusd.up import up

    return up(UpConfig(**{f.name: getattr(a, f.name) for f in fields(UpConfig)}))


def cmd_down(a: argparse.Namespace) -> int:
    from corpusd.up import down

    return down(a.state_dir)


def cmd_client_env(a: argparse.Namespace) -> int:
    """What a client of the running ``up``'s OpenAI-compatible API needs, as export lines."""
    from corpusd.client_env import exports

    info = env.running_up(a.state_dir)
    if info is None:
        raise ValueError(f"no running `corpusd up` in {env.up_dir(a.state_dir)}")
    print(exports(info))
    return 0


def cmd_prometheus_config(a: argparse.Namespace) -> int:
    """A Prometheus scrape config for the running ``up``'s metrics ports, to stdout or --out."""
    from corpusd.prometheus_config import render

    info = env.running_up(a.state_dir)
    if info is None:
        raise ValueError(f"no running `corpusd up` in {env.up_dir(a.state_dir)}")
    text = render(info, a.scrape_interval)
    if not a.out:
        print(text, end="")
        return 0
    out = Path(a.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)  # a Prometheus reloading it never reads half a file
    print(f"wrote {out}: {text.count('job_name')} jobs")
    return 0


def cmd_ps(a: argparse.Namespace) -> int:
    """The daemons of a ``corpusd up``: running or exited, pid, id, address, metrics, uptime."""
    from corpusd import ps
    from corpusd.coordinator.status import as_json

    root = env.up_dir(a.state_dir)
    procs = ps.processes(root)
    if a.json:
        print(as_json(procs))
    elif not procs:
        print(f"no daemons: nothing was started with `corpusd up` in {root}")
    else:
        print(ps.render(procs, ps.tls(root)))
    return 0


def cmd_restart(a: argparse.Namespace) -> int:
    from corpusd.up import restart

    return restart(a.daemon, a.state_dir)


def cmd_logs(a: argparse.Namespace) -> int:
    """The tail of every daemon's log (or one's), and with --follow what they append."""
    from corpusd import ps

    if a.lines < 0:
        raise ValueError(f"--lines must be >= 0, got {a.lines}")
    logs = ps.log_files(env.up_dir(a.state_dir), a.daemon)
    with contextlib.suppress(KeyboardInterrupt):  # the way out of --follow
        ps.show_logs(logs, a.lines, a.follow, sys.stdout)
    return 0


def cmd_agents(a: argparse.Namespace) -> int:
    from requester.agents import run_agents

    address = env.coordinator(a.coordinator)
    if not address:
        raise ValueError(env.NO_COORDINATOR)
    if not 1 <= a.agents <= 256 or not 1 <= a.tokens <= 4096:
        raise ValueError("--agents must be in 1..256 and --tokens in 1..4096")
    print(asyncio.run(run_agents(address, a.corpus, a.agents, a.tokens)))
    return 0


def cmd_ask(a: argparse.Namespace) -> int:
    """One question over a corpus, the answer streamed as it is generated."""
    from requester.ask import ask

    address = env.coordinator(a.coordinator) if not a.agent else ""
    if not (address or a.agent):
        raise ValueError(f"{env.NO_COORDINATOR}; or give --agent HOST:PORT")
    if not a.question.strip():
        raise ValueError("the question is empty")
    if not 1 <= a.max_tokens <= 4096 or a.temperature < 0:
        raise ValueError("--max-tokens must be in 1..4096 and --temperature >= 0")
    finish = asyncio.run(
        ask(
            a.corpus,
            a.question,
            sys.stdout,
            sys.stderr,
            coordinator=address,
            agent=a.agent,
            max_tokens=a.max_tokens,
            temperature=a.temperature,
            seed=a.seed,
        )
    )
    return 0 if finish else 1


def cmd_model_init(a: argparse.Namespace) -> int:
    from corpusd.model.tiny import init_tiny

    out = Path(a.dir)
    if (out / "config.json").exists() and not a.force:
        raise ValueError(f"{out} already holds a model; pass --force to overwrite it")
    overrides: dict[str, object] = {}
    if a.heads is not None:
        overrides.update(num_attention_heads=a.heads)
    if a.index_topk is not None:
        overrides.update(index_topk=a.index_topk)
    if a.index_arith != "exact":
        overrides.update(index_arith=a.index_arith)
    init_tiny(out, seed=a.seed, preset=a.preset, **overrides)
    what = "".join(f", {k} {v}" for k, v in overrides.items())
    print(f"wrote the tiny DeepSeek-V3.2 checkpoint ({a.preset}, seed {a.seed}{what}) to {out}")
    return 0


def add_dataclass_flags(p: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per field of a config dataclass, typed and defaulted from the class; a
    field's ``metadata`` may add ``help``, ``choices`` and ``const`` (the flag then takes its
    value optionally: ``--detach`` alone means ``--detach 1``). ``{state_home}`` in a help text
    is the class's ``STATE_HOME`` (a daemon's state directory under $CORPUSD_HOME)."""
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = {"int": int, "float": float}.get(str(f.type), str)
        text = f.metadata.get("help", "").replace("{state_home}", getattr(cls, "STATE_HOME", ""))
        extra: dict[str, Any] = {}
        if "choices" in f.metadata:
            extra["choices"] = f.metadata["choices"]
        if "const" in f.metadata:
            extra.update(nargs="?", const=f.metadata["const"])
        if f.default is MISSING:
            p.add_argument(flag, type=kind, required=True, dest=f.name, help=text, **extra)
        else:
            if f.default not in (None, "") and "(default" not in text:
                text = f"{text} (default: {f.default})".strip()
            p.add_argument(flag, type=kind, default=f.default, dest=f.name, help=text, **extra)


def cmd_holder(a: argparse.Namespace) -> int:
    from corpusd.corpus.pin import default_model
    from corpusd.daemon import claim
    from holder.server import ports, run

    cfg = HolderConfig.from_flags(a)
    claim(Path(cfg.state_dir), "holder", cfg.host, ports(cfg))  # before the model is written
    model_dir = Path(cfg.model) if cfg.model else default_model(sys.stderr)
    run(cfg, model_dir)
    return 0


_NO_COORD = "no coordinator is found (default: $CORPUSD_STORE)"
#: SecurityConfig fields only a daemon uses
_SERVER_ONLY = ("auth_tokens",)


def _configure_security(a: argparse.Namespace) -> None:
    """The command's TLS and token flags (with their env defaults) become this process's
    identity; a daemon's bind is checked against them before anything starts."""
    if not hasattr(a, "tls_cert"):
        return
    from corpusd import security

    values: dict[str, Any] = {f.name: getattr(a, f.name, f.default) for f in fields(SecurityConfig)}
    security.configure(SecurityConfig(**values))
    if hasattr(a, "host"):
        security.serving(a.host)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="corpusd", description=corpusd.__doc__)
    p.add_argument("--version", action="version", version=f"corpusd {corpusd.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("pin", help="tokenize, prefill and store a corpus")
    add_dataclass_flags(pp, PinConfig)
    add_dataclass_flags(pp, PublishConfig)
    add_dataclass_flags(pp, SecurityConfig, skip=_SERVER_ONLY)
    pp.set_defaults(func=cmd_pin)
    pd = sub.add_parser(
        "demo", help="pin (and publish, with a coordinator) a sample repository on the tiny model"
    )
    add_dataclass_flags(pd, PinConfig, skip=("corpus",))
    add_dataclass_flags(pd, PublishConfig)
    pd.add_argument(
        "--package",
        default="",
        help="pin this installed package's *.py source instead (e.g. prometheus_client, ~200 KB)",
    )
    add_dataclass_flags(pd, SecurityConfig, skip=_SERVER_ONLY)
    pd.set_defaults(func=cmd_demo)
    ph = sub.add_parser("holder", help="serve pinned pages of one device over gRPC")
    add_dataclass_flags(ph, HolderConfig)
    add_dataclass_flags(ph, SecurityConfig)
    ph.set_defaults(func=cmd_holder)
    pc = sub.add_parser(
        "calibrate", help="measure the route/fetch/local cost model and write its profile"
    )
    pc.add_argument("--holder", default="", help="a holder's address ('' = start one here)")
    pc.add_argument("--corpus", default="", help="a corpus that holder holds in full")
    pc.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    pc.add_argument("--store", default="", help="page store (default: $CORPUSD_STORE)")
    pc.add_argument("--out", default="", help="profile path (default: $CORPUSD_HOME/profile.json)")
    pc.add_argument(
        "--repeats", type=int, default=5, help="timings per measured point (the median is kept)"
    )
    pc.add_argument(
        "--quick",
        action="store_true",
        help="seconds, not minutes: fewer points, against random pages in a temporary store",
    )
    pc.set_defaults(func=cmd_calibrate)
    ps = sub.add_parser("serve", help="run the coordinator: holders, placement, page table")
    add_dataclass_flags(ps, CoordinatorConfig)
    add_dataclass_flags(ps, SecurityConfig)
    ps.set_defaults(func=cmd_serve)
    pt = sub.add_parser("status", help="a coordinator's holders, corpora and agent workers")
    add_dataclass_flags(pt, StatusConfig)
    add_dataclass_flags(pt, SecurityConfig, skip=_SERVER_ONLY)
    pt.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    pt.set_defaults(func=cmd_status)
    pl = sub.add_parser(
        "ls", help="corpora: name, id, tokens, replicas, holders, state, age (ls --json: JSON)"
    )
    add_dataclass_flags(pl, StatusConfig)
    add_dataclass_flags(pl, SecurityConfig, skip=_SERVER_ONLY)
    pl.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    pl.add_argument("--store", default="", help=f"page store listed when {_NO_COORD}")
    pl.set_defaults(func=cmd_ls)
    pn = sub.add_parser(
        "unpin", help="take a corpus off every holder and out of the page table (atomically)"
    )
    pn.add_argument("corpus", metavar="NAME|ID", help="corpus name, id, or id prefix (≥ 8)")
    pn.add_argument("--delete", action="store_true", help="also delete it from the page store")
    add_dataclass_flags(pn, StatusConfig)
    add_dataclass_flags(pn, SecurityConfig, skip=_SERVER_ONLY)
    pn.set_defaults(func=cmd_unpin)
    pr = sub.add_parser("rm", help="delete an unpinned corpus from the page store")
    pr.add_argument("corpus", metavar="NAME|ID", help="corpus name, id, or id prefix (≥ 8)")
    add_dataclass_flags(pr, StatusConfig)
    add_dataclass_flags(pr, SecurityConfig, skip=_SERVER_ONLY)
    pr.add_argument("--store", default="", help=f"page store it is deleted from when {_NO_COORD}")
    pr.set_defaults(func=cmd_rm)
    pa = sub.add_parser("agent", help="run a decode worker serving the Agent API")
    add_dataclass_flags(pa, AgentConfig)
    add_dataclass_flags(pa, WorkerConfig, skip=("trace",))
    add_dataclass_flags(pa, SecurityConfig)
    pa.set_defaults(func=cmd_agent, trace=False)
    pu = sub.add_parser(
        "up", help="coordinator + holders + agent on loopback with the tiny model (Ctrl-C stops)"
    )
    add_dataclass_flags(pu, UpConfig)
    pu.set_defaults(func=cmd_up)
    pw = sub.add_parser("down", help="stop a `corpusd up` started with --detach 1")
    pw.add_argument(
        "--state-dir", default="", help="its state directory (default: $CORPUSD_HOME/up)"
    )
    pw.set_defaults(func=cmd_down)
    up_state = "the state directory of `corpusd up` (default: $CORPUSD_HOME/up)"
    pe = sub.add_parser(
        "client-env",
        help="what an OpenAI client (or curl) of `corpusd up`'s HTTP API needs: base URL, API "
        'key and CA, as export lines for eval "$(corpusd client-env)"',
    )
    pe.add_argument("--state-dir", default="", help=up_state)
    pe.set_defaults(func=cmd_client_env)
    pm = sub.add_parser(
        "prometheus-config",
        help="a Prometheus scrape config (YAML) for `corpusd up`'s metrics ports: a job per "
        "role, with up's CA, client certificate and key for the mutual TLS they serve",
    )
    pm.add_argument("--state-dir", default="", help=up_state)
    pm.add_argument("--out", default="", help="write it to this file (default: stdout)")
    pm.add_argument(
        "--scrape-interval",
        default="15s",
        help="each job's scrape_interval, a Prometheus duration (default 15s)",
    )
    pm.set_defaults(func=cmd_prometheus_config)
    px = sub.add_parser(
        "restart", help="restart one daemon of a running `corpusd up` (same ports, credentials)"
    )
    px.add_argument("daemon", help="coordinator, holder-0, …, agent (as `corpusd ps` names them)")
    px.add_argument("--state-dir", default="", help=up_state)
    px.set_defaults(func=cmd_restart)
    pq = sub.add_parser("ps", help="the daemons `corpusd up` started: pids, ports, uptime")
    pq.add_argument("--state-dir", default="", help=up_state)
    pq.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    pq.set_defaults(func=cmd_ps)
    po = sub.add_parser("logs", help="the logs of the daemons `corpusd up` started")
    po.add_argument(
        "daemon",
        nargs="?",
        default="",
        help="up, coordinator, holder-0, …, agent (as `corpusd ps` names them; default: all)",
    )
    po.add_argument(
        "-n", "--lines", type=int, default=20, help="last lines of each log; 0: all (default: 20)"
    )
    po.add_argument(
        "-f", "--follow", action="store_true", help="then print what they append, until Ctrl-C"
    )
    po.add_argument("--state-dir", default="", help=up_state)
    po.set_defaults(func=cmd_logs)
    pg = sub.add_parser("agents", help="run N sub-agents with different questions over a corpus")
    pg.add_argument("--corpus", required=True, help="corpus id, name or id prefix")
    pg.add_argument("--agents", type=int, default=8, help="sub-agents (sessions) run at once")
    pg.add_argument("--tokens", type=int, default=24, help="answer length of each")
    pg.add_argument(
        "--coordinator",
        default="",
        help=f"coordinator host:port (default: {env.COORDINATOR_DEFAULT})",
    )
    add_dataclass_flags(pg, SecurityConfig, skip=_SERVER_ONLY)
    pg.set_defaults(func=cmd_agents)
    pk = sub.add_parser("ask", help="ask one question over a corpus; the answer streams as made")
    pk.add_argument("question", help="the question (quote it)")
    pk.add_argument("--corpus", required=True, help="corpus id, name or id prefix")
    pk.add_argument(
        "--max-tokens", type=int, default=64, help="answer length, at most (default: 64)"
    )
    pk.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled"
    )
    pk.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    pk.add_argument(
        "--coordinator",
        default="",
        help=f"coordinator host:port (default: {env.COORDINATOR_DEFAULT})",
    )
    pk.add_argument(
        "--agent", default="", help="an agent worker's host:port, instead of the coordinator's pick"
    )
    add_dataclass_flags(pk, SecurityConfig, skip=_SERVER_ONLY)
    pk.set_defaults(func=cmd_ask)
    pm = sub.add_parser("model", help="model checkpoints")
    msub = pm.add_subparsers(dest="model_command", required=True)
    pi = msub.add_parser("init", help="write a deterministic tiny checkpoint (random weights)")
    pi.add_argument("dir")
    pi.add_argument("--seed", type=int, default=0)
    pi.add_argument(
        "--preset",
        choices=("cpu", "sglang"),
        default="cpu",
        help="cpu: BPE tokenizer, 16 × 64 indexer, pins fast on a CPU (default); sglang: "
        "byte tokens and V3.2's 64 × 128 indexer, the shape SGLang and the GPU tests need",
    )
    pi.add_argument("--force", action="store_true")
    pi.add_argument("--heads", type=int, choices=(64, 128), help="attention heads (default: 64)")
    pi.add_argument(
        "--index-topk",
        type=int,
        help="keys the indexer selects per query (default: 128; SGLang's NSA kernels need 2048)",
    )
    pi.add_argument(
        "--index-arith",
        choices=INDEX_ARITHS,
        default="exact",
        help="the indexer's arithmetic: exact float32 (transformers; default) or fp8 "
        "(Hadamard + ue8m0 float8, as SGLang and DeepSeek's inference code: pin for SGLang)",
    )
    pi.set_defaults(func=cmd_model_init)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _configure_security(args)
        code = int(args.func(args))
        sys.stdout.flush()  # here, so a reader that left is seen by the handler below
        return code
    except BrokenPipeError:
        return _reader_left()
    except CoordinatorError as e:
        print(f"corpusd: error: coordinator: {e}", file=sys.stderr)
        return 1 if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL) else 2
    except Exception as e:
        if not user_error(e):
            raise
        print(f"corpusd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("corpusd: interrupted; nothing was committed", file=sys.stderr)
        return 130


def _reader_left() -> int:
    """stdout's reader closed it (``corpusd ask … | head -2``): end quietly with 141, the
    status of a command a shell saw killed by SIGPIPE (``seq 1e9 | head -1``), and point
    stdout at /dev/null so the interpreter's last flush does not report it again."""
    import os

    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 141


if __name__ == "__main__":
    sys.exit(main())
