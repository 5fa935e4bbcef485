"""``corpusd up``: the embedded default on loopback — a coordinator, N holders and one agent
worker with the tiny model, state under one directory, stopped together on Ctrl-C / SIGTERM.

``up.json`` in the state directory names every daemon's address and metrics URL while it runs;
the other commands (``pin``, ``status``, ``agents``) find the coordinator through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Any

from corpusd import env, local_ca, security
from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.etcd_local import start_etcd
from corpusd.coordinator.launch import start_coordinator
from corpusd.daemon import Daemon, check_ports, lock_holder, lock_state_dir
from corpusd.supervisor import RESTART_FILE, Supervisor, alive, left_behind, restarts, stop_pids
from corpusd.up_config import UpConfig
from holder.launch import start_holder
from requester.launch import AgentProcess, start_agent


def describe(info: dict[str, Any]) -> str:
    scheme = "https" if info.get("security") else "http"

    def url(port: int) -> str:
        return f"{scheme}://127.0.0.1:{port}/metrics" if port >= 0 else "-"

    def ad(d: dict[str, Any]) -> str:
        return f"  (peers dial {d['advertise']})" if d.get("advertise") else ""

    c = info["coordinator"]
    lines = [
        f"corpusd up (pid {info['pid']}, state {info['state_dir']})",
        f"  coordinator  {c['address']:<22} {url(c['metrics'])}{ad(c)}",
    ]
    for h in info["holders"]:
        lines.append(f"  holder       {h['address']:<22} {url(h['metrics'])}{ad(h)}")
    a = info["agent"]
    lines.append(f"  agent        {a['address']:<22} {url(a['metrics'])}")
    if sec := info.get("security"):
        lines.append(f"  TLS (mutual) and tokens: CA, certificate and tokens in {sec['dir']}")
    else:
        lines.append("  plaintext, no tokens (--insecure)")
    if a.get("http", -1) >= 0:
        lines.append(f"  OpenAI API   {scheme}://127.0.0.1:{a['http']}/v1")
        if sec:  # what an OpenAI client must give: the agent token as its key, and up's CA
            lines.append(
                f"               API key: the agent token in {sec['dir']}/tokens; CA: "
                f"{sec['dir']}/ca.pem; a client certificate is optional"
            )
        lines.append(
            '               eval "$(corpusd client-env)" exports OPENAI_BASE_URL, '
            "OPENAI_API_KEY" + (", SSL_CERT_FILE, CURL_CA_BUNDLE" if sec else "")
        )
    cal = info.get("calibration")
    if cal and cal["ran"]:
        done = f"quick, {cal['seconds']} s" if cal["ok"] else f"FAILED, see {cal['log']}"
        lines.append(f"  calibration  {cal['profile']} ({done}): {cal['why']}")
    elif cal:
        lines.append(f"  calibration  {cal['profile']} (current, or --calibrate off)")
    lines.append("  other commands find the coordinator through up.json; stop: corpusd down")
    return "\n".join(lines)


def calibration_due(mode: str, path: Path, model: Path, max_age_days: float) -> str:
    """Why ``up`` should calibrate now ("" = it should not): ``mode`` off never, always always,
    auto when the profile at ``path`` is missing, unreadable or stale for ``model`` on this
    device."""
    if mode == "off":
        return ""
    if mode == "always":
        return "asked (--calibrate always)"
    if not path.is_file():
        return f"there is no profile at {path}"
    from corpusd.model import fingerprint
    from requester.calibrate import device_name
    from requester.predicate import Profile

    try:
        profile = Profile.load(path)
    except ValueError as e:
        return str(e)
    why = profile.stale(fingerprint(model), device_name(), max_age_days * 86400, time.time())
    return f"{path} is stale: {why}" if why else ""


def _calibrate(
    root: Path, model: Path, out: Path, holder: str, store: Path, probe: str, timeout: float,
    environ: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """``corpusd calibrate --quick`` into ``out`` against ``holder`` (it loads the ``probe``
    corpus of ``store`` and releases it after; "": a holder of its own); its log:
    ``root/calibrate.log``. Returns what happened, for up.json. A failure is reported, not
    raised: the agent keeps the profile there was."""
    t0 = time.perf_counter()
    log = root / "calibrate.log"
    cmd = [sys.executable, "-m", "corpusd", "calibrate", "--quick", "--model", str(model)]
    if holder:  # else it starts a holder of its own, over a temporary store
        cmd += ["--holder", holder, "--corpus", probe, "--store", str(store)]
    with log.open("ab") as f:
        try:
            rc = subprocess.run(
                [*cmd, "--out", str(out)],
                stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=environ,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = -1
    return {"ok": rc == 0, "seconds": round(time.perf_counter() - t0, 1), "log": str(log)}


def up(cfg: UpConfig) -> int:
    root = env.up_dir(cfg.state_dir)
    if (other := env.running_up(cfg.state_dir)) is not None:
        raise ValueError(f"corpusd up is already running (pid {other['pid']}) in {root}")
    if (who := lock_holder(root)) is not None:
        raise ValueError(f"corpusd {who[1]} (pid {who[0]}) is already running in {root}")
    stop_left_behind(root, cfg.timeout_s)
    for flag, ps in cfg.ports().items():  # refused here, before any daemon starts
        for p in ps:
            check_ports("127.0.0.1", {flag: p})
    if not cfg.detach:  # the background `up` takes it (a lock is not inherited)
        lock_state_dir(root, "up")
    if cfg.detach:
        return _detach(cfg, root)
    mode = env.calibrate_mode(cfg.calibrate)
    from corpusd.corpus.pin import default_model  # torch: `down` and `--help` go without
    from corpusd.corpus.store import PageStore
    from requester.calibrate import probe_corpus

    ports = cfg.ports()
    root.mkdir(parents=True, exist_ok=True)
    store = Path(cfg.store).expanduser() if cfg.store else env.default_store_dir()
    model = Path(cfg.model) if cfg.model else default_model(sys.stderr)
    metrics = ports["--metrics-ports"]

    def listen_on(port: int, metrics_port: int) -> tuple[str, ...]:
        return ("--port", str(port), "--metrics-port", str(metrics_port))

    sup = Supervisor(root, sys.stdout)
    stack = contextlib.ExitStack()  # etcd, stopped after the daemons

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    # SIGINT too: a shell script's background job starts with SIGINT ignored, and Python then
    # never raises KeyboardInterrupt, so Ctrl-C / kill -INT would not stop the daemons.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    profile = env.home() / "profile.json"
    why = calibration_due(mode, profile, model, cfg.calibration_max_age_days)
    calibration: dict[str, Any] = {"profile": str(profile), "ran": bool(why), "why": why}
    try:
        print(
            f"starting a coordinator, {cfg.holders} holders and an agent under {root}", flush=True
        )
        probe = ""
        if why:
            print(f"calibrating the cost model (quick): {why}", flush=True)
        if why and cfg.kv_format == "plain":  # on holder-0 as it starts, over a probe corpus
            probe = probe_corpus(PageStore(store), model, min(1024, cfg.capacity_tokens))
        ca = None if cfg.insecure else local_ca.ensure(root / "tls")
        flags, envs = _security(ca)
        state: tuple[str, ...] = ()
        if cfg.state == "etcd":
            etcd = start_etcd(root / "etcd", 3)
            stack.callback(etcd.stop)
            state = ("--state", etcd.url("corpusd"))

        # Each daemon's start, by its ports: a restart passes the ports it got the first time
        # (a free one for 0), so every address in up.json and every daemon's --coordinator stays.
        def coordinator(name: str, port: int, mport: int) -> Daemon:
            return start_coordinator(
                root / name, store, *flags, *state, *listen_on(port, mport),
                timeout=cfg.timeout_s, env=envs["admin"],
            )  # fmt: skip

        def holder(i: int, port: int, mport: int) -> Daemon:
            return start_holder(
                store, root / f"holder-{i}", model, "--coordinator", peers, *cap,
                *_advertise(holder_ads[i]),
                *listen_on(port, mport), timeout=cfg.timeout_s, env=envs["holder"],
            )  # fmt: skip

        def agent_(port: int, mport: int, http: int) -> AgentProcess:
            return start_agent(
                store, root / "agent", model, "--coordinator", peers, *flags,
                *listen_on(port, mport), "--http-port", str(http), *cfg.agent_flags(),
                *_primitive(cfg.agent_primitive), timeout=cfg.timeout_s, env=envs["agent"],
            )  # fmt: skip

        coord = coordinator("coordinator", cfg.coordinator_port, metrics[0])
        sup.add(coord, functools.partial(coordinator, "coordinator", *_bound(coord)))
        print(f"  coordinator  serving on {coord.address}", flush=True)
        address = coord.address
        coordinator_ad, holder_ads = cfg.advertised()
        peers = coordinator_ad or address  # what the holders and the agent dial
        if cfg.state == "etcd":  # a standby; both addresses go to every daemon and up.json
            standby = coordinator("coordinator-1", 0, 0)
            sup.add(standby, functools.partial(coordinator, "coordinator-1", *_bound(standby)))
            address = f"{coord.address},{standby.address}"
            peers = coordinator_ad or address
        cap = ("--capacity-tokens", str(cfg.capacity_tokens), "--kv-format", cfg.kv_format, *flags)
        with ThreadPoolExecutor(cfg.holders + 2) as pool:
            hs = [
                pool.submit(holder, i, ports["--holder-ports"][i], metrics[1 + i])
                for i in range(cfg.holders)
            ]
            ag = pool.submit(agent_, cfg.agent_port, metrics[-1], cfg.http_port)
            if why:  # against holder-0 as soon as it serves (fp8 holders take no plain probe:
                # then a holder of its own); the agent reloads the profile when it is written
                try:
                    target = hs[0].result().address if probe else ""
                    cal_env = _client_env(ca, envs["admin"])
                    calibration.update(
                        _calibrate(
                            root, model, profile, target, store, probe, cfg.timeout_s, cal_env
                        )
                    )
                finally:
                    if probe:
                        PageStore(store).delete(probe)
                ok = calibration["ok"]
                print(
                    f"calibrated in {calibration['seconds']} s: {profile}"
                    if ok
                    else f"calibration failed (see {calibration['log']}); the agent uses "
                    f"{'the old profile' if profile.is_file() else 'the built-in constants'}",
                    flush=True,
                )
            holders = []
            for i, f in enumerate(hs):
                h = f.result()
                holders.append(h)
                sup.add(h, functools.partial(holder, i, *_bound(h)))
                print(f"  holder-{i}     serving on {h.address}", flush=True)
            agent = ag.result()
            sup.add(agent, functools.partial(agent_, *_bound(agent), agent.http_port))
            print(f"  agent        serving on {agent.address}", flush=True)
        ident = None
        if ca is not None:
            ident = security.identity_from(str(ca.ca), str(ca.cert), str(ca.key), ca.token("admin"))
        print(f"waiting for {cfg.holders} holders and the agent to register", flush=True)
        asyncio.run(_ready(address, cfg.holders, cfg.timeout_s, ident))
        info = {
            "pid": os.getpid(),
            "state_dir": str(root),
            "store": str(store),
            "model": str(model),
            "coordinator": {"address": address, "metrics": coord.metrics_port}
            | ({"advertise": coordinator_ad} if coordinator_ad else {}),
            "holders": [
                {"address": h.address, "metrics": h.metrics_port} | ({"advertise": a} if a else {})
                for h, a in zip(holders, holder_ads, strict=True)
            ],
            "calibration": calibration,
            "agent": {
                "address": agent.address,
                "metrics": agent.metrics_port,
                "http": agent.http_port,
            },
            "security": {"dir": str(ca.dir)} if ca is not None else None,
        }
        tmp = root / "up.json.tmp"
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, root / "up.json")
        print(describe(info), flush=True)
        while True:  # until a signal; a daemon that dies is restarted (supervisor.py)
            time.sleep(0.2)
            sup.poll()
    except KeyboardInterrupt:
        print("\nstopping…", flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut this short
            signal.signal(sig, signal.SIG_IGN)
        (root / "up.json").unlink(missing_ok=True)
        daemons = sup.daemons()
        _stop_in_order(daemons)
        if daemons:
            print(f"stopped {len(daemons)} daemons; state kept in {root}", flush=True)
        stack.close()
    return 0


def _stop_in_order(daemons: list[Daemon], timeout: float = 30) -> None:
    """The agent first (its sessions drain while the holders serve), then every holder at
    once, then the coordinator(s); SIGKILL for one that does not exit in ``timeout``."""

    def stop(group: list[Daemon]) -> None:
        for d in group:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        for d in group:
            try:
                d.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                d.kill()

    def role(d: Daemon) -> str:
        return d.state_dir.name.split("-")[0]

    for r in ("agent", "holder", "coordinator"):
        stop([d for d in daemons if role(d) == r])
    stop([d for d in daemons if role(d) not in ("agent", "holder", "coordinator")])


def _primitive(primitive: str) -> tuple[str, ...]:
    """The agent's ``--primitive`` flag where ``up`` was given one other than auto."""
    return ("--primitive", primitive) if primitive != "auto" else ()


