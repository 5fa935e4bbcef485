"""A real SGLang server with corpusd: stock vs route vs fetch on one GPU (issue 7).

One pinned corpus (longer than the indexer's top-k) and 8 requests of corpus + a different
question each, served three ways by ``python -m sglang.launch_server`` (sglang 0.5.10.post1):

- ``stock``: plain SGLang given the full prompts (the corpus prefilled into its KV pool);
- ``route``: SGLang with the corpusd plugin (``SGLANG_EXTERNAL_MODEL_PACKAGE=requester.sglang``)
  given only the questions; attention over the corpus goes to corpusd's holders;
- ``fetch``: plain SGLang given the full prompts, with corpusd's HiCache storage backend serving
  the corpus's pages (no corpus prefill, the pages move into SGLang's pool).

Correctness: greedy tokens of route and fetch against stock, position by position, and the
first step's full log-softmax over the vocabulary (SGLang's ``token_ids_logprob``). Speed and
memory: 8 concurrent streams, time to first token and inter-token time (client-side), and the
peak of SGLang's ``sglang:num_used_tokens`` (tokens held in its KV pool) while they run.

Run on a GPU machine with sglang installed (the device recipe is in docs/sglang.md)::

    python -m tools.bench_sglang --out bench/results/sglang-h200.json

It starts its own corpusd (coordinator, holders, one agent) and tiny model under ``--work``.

``--primitive route,fetch,auto`` (issue 17, item 3) runs the route mode once per plugin primitive,
forced by ``CORPUSD_SGLANG_PRIMITIVE`` on the host path (modes ``route@route``, ``route@fetch``,
``route@auto``), each writing its decisions to ``trace-<p>.jsonl`` under ``--work``: every auto
decision is checked against the faster forced run of the same group, auto's total against the
better forced total (within 10 %), and route vs fetch teacher-forced agreement and mean |Δ
log-prob| (``tools/sglang_compare.py``). Without the flag the run is as before.

``--kv-cache-dtype fp8_e4m3`` (issue 18, item 3) starts every server, stock and route, with
SGLang's fp8 KV cache and ``flashmla_kv`` prefill and decode (``tools/sglang_server.py:
sglang_flags`` says why), and pins with ``--kv-format fp8_e4m3``, so the holders hold FlashMLA's
fp8 rows; the JSON records both. Use a fresh ``--work``: its pins keep the format they were made in.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from corpusd.testing import span_qa
from corpusd.testing.span_qa import stdlib_corpus
from corpusd.tokenizer import ByteTokenizer
from indexer import ARITHS
from requester.sglang import dump
from tools.layer_compare import selection_bar, selection_vs_stock, tag
from tools.sglang_compare import PRIMITIVES as PRIMS
from tools.sglang_compare import (
    against_floor,
    check_modes,
    compare,
    corpus_kl,
    exactness,
    forced_primitive,
    free_running,
    is_route,
    load_trace,
    mode_tag,
    noise_floor,
    over_trials,
    predicate_score,
    primitive_modes,
    report,
    vectors,
    where_corpus_matters,
)
from tools.sglang_oracle import oracle_forced, vs_oracle
from tools.sglang_probe import (
    binding_probe,
    concurrent,
    concurrent_probe,
    first_token,
    first_token_score,
)
from tools.sglang_server import (
    SGLANG_ENV,
    Corpusd,
    Server,
    formats,
    pin_format,
    request,
    sglang_flags,
    start_corpusd,
    start_pinned,
)

QUESTIONS = [
    "What does the coordinator store, and where?",
    "How are two partial attentions merged exactly?",
    "Which process holds the pinned pages?",
    "What happens when a holder dies mid-answer?",
    "How does a sub-agent name its corpus?",
    "Where does the indexer's top-k come from?",
    "What is sent to a holder at each decode step?",
    "How is the README's first command run?",
]


#: what fit_tiny's span task needs beyond --steps: sequences long enough for three questions
FIT_TASK_FLAGS = {"lm": [], "span": ["--seq-len", "2048", "--batch", "2"]}


def question_suffixes(kind: str, corpus_tokens: list[int], n: int) -> list[list[int]]:
    """The ``n`` questions asked after a corpus, as byte tokens: ``fixed`` (:data:`QUESTIONS`) or
    ``span`` (quotes of the corpus itself, :func:`corpusd.testing.span_qa.questions`; the
    corpus's tokens are bytes, BOS first)."""
    if kind == "fixed":
        return [ByteTokenizer().encode(f"\n\nQ: {q}\nA:") for q in QUESTIONS[:n]]
    text = ByteTokenizer().decode(corpus_tokens)
    return [ByteTokenizer().encode(q.prompt) for q in span_qa.questions(text, n, seed=SPAN_SEED)]


SPAN_SEED = 20261128

#: the pseudo-mode that starts a second stock server for the two-servers floor
FLOOR_RESTART = "stock#2"


#: The group suffix of stock's one-request-at-a-time teacher-forced pass (``--dump``): its rows
#: pair with stock's batched pass for the selection's own floor.
SEQUENTIAL = "seq"


def greedy_tag(corpus: str) -> str:
    """How the sequential greedy requests are named: the trace keys one run's groups by it."""
    return f"greedy-{corpus}-"


def plugin_metrics(server: Server) -> list[str]:
    """The plugin's decision and cost-ratio series as its metrics server shows them."""
    try:
        with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
            text = r.read().decode()
    except OSError as e:  # the run's numbers stand without them
        return [f"unavailable: {e}"]
    want = ("decisions_total", "measured_over_predicted", "page_cache", "fallbacks_total")
    return [ln for ln in text.splitlines() if not ln.startswith("#") and any(w in ln for w in want)]


def mode_prompts(mode: str, corpus_tokens: list[int], suffixes: list[list[int]]) -> list[list[int]]:
    """What ``mode``'s server is sent: route gets the questions alone (the plugin attends the
    pinned corpus); stock and fetch get the corpus and the question. A route prompt that carried
    the corpus too would attend it twice, once from the holders and once as its own tokens."""
    return [list(s) if is_route(mode) else corpus_tokens + s for s in suffixes]


def measure(
    server: Server, mode: str, corpus: str, corpus_tokens: list[int], suffixes: list[list[int]],
    n_tokens: int, vocab: int, teacher: list[list[int]] | None, forced_steps: int,
    streams: tuple[int, ...] = (8,), bursts: int = 1, first_token_reps: int = 4,
    sequential_floor: bool = False, tagged: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """(1) Free-running greedy answers, one request at a time; (2) teacher-forced steps: for
    every position of the reference answers (``teacher``, stock's; this mode's own when None),
    the log-softmax of the next token given the same context, so noise at one step does not
    change the context of the next (:func:`teacher_forced`, the requests concurrent; with
    ``sequential_floor`` again one at a time, ``forced_sequential``); (3) the same requests as 8
    concurrent streams, timed, with SGLang's KV-pool use sampled; their tokens are (1)'s computed
    in one batch. With ``bursts`` > 1 each stream count is sent that many times in a row: the
    first burst is the server's first batch of that size (its kernels' first launches at those
    shapes), the repeats are warm."""
    prompts = mode_prompts(mode, corpus_tokens, suffixes)
    greedy = []
    for i, p in enumerate(prompts):
        r = server.post(request(p, n_tokens, mode, corpus, i, vocab, False, greedy_tag(corpus)))
        greedy.append(
            {"tokens": r["output_ids"], "cached_tokens": r["meta_info"].get("cached_tokens")}
        )
    ref = teacher or [g["tokens"] for g in greedy]
    result: dict[str, Any] = {"greedy": greedy}
    if mode == "stock":  # BOS + question alone: do the answers depend on the corpus at all?
        result["bare"] = [
            server.post(request(corpus_tokens[:1] + s, n_tokens, mode, corpus, i, vocab, False))[
                "output_ids"
            ]
            for i, s in enumerate(suffixes)
        ]

    steps = min(n_tokens, forced_steps)
    result["forced"] = teacher_forced(
        server, mode, corpus, prompts, ref, vocab, steps, tagged=tagged
    )
    if mode == "stock":  # the same answers without the corpus: where does the corpus matter?
        bare = [corpus_tokens[:1] + s for s in suffixes]
        result["forced_bare"] = teacher_forced(server, mode, corpus, bare, ref, vocab, steps)
    if sequential_floor:  # the same contexts one request at a time: the batching floor
        result["forced_sequential"] = teacher_forced(
            server, mode, corpus, prompts, ref, vocab, steps, concurrent=False, tagged=tagged,
            group=corpus + SEQUENTIAL,
        )  # fmt: skip
    try:  # a refused flush or a failed request costs this probe, not the mode's other numbers
        result["first_token"] = first_token(server, mode, corpus, prompts, vocab, first_token_reps)
    except (RuntimeError, OSError) as e:
        result["first_token"] = {"error": f"{type(e).__name__}: {e}"}
    by_streams = {}
    for s in streams:
        first, *again = [
            concurrent(server, mode, corpus, prompts, s, n_tokens, vocab) for _ in range(bursts)
        ]
        if again:
            first["repeats"] = [{k: v for k, v in r.items() if k != "tokens"} for r in again]
        by_streams[s] = first
    result["concurrent"] = by_streams[streams[0]]
    result["concurrent_by_streams"] = {str(s): c for s, c in by_streams.items()}
    return result


def teacher_forced(
    server: Server, mode: str, corpus: str, prompts: list[list[int]], ref: list[list[int]],
    vocab: int, steps: int, concurrent: bool = True, tagged: bool = False, group: str = "",
) -> list[list[list[float]]]:  # fmt: skip
    """``[request][step][vocab]``: the log-softmax of the next token after ``prompts[i] +
    ref[i][:j]`` for ``j < steps``; each request's steps in order, the requests in one thread each
    (``concurrent``: SGLang batches them) or one after another (one request in flight).
    ``tagged``: each request's rid carries ``layer_compare.tag(j, i, group or corpus)``, by
    which the servers' per-layer dumps (``--dump``) pair stock's rows with route's (``group``:
    another pass of the same rows, e.g. :data:`SEQUENTIAL`)."""

    def forced(i: int) -> list[list[float]]:
        out = []
        for j in range(steps):
            phase = tag(j, i, group or corpus) if tagged else ""
            body = request(prompts[i] + ref[i][:j], 1, mode, corpus, i, vocab, True, phase)
            if tagged and not is_route(mode):  # route's rid carries the phase already
                body["rid"] = f"{phase}{time.monotonic_ns()}"
            out.append(vectors(server.post(body)["meta_info"], vocab)[0])
        return out

    if not concurrent:
        return [forced(i) for i in range(len(prompts))]
    with ThreadPoolExecutor(len(prompts)) as pool:  # one thread per prompt
        return list(pool.map(forced, range(len(prompts))))


def restart_floor(
    a: argparse.Namespace, model: Path, cd: Corpusd, runs: dict[str, dict[str, Any]],
    suffixes: dict[str, list[list[int]]], vocab: int,
) -> None:  # fmt: skip
    """A second, freshly started stock server, teacher-forced on stock's answers as the first
    was: ``runs[r]["stock"]["forced_restart"]`` (the two-servers floor)."""
    graph_bs = () if a.no_cuda_graph else (a.graph_bs or a.streams)
    log = Path(a.work) / "sglang-stock-2.log"
    server = Server("stock", model, a.port, cd, log, graph_bs, a.kv_cache_dtype,
                    flags=server_flags(a))  # fmt: skip
    try:
        server.wait()
        for r, by_mode in runs.items():
            st = by_mode.get("stock")
            if st is None:
                continue
            prompts = mode_prompts("stock", cd.tokens[r], suffixes[r])
            ref = [g["tokens"] for g in st["greedy"]]
            steps = len(st["forced"][0]) if st["forced"] else 0
            st["forced_restart"] = teacher_forced(server, "stock", r, prompts, ref, vocab, steps)
    finally:
        server.stop()


def route_trials(
    a: argparse.Namespace, model: Path, cd: Corpusd, runs: dict[str, dict[str, Any]],
    suffixes: dict[str, list[list[int]]], vocab: int, saved: Callable[[], None] = lambda: None,
) -> None:  # fmt: skip
    """``--route-trials N``: N − 1 more freshly started route servers, each teacher-forced on
    stock's answers as the first route server was; ``runs[r]["route"]["forced_trials"]`` holds
    every trial's log-softmax, the first server's first. ``saved`` is called after each trial
    (the bench saves its JSON there: a run its time limit stops keeps the trials it finished)."""
    graph_bs = () if a.no_cuda_graph else (a.graph_bs or a.streams)
    for t in range(2, a.route_trials + 1):
        print(f"== route, trial {t} of {a.route_trials} (a fresh server)", flush=True)
        log = Path(a.work) / f"sglang-route-{t}.log"
        server = Server("route", model, a.port, cd, log, graph_bs, a.kv_cache_dtype,
                        flags=server_flags(a))  # fmt: skip
        try:
            server.wait()
            for r, by_mode in runs.items():
                st, rt = by_mode.get("stock"), by_mode.get("route")
                if st is None or rt is None or not rt.get("forced"):
                    continue
                prompts = mode_prompts("route", cd.tokens[r], suffixes[r])
                ref = [g["tokens"] for g in st["greedy"]]
                steps = len(rt["forced"][0])
                trial = teacher_forced(server, "route", r, prompts, ref, vocab, steps)
                rt.setdefault("forced_trials", [rt["forced"]]).append(trial)
        finally:
            server.stop()
        saved()


def dump_dir(a: argparse.Namespace, mode: str) -> Path:
    return Path(a.work) / f"dump-{mode_tag(mode)}"


def dump_env(a: argparse.Namespace, mode: str) -> dict[str, str]:
    """``--dump``: every server records its forwards' last rows per layer (stock through the
    hooked stock class, ``requester.sglang.stockdump``); nothing otherwise."""
    if not a.dump or mode == "fetch":
        return {}
    d = dump_dir(a, mode)
    shutil.rmtree(d, ignore_errors=True)
    env = {dump.ENV_DUMP: str(d)}
    if mode == "stock":
        env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "requester.sglang.stockdump"
    return env


def selection(a: argparse.Namespace, modes: list[str], regime: str, k: int) -> dict[str, Any]:
    """``--dump``: each route mode's top-k against stock's per layer and step on the
    teacher-forced rows of ``regime`` (``tools/layer_compare.py: selection_vs_stock``), with
    stock's exact ties at the cut per layer and route's set at them; and, as its floor, stock's
    batched pass against its own one-at-a-time pass of the same rows (``stock_sequential``:
    batch composition alone moves a GEMM's rounding, so the sets may differ at layer 0 too)."""
    stock = dump.load(dump_dir(a, "stock")) if dump_dir(a, "stock").exists() else []
    out = {}
    for m in modes:
        if is_route(m) and dump_dir(a, m).exists():
            out[m] = selection_vs_stock(stock, dump.load(dump_dir(a, m)), k, regime)
    floor = selection_vs_stock(stock, stock, k, regime, regime + SEQUENTIAL)
    for m in list(out):  # issue 36's bar, per layer: ≥ 0.99, or no lower than stock's own
        out[m]["bar"] = selection_bar(out[m], floor if floor["rows"] else None)
    if floor["rows"]:
        out["stock_sequential"] = floor
    return out


REGIMES = {
    # corpus + question + answer < index_topk: every key attended, no top-k selection anywhere
    "dense": (1900, "layers.py"),
    # corpus > index_topk: the indexer's top-k selects 2048 keys of the corpus and the request
    "sparse": (3600, "README.md"),
}


def server_flags(a: argparse.Namespace) -> list[str]:
    """Every server's SGLang flags: :func:`sglang_flags` for the KV cache dtype, then
    ``--sglang-extra`` (the same on every side, e.g. data-parallel attention)."""
    return [*sglang_flags(a.kv_cache_dtype), *shlex.split(a.sglang_extra)]


def mapped_line(log: Path) -> str | None:
    """The route server's log line naming the holder pools its device path mapped and over
    which transport (``cuda_ipc`` on its GPU, ``cuda_p2p`` across the link), or None."""
    if not log.exists():
        return None
    found = re.findall(r"corpusd plugin: \d+ holder pools mapped onto .*", log.read_text())
    return found[-1].strip() if found else None


def run(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if a.src_model and not a.fit_steps:
        model = Path(a.src_model)
    if not (model / "config.json").exists():
        init = Path(a.src_model) if a.src_model else work / "model-init" if a.fit_steps else model
        if not a.src_model:
            cmd = [sys.executable, "-m", "corpusd", "model", "init", str(init)]
            cmd += ["--preset", "sglang", "--index-topk", "2048"]
            # fp8: the pin prefill selects with SGLang's indexer arithmetic (indexer/fp8.py)
            subprocess.run([*cmd, "--index-arith", a.index_arith], check=True)
        if a.fit_steps:  # decisive logits: near-ties no longer flip free-running greedy tokens
            fit = [sys.executable, "-m", "tools.fit_tiny", "--src", str(init), "--out", str(model)]
            fit_on = a.fit_device or a.holder_device.split(",")[0]
            fit += ["--steps", str(a.fit_steps), "--device", fit_on]
            fit += ["--task", a.fit_task, *FIT_TASK_FLAGS[a.fit_task]]
            subprocess.run([*fit, "--log-every", "50"], check=True)
    cfg = json.loads((model / "config.json").read_text())
    got = cfg.get("index_arith", "exact")
    assert got == a.index_arith, f"{model} has index_arith {got}; use another --work"
    vocab, topk = int(cfg["vocab_size"]), int(cfg["index_topk"])
    modes = modes_of(a)
    regimes = {r: REGIMES[r] for r in a.regimes.split(",")}
    if a.probe_only:  # a route server and its binding probe only (no stock, no timing)
        return probe_only(a, work, model, regimes, vocab)
    assert modes[0] == "stock", "stock runs first: it is the reference"
    sources = None
    if a.corpus == "stdlib":
        sources = {r: stdlib_corpus(work / "stdlib" / r, n) for r, (n, _) in regimes.items()}
    cd = start_pinned(work, model, regimes, a.holders, a.holder_device, a.kv_cache_dtype,
                      a.port + 7 if a.pin_engine else 0, sources, a.holder_capacity)  # fmt: skip
    cd.held = cd.residency(model, pin_format(a.kv_cache_dtype), a.holder_device)  # before serving
    print(f"holders: {json.dumps(cd.held)}", flush=True)
    suffixes = {r: question_suffixes(a.questions, cd.tokens[r], a.requests) for r in regimes}
    runs: dict[str, dict[str, Any]] = {r: {} for r in regimes}
    failed: dict[str, str] = {}
    floors = [f for f in a.floor.split(",") if f]
    try:
        if "restart" in floors:
            modes = [*modes[:1], FLOOR_RESTART, *modes[1:]]
        for mode in modes:
            if mode == FLOOR_RESTART:  # right after stock: its teacher-forced contexts
                print("== stock, a second server (noise floor)", flush=True)
                try:
                    restart_floor(a, model, cd, runs, suffixes, vocab)
                except Exception as e:  # the floor is missing from the result, the run goes on
                    failed[FLOOR_RESTART] = f"{type(e).__name__}: {e}"[:2000]
                save(a.out, summarize(a, cd, runs, failed, topk, suffixes))
                continue
            print(f"== {mode}", flush=True)
            log = work / f"sglang-{mode}.log"
            graph_bs = () if a.no_cuda_graph else (a.graph_bs or a.streams)
            server = Server(mode, model, a.port, cd, log, graph_bs, a.kv_cache_dtype,
                            flags=server_flags(a), extra_env=dump_env(a, mode))  # fmt: skip
            try:
                start_s = server.wait()
                for r in regimes:
                    teacher = None
                    if mode != "stock":
                        teacher = [g["tokens"] for g in runs[r]["stock"]["greedy"]]
                    m = measure(
                        server, mode, r, cd.tokens[r], suffixes[r], a.tokens, vocab, teacher,
                        forced_steps=a.forced_steps, streams=a.streams, bursts=a.bursts,
                        first_token_reps=a.first_token_reps,
                        sequential_floor=mode == "stock" and "sequential" in floors,
                        tagged=a.dump,
                    )  # fmt: skip
                    runs[r][mode] = {"server_start_s": start_s, **m}
                    if forced_primitive(mode):
                        runs[r][mode]["plugin_metrics"] = plugin_metrics(server)
                    if is_route(mode):  # last: a probe that kills the server loses no timing
                        save(a.out, summarize(a, cd, runs, failed, topk, suffixes))
                        probe = binding_probe(server, r, suffixes[r][0], vocab, cd.tokens[r])
                        runs[r][mode]["binding_probe"] = probe
                        print(f"binding probe: {probe}", flush=True)
                    # after every step, so a run cut short by a time limit keeps what it measured
                    save(a.out, summarize(a, cd, runs, failed, topk, suffixes))
                if mode == "route" and a.route_trials > 1:
                    server.stop()
                    route_trials(a, model, cd, runs, suffixes, vocab, lambda: save(
                        a.out, summarize(a, cd, runs, failed, topk, suffixes)))  # fmt: skip
            except Exception as e:  # the other modes still run; the result says what failed
                failed[mode] = f"{type(e).__name__}: {e}"[:2000]
                save(a.out, summarize(a, cd, runs, failed, topk, suffixes))
                print(
                    f"{mode} failed: {failed[mode]}\n{server.tail()}", file=sys.stderr, flush=True
                )
                if mode == "stock":
                    raise
            finally:
                server.stop()
    finally:
        cd.stop()
    oracles = oracle_runs(a, model, cd, runs, failed, suffixes) if a.oracle else {}
    return summarize(a, cd, runs, failed, topk, suffixes, oracles)


def oracle_runs(
    a: argparse.Namespace, model: Path, cd: Corpusd, runs: dict[str, dict[str, Any]],
    failed: dict[str, str], suffixes: dict[str, list[list[int]]],
) -> dict[str, list[list[list[float]]]]:  # fmt: skip
    """``--oracle``: per regime, corpusd's model in float64 teacher-forced on stock's answers
    (:func:`tools.sglang_oracle.oracle_forced`), after the servers are gone; a failure is
    recorded, not raised (the servers' figures stand without it)."""
    out = {}
    for r, by_mode in runs.items():
        st = by_mode.get("stock")
        if not st or not st.get("forced"):
            continue
        try:
            answers = [g["tokens"] for g in st["greedy"]]
            out[r] = oracle_forced(model, cd.tokens[r], suffixes[r], answers, len(st["forced"][0]))
        except Exception as e:  # the reference is missing from the result, the run stands
            failed[f"oracle {r}"] = f"{type(e).__name__}: {e}"[:2000]
    return out


def probe_only(
    a: argparse.Namespace, work: Path, model: Path, regimes: dict[str, tuple[int, str]], vocab: int
) -> dict[str, Any]:
    """``--probe-only``: a route server over each regime's pinned corpus, and requests it cannot
    bind (:func:`binding_probe`), which must fail alone while the server serves on."""
    cd = start_corpusd(
        work, model, regimes, a.holders, a.holder_device, pin_format(a.kv_cache_dtype)
    )
    out: dict[str, Any] = {"holder_device": a.holder_device, **formats(a.kv_cache_dtype)}
    try:
        graph_bs = () if a.no_cuda_graph else (a.graph_bs or a.streams)
        log = work / "sglang-route.log"
        server = Server("route", model, a.port, cd, log, graph_bs, a.kv_cache_dtype,
                        flags=server_flags(a))  # fmt: skip
        try:
            out["server_start_s"] = server.wait()
            suffix = ByteTokenizer().encode(f"\n\nQ: {QUESTIONS[0]}\nA:")
            out["binding_probe"] = {
                r: binding_probe(server, r, suffix, vocab, cd.tokens[r]) for r in regimes
            }
            prompts = [ByteTokenizer().encode(f"\n\nQ: {q}\nA:") for q in QUESTIONS]
            out["concurrent_probe"] = {
                r: concurrent_probe(server, r, prompts, vocab) for r in regimes
            }
        finally:
            server.stop()
    finally:
        cd.stop()
    save(a.out, out)
    print(json.dumps({k: out[k] for k in ("binding_probe", "concurrent_probe")}, indent=1))
    return out


def gpu_name() -> str:
    """The first GPU's name as nvidia-smi gives it (this process does not load torch)."""
    try:
        q = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        return subprocess.run(q, capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def save(path: str, out: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)


def summarize(
    a: argparse.Namespace, cd: Corpusd, runs: dict[str, dict[str, Any]], failed: dict[str, str],
    topk: int, suffixes: dict[str, list[list[int]]],
    oracles: dict[str, list[list[list[float]]]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {
        "command": "python -m tools.bench_sglang " + " ".join(sys.argv[1:]),
        "gpu": gpu_name(),
        "index_topk": topk,
        "index_arith": a.index_arith,
        "fit_steps": a.fit_steps,
        "pinned_by": "sglang (capture backend)" if a.pin_engine else "corpusd",
        "requests": a.requests,
        "corpus": a.corpus,
        "questions": a.questions,
        "fit_task": a.fit_task if a.fit_steps else None,
        "src_model": a.src_model or None,
        "tokens_each": a.tokens,
        "holders": a.holders,
        "holder_device": a.holder_device,
        "holder_capacity_tokens": a.holder_capacity,
        "route_holders_mapped": mapped_line(Path(a.work) / "sglang-route.log"),
        "cuda_graph_bs": [] if a.no_cuda_graph else list(a.graph_bs or a.streams),
        "streams": list(a.streams),
        **formats(a.kv_cache_dtype),
        "sglang_flags": server_flags(a),  # every side's, --sglang-extra included
        "holder_residency": cd.held,
        "sglang_env": SGLANG_ENV,
        "failed": failed,
        "regimes": {},
    }
    for r, by_mode in runs.items():
        if "stock" not in by_mode:
            continue
        out["regimes"][r] = {
            "corpus_tokens": len(cd.tokens[r]),
            "prompt_tokens_max": len(cd.tokens[r]) + max(map(len, suffixes[r])) + a.tokens,
            "question_text": [ByteTokenizer().decode(s) for s in suffixes[r]],
            "tokens": {m: [g["tokens"] for g in v["greedy"]] for m, v in by_mode.items()},
            "cached_tokens": {
                m: [g["cached_tokens"] for g in v["greedy"]] for m, v in by_mode.items()
            },
            "concurrent": {m: v["concurrent"] for m, v in by_mode.items() if "concurrent" in v},
            "concurrent_by_streams": {
                m: v["concurrent_by_streams"] for m, v in by_mode.items() if "concurrent" in v
            },
            "first_token": {m: v["first_token"] for m, v in by_mode.items() if "first_token" in v},
            "binding_probe": {
                m: v["binding_probe"] for m, v in by_mode.items() if "binding_probe" in v
            },
            "vs_stock": {
                m: compare(by_mode["stock"], v) for m, v in by_mode.items() if m != "stock"
            },
            # Each mode against itself: the same requests one at a time and as one batch of 8.
            # Stock's is SGLang's own noise floor for free-running greedy agreement.
            "batched_vs_sequential": {
                m: free_running([g["tokens"] for g in v["greedy"]], v["concurrent"]["tokens"])
                for m, v in by_mode.items()
                if "concurrent" in v
            },
        }
        if getattr(a, "dump", False):
            out["regimes"][r]["selection_vs_stock"] = selection(a, list(by_mode), r, topk)
        floors = noise_floor(by_mode["stock"])
        out["regimes"][r]["noise_floor"] = floors
        out["regimes"][r]["vs_floor"] = {
            m: against_floor(c, floors) for m, c in out["regimes"][r]["vs_stock"].items()
        }
        if by_mode.get("route", {}).get("forced_trials"):  # --route-trials: median and spread
            out["regimes"][r]["route_trials"] = over_trials(
                by_mode["stock"]["forced"], by_mode["route"]["forced_trials"], floors
            )
        if oracles and oracles.get(r):  # --oracle: every run against float64, not each other
            st = by_mode["stock"]
            named = {
                "stock": st["forced"],
                "stock_sequential": st.get("forced_sequential"),
                "stock_restart": st.get("forced_restart"),
                **{m: v.get("forced") for m, v in by_mode.items() if m != "stock"},
            }
            for i, t in enumerate(by_mode.get("route", {}).get("forced_trials", [])[1:], 2):
                named[f"route_trial_{i}"] = t
            out["regimes"][r]["vs_oracle"] = vs_oracle(oracles[r], named)
        stock = [g["tokens"] for g in by_mode["stock"]["greedy"]]
        out["regimes"][r]["stock_answers"] = {
            # free-running agreement tests the corpus attention only if the answers differ per
            # question and change when the corpus is dropped
            "distinct": len({tuple(t) for t in stock}),
            "corpus_dependent": sum(
                b != t for b, t in zip(by_mode["stock"]["bare"], stock, strict=True)
            ),
            "text": [ByteTokenizer().decode(t) for t in stock],
        }
        dep = out["regimes"][r]["stock_answers"]["corpus_dependent"]
        # issue 36: an agreement figure counts only where most answers depend on the corpus
        out["regimes"][r]["stock_answers"]["agreement_counts"] = 4 * dep >= 3 * len(stock)
        st = by_mode["stock"]
        if st.get("forced_bare"):
            kls = corpus_kl(st["forced"], st["forced_bare"])
            matters = {
                m: where_corpus_matters(st["forced"], v["forced"], kls)
                for m, v in by_mode.items()
                if m != "stock" and v.get("forced")
            }
            for name, key in (("batched_vs_sequential", "forced_sequential"),
                              ("two_servers", "forced_restart")):  # fmt: skip
                if st.get(key):
                    matters[f"floor:{name}"] = where_corpus_matters(st["forced"], st[key], kls)
            out["regimes"][r]["where_corpus_matters"] = matters
            out["regimes"][r]["corpus_kl_nats"] = kls
        ft = {m: v.get("first_token", {}) for m, v in by_mode.items()}
        if "cold_p50_ms" in ft["stock"] and "cold_p50_ms" in ft.get("route", {}):
            out["regimes"][r]["first_token_score"] = first_token_score(
                by_mode["stock"]["first_token"], by_mode["route"]["first_token"]
            )
        if "route" in by_mode and "fetch" in by_mode:
            out["regimes"][r]["route_vs_fetch"] = compare(by_mode["fetch"], by_mode["route"])
        if "route@route" in by_mode and "route@fetch" in by_mode:  # the plugin's primitives
            out["regimes"][r]["primitive_exactness"] = exactness(
                by_mode["route@route"], by_mode["route@fetch"]
            )
        if all(f"route@{p}" in by_mode for p in ("route", "fetch", "auto")):
            traces = {p: load_trace(Path(a.work) / f"trace-{p}.jsonl") for p in PRIMS}
            score = predicate_score(traces, greedy_tag(r))
            # end to end too: the concurrent streams' inter-token time under each primitive
            itl = {p: by_mode[f"route@{p}"]["concurrent"]["inter_token_p50_ms"] for p in PRIMS}
            score["inter_token_p50_ms"] = itl
            score["auto_itl_over_better_forced"] = itl["auto"] / min(itl["route"], itl["fetch"])
            out["regimes"][r]["predicate"] = score
    return out


def modes_of(a: argparse.Namespace) -> list[str]:
    """The servers ``--modes`` and ``--primitive`` ask for, in order (``primitive_modes``)."""
    return primitive_modes(a.modes.split(","), [p for p in a.primitive.split(",") if p])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results/sglang-h200.json")
    ap.add_argument("--work", default="/tmp/corpusd-bench-sglang")
    ap.add_argument(
        "--modes", default="stock,route,fetch",
        help="stock first, then any of route, fetch, route+one (route with the own tokens and "
        "the corpus rows in one FlashMLA call, CORPUSD_SGLANG_ONE_CALL=1)",
    )  # fmt: skip
    ap.add_argument(
        "--primitive", default="",
        help="run the route mode once per plugin primitive, forced (route,fetch,auto: the "
        "predicate checked against both forced runs; host path, no CUDA graphs)",
    )  # fmt: skip
    ap.add_argument(
        "--probe-only", action="store_true",
        help="start only a route server and send it requests it cannot bind (issue 17, item 4)",
    )  # fmt: skip
    ap.add_argument("--regimes", default="dense,sparse")
    ap.add_argument(
        "--dump", action="store_true",
        help="record the teacher-forced rows per layer in stock and route (CORPUSD_SGLANG_DUMP) "
        "and report route's top-k against stock's per layer and step, with the ties at the cut",
    )  # fmt: skip
    ap.add_argument(
        "--floor", default="sequential,restart",
        help="stock-against-stock noise floors to measure (issue 36): sequential (the same "
        "server's teacher-forced requests one at a time against batched), restart (a second, "
        "freshly started stock server); '' for none",
    )  # fmt: skip
    ap.add_argument("--tokens", type=int, default=32, help="generated per request")
    ap.add_argument("--forced-steps", type=int, default=16, help="teacher-forced per request")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--holders", type=int, default=2)
    ap.add_argument(
        "--holder-device", default="cpu",
        help="the holders' device, or a comma-separated list dealt to them in turn (cuda:1: "
        "every holder on the second GPU, read from the server's over peer access; cuda:0,cuda:1: "
        "one on each)",
    )  # fmt: skip
    ap.add_argument(
        "--oracle", action=argparse.BooleanOptionalAction, default=True,
        help="after the servers, corpusd's model in float64 teacher-forced on the same contexts "
        "(tools/sglang_oracle.py): every run's figures against it in the JSON's vs_oracle",
    )  # fmt: skip
    ap.add_argument(
        "--route-trials", type=int, default=1,
        help="teacher-force route on this many freshly started route servers (the first is the "
        "timed one); the JSON's route_trials gives each figure's median and spread, and the "
        "floor bars read on the medians",
    )  # fmt: skip
    ap.add_argument(
        "--sglang-extra", default="",
        help="more SGLang flags for every server, stock and route alike, e.g. '--tp 2 --dp 2 "
        "--enable-dp-attention' (each DP rank maps the holders its GPU reaches)",
    )  # fmt: skip
    ap.add_argument(
        "--holder-capacity", type=int, default=16384,
        help="each holder's capacity in tokens; below a corpus's length its pin is spread "
        "over holders (the LSE merge of their partials runs inside the server's graphs)",
    )  # fmt: skip
    ap.add_argument(
        "--streams",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=(8,),
        help="concurrent stream counts to time, comma-separated (the first is 'concurrent')",
    )
    ap.add_argument(
        "--bursts", type=int, default=2,
        help="send each stream count this many times in a row (the first burst is the server's "
        "first batch of that size; the repeats are warm)",
    )  # fmt: skip
    ap.add_argument(
        "--first-token-reps", type=int, default=8,
        help="idle-server first-token requests, each cold (after /flush_cache) and warm",
    )  # fmt: skip
    ap.add_argument(
        "--graph-bs",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=(),
        help="batch sizes SGLang captures CUDA graphs for (default: --streams); larger run eager",
    )
    ap.add_argument(
        "--no-cuda-graph",
        action="store_true",
        help="run every server with --disable-cuda-graph (the plugin's host path needs it)",
    )
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument(
        "--pin-engine", action="store_true",
        help="pin the corpora through a stock SGLang server in capture mode (corpusd pin "
        "--engine): route then attends the engine's own pages (issue 18)",
    )  # fmt: skip
    ap.add_argument(
        "--fit-steps",
        type=int,
        default=0,
        help="fit the tiny model to this repo's text first (tools/fit_tiny.py); 0: random weights",
    )
    ap.add_argument("--fit-device", default="", help="where to fit (default: --holder-device)")
    ap.add_argument(
        "--fit-task", choices=("lm", "span"), default="lm",
        help="what --fit-steps trains: lm (next token on this repo's text) or span (answer "
        "questions quoting the standard library with what follows the quote: answers that "
        "depend on the corpus; corpusd/testing/span_qa.py)",
    )  # fmt: skip
    ap.add_argument(
        "--src-model", default="",
        help="a checkpoint to serve, or to fit from with --fit-steps (default: `corpusd model "
        "init --preset sglang`), e.g. another geometry",
    )  # fmt: skip
    ap.add_argument(
        "--corpus", choices=("repo", "stdlib"), default="repo",
        help="what each regime pins: this repo's text, or the standard library's top-level "
        "modules (not this repo's text; what --fit-task span never trained on)",
    )  # fmt: skip
    ap.add_argument(
        "--questions", choices=("fixed", "span"), default="fixed",
        help="fixed: the eight questions about corpusd; span: questions quoting each pinned "
        "corpus, answered by what follows the quote (with --fit-task span)",
    )  # fmt: skip
    ap.add_argument(
        "--index-arith",
        choices=ARITHS,
        default="fp8",
        help="the pinned model's indexer arithmetic (fp8: as SGLang computes it)",
    )
    ap.add_argument(
        "--kv-cache-dtype", choices=("auto", "bfloat16", "fp8_e4m3"), default="auto",
        help="SGLang's KV cache in every server; fp8_e4m3 also pins with --kv-format fp8_e4m3 "
        "(holders hold FlashMLA's fp8 rows) and runs flashmla_kv prefill and decode",
    )  # fmt: skip
    a = ap.parse_args(argv)
    try:  # before anything starts
        check_modes(modes_of(a))
    except ValueError as e:
        ap.error(str(e))
    out = run(a)
    if a.probe_only:
        return 0
    save(a.out, out)
    report(out)
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
