"""Load test (issue 20): N concurrent sessions open → generate → close against a ``corpusd up``
(secure by default: mutual TLS and tokens), for N in ``--levels``; p50/p99 of each phase and a
count of every gRPC status code any call returned.

A session refused with RESOURCE_EXHAUSTED (no worker has room: explicit load shedding) waits
and tries again until ``--deadline-s``; such refusals and the retries they cost are counted
apart from errors. Every session's tokens are checked against a reference: the same prompt
decoded greedily alone, before the round (``wrong_tokens``). Any other non-OK status, a wrong
token, or a session still refused at the deadline is an error, and the script exits 1 when
there is one.

    python -m tools.bench_load --levels 8,32,128,256 --out bench/results/load-cpu.json

Without ``--coordinator`` it starts its own ``corpusd up --detach`` (tiny model) in a temporary
``CORPUSD_HOME``, pins a small generated corpus, and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

QUESTIONS = [
    "\nQ: what does f{i} return?\nA:",
    "\nQ: which function multiplies by {i}?\nA:",
    "\nQ: list the functions near f{i}.\nA:",
]


@dataclass
class Level:
    sessions: int
    codes: Counter[str] = field(default_factory=Counter)
    open_s: list[float] = field(default_factory=list)
    first_s: list[float] = field(default_factory=list)
    session_s: list[float] = field(default_factory=list)
    close_s: list[float] = field(default_factory=list)
    tokens: int = 0
    failed: int = 0
    resource_exhausted: int = 0  # refusals of OpenSession, each followed by a retry or the end
    retried_sessions: int = 0  # sessions that needed at least one retry
    wrong_tokens: int = 0  # sessions whose tokens differ from their prompt's reference
    checked: int = 0  # sessions whose tokens were compared
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def prompt_of(i: int) -> str:
    return QUESTIONS[i % len(QUESTIONS)].format(i=i % 24)


async def references(coordinator: str, corpus: str, n: int, tokens: int) -> dict[str, list[int]]:
    """Each distinct prompt of a round of ``n`` sessions, decoded greedily alone: the tokens
    every session of that prompt must give under load."""
    from requester.client import Client

    out: dict[str, list[int]] = {}
    async with Client(coordinator=coordinator) as c:
        for prompt in sorted({prompt_of(i) for i in range(n)}):
            s = await c.open_session(corpus, prompt, reserve_tokens=tokens)
            out[prompt] = list((await c.complete(s, max_tokens=tokens)).token_ids)
            await c.close_session(s)
    return out


async def one(
    c: Any, corpus: str, i: int, tokens: int, deadline: float, lv: Level, ref: dict[str, list[int]]
) -> None:
    from requester.client import AgentError

    t0 = time.perf_counter()
    prompt = prompt_of(i)
    retried = False
    while True:
        try:
            s = await c.open_session(corpus, prompt, reserve_tokens=tokens)
            lv.codes["OpenSession:OK"] += 1
            break
        except AgentError as e:
            if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                lv.resource_exhausted += 1
            else:
                lv.codes[f"OpenSession:{e.code.name}"] += 1
            if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.perf_counter() > deadline:
                if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # refused past the deadline
                    lv.codes["OpenSession:RESOURCE_EXHAUSTED_AT_DEADLINE"] += 1
                lv.failed += 1
                lv.errors.append(f"OpenSession: {e}")
                return
            lv.retried_sessions += not retried
            retried = True
            await asyncio.sleep(random.uniform(0.1, 0.5))
    t1 = time.perf_counter()
    lv.open_s.append(t1 - t0)
    got, first, ids = 0, 0.0, list[int]()
    try:
        async for ch in c.generate(s, max_tokens=tokens):
            if not got and ch.token_ids:
                first = time.perf_counter() - t1
            got += len(ch.token_ids)
            ids += ch.token_ids
        lv.codes["Generate:OK"] += 1
        if prompt in ref:
            lv.checked += 1
            if ids != ref[prompt]:
                lv.wrong_tokens += 1
                lv.errors.append(f"wrong tokens for {prompt!r}: {ids} != {ref[prompt]}")
    except AgentError as e:
        lv.codes[f"Generate:{e.code.name}"] += 1
        lv.failed += 1
        lv.errors.append(f"Generate: {e}")
    t2 = time.perf_counter()
    try:
        await c.close_session(s)
        lv.codes["CloseSession:OK"] += 1
    except AgentError as e:
        lv.codes[f"CloseSession:{e.code.name}"] += 1
        lv.failed += 1
        lv.errors.append(f"CloseSession: {e}")
    t3 = time.perf_counter()
    lv.first_s.append(first)
    lv.close_s.append(t3 - t2)
    lv.session_s.append(t3 - t0)
    lv.tokens += got


async def run_level(coordinator: str, corpus: str, n: int, tokens: int, deadline_s: float) -> Level:
    from requester.client import Client

    lv = Level(n)
    ref = await references(coordinator, corpus, n, tokens)
    async with Client(coordinator=coordinator, timeout=deadline_s) as c:
        t0 = time.perf_counter()
        deadline = t0 + deadline_s
        await asyncio.gather(*(one(c, corpus, i, tokens, deadline, lv, ref) for i in range(n)))
        lv.wall_s = time.perf_counter() - t0
    return lv


def summary(lv: Level) -> dict[str, Any]:
    def ms(xs: list[float]) -> dict[str, float]:
        return {"p50_ms": round(pct(xs, 0.5) * 1e3, 1), "p99_ms": round(pct(xs, 0.99) * 1e3, 1)}

    errors = {k: v for k, v in lv.codes.items() if not k.endswith(":OK")}
    return {
        "sessions": lv.sessions,
        "completed": len(lv.session_s) - lv.failed,
        "failed": lv.failed,
        "tokens": lv.tokens,
        "wall_s": round(lv.wall_s, 2),
        "tokens_per_s": round(lv.tokens / lv.wall_s, 1) if lv.wall_s else 0.0,
        "open": ms(lv.open_s),
        "first_token": ms(lv.first_s),
        "close": ms(lv.close_s),
        "session": ms(lv.session_s),
        "codes": dict(sorted(lv.codes.items())),
        "resource_exhausted": lv.resource_exhausted,
        "retried_sessions": lv.retried_sessions,
        "checked_sessions": lv.checked,
        "wrong_tokens": lv.wrong_tokens,
        "errors_other_than_resource_exhausted": sum(errors.values()) + lv.wrong_tokens,
        "error_samples": lv.errors[:5],
    }


def corpusd(env: dict[str, str], *args: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "corpusd", *args], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"corpusd {' '.join(args)}: {r.stdout}\n{r.stderr}")
    return r.stdout


def small_corpus(root: Path) -> Path:
    src = root / "repo" / "pkg"
    src.mkdir(parents=True)
    for k in range(3):
        (src / f"m{k}.py").write_text(
            "".join(f"def f{i}(x):\n    return x * {i} + {k}\n" for i in range(24))
        )
    with tarfile.open(root / "repo.tar", "w") as tar:
        tar.add(root / "repo", arcname="repo")
    return root / "repo.tar"


def start_up(home: Path, holders: int, insecure: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORPUSD_")}
    env["CORPUSD_HOME"] = str(home)
    corpusd(env, "model", "init", str(home / "models" / "tiny"))
    extra = ["--insecure"] if insecure else []
    corpusd(env, "up", "--holders", str(holders), "--capacity-tokens", "8192", "--detach", *extra)
    corpusd(env, "pin", "--corpus", str(small_corpus(home)), "--name", "load")
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--levels", default="8,32,128,256,512", help="concurrent sessions per round")
    p.add_argument("--tokens", type=int, default=4, help="tokens generated per session")
    p.add_argument("--holders", type=int, default=2)
    p.add_argument("--deadline-s", type=float, default=300.0, help="per round")
    p.add_argument(
        "--coordinator", default="", help="an existing corpusd up's (default: start one)"
    )
    p.add_argument("--corpus", default="load")
    p.add_argument("--insecure", action="store_true", help="start the up with --insecure")
    p.add_argument("--out", default="", help="JSON result file")
    a = p.parse_args(argv)
    levels = [int(x) for x in a.levels.split(",")]
    tmp = tempfile.TemporaryDirectory(prefix="bench-load-")
    env = None
    try:
        if a.coordinator:
            coordinator = a.coordinator
        else:
            env = start_up(Path(tmp.name) / "home", a.holders, a.insecure)
            os.environ["CORPUSD_HOME"] = env["CORPUSD_HOME"]  # this process finds up's TLS too
            info = json.loads((Path(env["CORPUSD_HOME"]) / "up" / "up.json").read_text())
            coordinator = info["coordinator"]["address"]
        rows = []
        print(f"{'sessions':>8} {'done':>5} {'fail':>4} {'wrong':>5} {'RE':>6} {'retried':>7} "
              f"{'wall s':>7} {'open p50/p99 ms':>17} {'first p50/p99':>15} "
              f"{'session p50/p99':>17}  codes")  # fmt: skip
        for n in levels:
            lv = asyncio.run(run_level(coordinator, a.corpus, n, a.tokens, a.deadline_s))
            r = summary(lv)
            rows.append(r)
            print(
                f"{n:>8} {r['completed']:>5} {r['failed']:>4} {r['wrong_tokens']:>5} "
                f"{r['resource_exhausted']:>6} {r['retried_sessions']:>7} {r['wall_s']:>7.1f} "
                f"{r['open']['p50_ms']:>8.0f}/{r['open']['p99_ms']:<8.0f} "
                f"{r['first_token']['p50_ms']:>7.0f}/{r['first_token']['p99_ms']:<7.0f} "
                f"{r['session']['p50_ms']:>8.0f}/{r['session']['p99_ms']:<8.0f}  {r['codes']}",
                flush=True,
            )
        bad = sum(r["errors_other_than_resource_exhausted"] for r in rows)
        out = {
            "what": "N concurrent sessions open -> generate -> close against corpusd up",
            "command": "python -m tools.bench_load " + " ".join(argv or sys.argv[1:]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
            "setup": {
                "holders": a.holders,
                "agent_workers": 1,
                "tls_and_tokens": not a.insecure and not a.coordinator,
                "tokens_per_session": a.tokens,
                "model": "tiny (corpusd model init)",
            },
            "levels": rows,
            "errors_other_than_resource_exhausted": bad,
        }
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
            print(f"wrote {a.out}")
        return 1 if bad else 0
    finally:
        if env is not None:
            subprocess.run([sys.executable, "-m", "corpusd", "down"], env=env, timeout=120)
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