def _advertise(address: str) -> tuple[str, ...]:
    """A holder's ``--advertise`` flag ("": none, it registers the address it listens on)."""
    return ("--advertise", address) if address else ()


def _bound(d: Daemon) -> tuple[int, int]:
    """The gRPC and metrics ports ``d`` got (a free one where it was asked for 0)."""
    return int(d.address.rsplit(":", 1)[1]), d.metrics_port


def stop_left_behind(root: Path, timeout: float) -> list[tuple[str, int]]:
    """Stop the daemons an earlier ``corpusd up`` in ``root`` left running when it died (they
    hold their state dirs and ports; this ``up`` starts its own on the same state), saying
    which; returns them."""
    left = left_behind(root)
    if left:
        named = ", ".join(f"{n} (pid {pid})" for n, pid in left)
        print(f"an earlier corpusd up in {root} left daemons running: {named}; stopping them")
        sys.stdout.flush()
        stop_pids([pid for _, pid in left], timeout)
    return left


def _client_env(ca: local_ca.LocalCA | None, base: dict[str, str]) -> dict[str, str]:
    """``base`` (a role's environment) plus the CA and certificate a client of the daemons
    presents: how ``up``'s own calibration reaches holder-0 before up.json exists."""
    if ca is None:
        return base
    tls = {security.ENV_CA: ca.ca, security.ENV_CERT: ca.cert, security.ENV_KEY: ca.key}
    return {**base, **{k: str(v) for k, v in tls.items()}}


def _security(ca: local_ca.LocalCA | None) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The daemons' TLS flags, and each role's environment with its token (tokens travel in
    the environment, never on a command line others can read in ps)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("CORPUSD_TLS_")}
    base.pop(security.ENV_TOKEN, None)
    if ca is None:
        return ["--insecure", "1"], {r: base for r in ("admin", "holder", "agent")}
    flags = ["--tls-cert", str(ca.cert), "--tls-key", str(ca.key), "--tls-ca", str(ca.ca)]
    flags += ["--auth-tokens", str(ca.tokens)]
    envs = {r: {**base, security.ENV_TOKEN: ca.token(r)} for r in ("admin", "holder", "agent")}
    return flags, envs


async def _ready(
    address: str, holders: int, timeout: float, ident: security.Identity | None
) -> None:
    """Until the coordinator sees every holder live and the agent reported."""
    async with CoordinatorClient(address, ident=ident or security.Identity()) as c:
        await c.wait_holders(holders, timeout)
        deadline = time.monotonic() + timeout
        while not any(w.live for w in await c.list_workers()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the agent did not report to the coordinator in {timeout} s")
            await asyncio.sleep(0.1)


def _detach(cfg: UpConfig, root: Path) -> int:
    root.mkdir(parents=True, exist_ok=True)
    log = root / "up.log"
    # every flag but --detach, from the config itself, so none is dropped on the way
    args = [sys.executable, "-m", "corpusd", "up", "--state-dir", str(root)]
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name not in ("detach", "state_dir") and value != "":
            args += ["--" + f.name.replace("_", "-"), str(value)]
    start = log.stat().st_size if log.exists() else 0
    with log.open("ab") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    print(f"corpusd up (pid {proc.pid}) starting in the background; its log: {log}", flush=True)
    deadline = time.monotonic() + cfg.timeout_s + 30
    with log.open("rb") as said:
        said.seek(start)
        partial = b""
        while (info := env.running_up(str(root))) is None or info["pid"] != proc.pid:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"corpusd up did not start: {log.read_text()[-3000:]}")
            *lines, partial = (partial + said.read()).split(b"\n")
            for line in lines:  # progress: what the background `up` says as it starts
                print(line.decode(errors="replace"), flush=True)
            time.sleep(0.2)
        for line in (partial + said.read()).split(b"\n"):  # said before up.json was written
            if line.startswith(b"corpusd up (pid"):
                break
            if line:
                print(line.decode(errors="replace"), flush=True)
    print(describe(info))
    print(f"  log: {log}")
    return 0


def down(flag: str = "", timeout: float = 120) -> int:
    """Stop ``corpusd up`` (it stops its daemons), then every daemon still running on its state
    dir (those a killed ``up`` left, whatever ``up`` started them), and remove a stale
    ``up.json``."""
    root = env.up_dir(flag)
    info = env.running_up(flag)
    pid = int(info["pid"]) if info is not None else 0
    if not pid and (who := lock_holder(root)) is not None:  # an `up` still starting
        pid = who[0]
    if pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if alive(pid):  # its daemons are stopped below, as a killed up's
            print(f"corpusd up (pid {pid}) did not stop in {timeout:g} s: killed it")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        print(f"stopped corpusd up (pid {pid})")
    left = left_behind(root)
    stop_pids([p for _, p in left], timeout)
    stale = (root / "up.json").exists()
    (root / "up.json").unlink(missing_ok=True)
    if left:
        named = ", ".join(f"{n} (pid {p})" for n, p in left)
        print(f"stopped {len(left)} daemon(s) left running in {root}: {named}")
    if not pid and (left or stale):
        print(f"corpusd up in {root} was gone" + (": removed its stale up.json" if stale else ""))
    elif not pid:
        print(f"corpusd up is not running in {root}")
    return 0


def restart(name: str, flag: str = "", timeout: float = 180) -> int:
    """``corpusd restart <name>``: stop one daemon of the running ``up`` (a drain) and let ``up``
    start it again at once, with its arguments, ports and credentials; returns once the new one
    serves. Raises ValueError when ``up`` is not running or has no daemon ``name``."""
    root = env.up_dir(flag)
    if env.running_up(flag) is None:
        raise ValueError(
            f"corpusd up is not running in {root}; `corpusd up` starts every daemon (`corpusd "
            "down` first if it was killed)"
        )
    names = list(restarts(root))
    if name not in names:
        raise ValueError(f"no daemon {name!r} in {root}; its daemons: {', '.join(names)}")
    state_dir = root / name
    old = lock_holder(state_dir)
    (state_dir / RESTART_FILE).touch()
    if old is not None:
        os.kill(old[0], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while True:
        now = lock_holder(state_dir)
        try:
            ep = json.loads((state_dir / "endpoint.json").read_text())
        except (OSError, ValueError):
            ep = {}
        if now is not None and (old is None or now[0] != old[0]) and ep.get("pid") == now[0]:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{name} did not serve again in {timeout} s; see corpusd logs {name}"
            )
        time.sleep(0.2)
    was = f"pid {old[0]} → " if old else ""
    print(f"restarted {name} ({was}pid {now[0]}, {ep.get('address', '')})")
    return 0
