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
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corpusd.coordinator.launch import start_coordinator
from corpusd.corpus.store import PageStore
from corpusd.daemon import Daemon
from corpusd.tokenizer import ByteTokenizer
from holder.launch import start_holder
from indexer import ARITHS
from requester.launch import start_agent
from requester.sglang.binding import request_fields

ROOT = Path(__file__).resolve().parent.parent
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
SGLANG_ENV = {
    # No 10-minute DeepGEMM JIT warm-up; prefill stays off the FA3 path the deps omit; one top-k
    # code path (unfused) in every mode, which the plugin needs.
    "SGLANG_ENABLE_JIT_DEEPGEMM": "0",
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "0",
    "SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0",
    "SGLANG_NSA_FUSE_TOPK": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}
SGLANG_FLAGS = [
    "--attention-backend", "nsa", "--page-size", "64",
    "--nsa-prefill-backend", "flashmla_sparse", "--nsa-decode-backend", "flashmla_sparse",
    "--kv-cache-dtype", "auto", "--skip-tokenizer-init",
    "--grammar-backend", "none", "--enable-metrics", "--context-length", "16384",
    "--enable-fp32-lm-head",
    "--mem-fraction-static", "0.3", "--max-total-tokens", "65536", "--log-level", "info",
]  # fmt: skip


@dataclass
class Corpusd:
    daemons: list[Daemon]
    coordinator: str
    store: Path
    tokens: dict[str, list[int]]  # corpus name → its tokens

    def stop(self) -> None:
        for d in reversed(self.daemons):
            try:
                d.stop(timeout=20)
            except subprocess.TimeoutExpired:
                d.kill()


def corpus_source(out: Path, n_bytes: int, first: str) -> Path:
    """A directory with ``n_bytes`` of this repo's text, starting at the file ``first``."""
    files = [ROOT / "README.md", *sorted((ROOT / "corpusd" / "model").glob("*.py"))]
    files = sorted(files, key=lambda p: p.name != first)
    text = "".join(p.read_text() for p in files)[:n_bytes]
    out.mkdir(parents=True, exist_ok=True)
    (out / "notes.md").write_text(text)
    return out


def start_corpusd(work: Path, model: Path, corpora: dict[str, tuple[int, str]], holders: int,
                  device: str) -> Corpusd:  # fmt: skip
    """A coordinator, ``holders`` holders and an agent; each of ``corpora`` (name → bytes, first
    file) pinned through them."""
    store = work / "store"
    daemons: list[Daemon] = []
    try:
        coord = start_coordinator(work / "coordinator", store)
        daemons.append(coord)
        extra = ["--coordinator", coord.address, "--capacity-tokens", "16384", "--device", device]
        if device != "cpu":  # bf16 pages (as SGLang's pool), our Triton sparse-MLA kernel
            extra += ["--dtype", "bfloat16", "--kernel", "triton"]
        for i in range(holders):
            daemons.append(start_holder(store, work / f"holder-{i}", model, *extra))
        daemons.append(start_agent(store, work / "agent", model, "--coordinator", coord.address))
        tokens = {}
        for name, (n_bytes, first) in corpora.items():
            src = corpus_source(work / "src" / name, n_bytes, first)
            pin = [sys.executable, "-m", "corpusd", "pin", "--corpus", str(src), "--name", name]
            pin += ["--model", str(model), "--store", str(store), "--coordinator", coord.address]
            pin += ["--dtype", "float32" if device == "cpu" else "bfloat16"]  # the holders' dtype
            subprocess.run(pin, check=True)
            ps = PageStore(store)
            tokens[name] = ps.read_tokens(ps.resolve(name)).tolist()
        return Corpusd(daemons, coord.address, store, tokens)
    except BaseException:
        for d in reversed(daemons):
            d.kill()
        raise


# -- one SGLang server ---------------------------------------------------------------------------
class Server:
    def __init__(
        self, mode: str, model: Path, port: int, cd: Corpusd, log: Path,
        graph_bs: tuple[int, ...] = (),
    ) -> None:  # fmt: skip
        env = {**os.environ, **SGLANG_ENV}
        flags = ["--model-path", str(model), "--port", str(port), *SGLANG_FLAGS]
        if graph_bs:  # capture only the batch sizes measured (each capture JITs kernels: ~12 s)
            flags += ["--cuda-graph-max-bs", str(max(graph_bs)), "--cuda-graph-bs"]
            flags += [str(b) for b in sorted(graph_bs)]
        else:
            flags.append("--disable-cuda-graph")
        if mode == "route":
            env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "requester.sglang"
            env["CORPUSD_COORDINATOR"] = cd.coordinator
            # the device path's window: the longest corpus, in whole 1,024-token steps
            longest = max(map(len, cd.tokens.values()))
            env.setdefault("CORPUSD_SGLANG_WINDOW", str(-(-longest // 1024) * 1024))
        if mode == "fetch":
            extra = {
                "backend_name": "corpusd",
                "module_path": "requester.sglang.hicache",
                "class_name": "CorpusdHiCacheStorage",
                "interface_v1": 1,
                "corpusd_store": str(cd.store),
                "model_path": str(model),
            }
            flags += [
                "--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic",
                "--hicache-storage-backend-extra-config", json.dumps(extra),
                "--hicache-storage-prefetch-policy", "wait_complete",
                "--hicache-mem-layout", "layer_first", "--hicache-io-backend", "kernel",
                "--hicache-size", "2",
            ]  # fmt: skip
        self.mode, self.url, self.log = mode, f"http://127.0.0.1:{port}", log
        self._log = log.open("w")
        cmd = [sys.executable, "-m", "sglang.launch_server", *flags]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 420) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.mode}: sglang exited ({self.proc.returncode}):\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.mode}: sglang not healthy in {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def post(self, body: dict[str, Any], timeout: float = 600) -> Any:
        req = urllib.request.Request(
            self.url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stream(self, body: dict[str, Any], timeout: float = 600) -> tuple[list[float], list[int]]:
        """Arrival times (monotonic) of each streamed chunk that carries new tokens, and the
        tokens (SGLang's chunks carry every token so far, unless --incremental-streaming-output).
        """
        req = urllib.request.Request(
            self.url + "/generate",
            json.dumps({**body, "stream": True}).encode(),
            {"Content-Type": "application/json"},
        )
        times: list[float] = []
        tokens: list[int] = []
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                    times.append(time.monotonic())
                    tokens = json.loads(line[5:])["output_ids"]
        return times, tokens

    def used_tokens(self) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        vals = [float(m) for m in re.findall(r"^sglang:num_used_tokens\{[^}]*\} (\S+)", text, re.M)]
        return max(vals, default=math.nan)


def request(
    prompt: list[int], n: int, mode: str, corpus: str, i: int, vocab: int, logprobs: bool
) -> dict:
    body: dict[str, Any] = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True},
    }
    if logprobs:
        body.update(
            return_logprob=True,
            logprob_start_len=len(prompt),
            token_ids_logprob=list(range(vocab)),
        )
    if mode == "route":
        body.update(request_fields(corpus, f"{mode}-{i}-{time.monotonic_ns()}"))
    return body


def binding_probe(server: Server, corpus: str, prompt: list[int], vocab: int) -> dict[str, Any]:
    """Requests the plugin cannot bind (an unknown corpus, a malformed id) must each fail alone
    with a clear message, and the server must go on serving (issue 17, item 4)."""
    out: dict[str, Any] = {}
    bad = {
        "unknown corpus": request_fields("no-such-corpus", "probe"),
        "malformed id": {"rid": f"corpusd:{corpus}"},
    }
    for label, fields in bad.items():
        body = {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
            **fields,
        }
        try:
            meta = server.post(body, timeout=120)["meta_info"]
            out[label] = {"http": 200, "finish_reason": meta.get("finish_reason")}
        except urllib.error.HTTPError as e:
            out[label] = {"http": e.code, "body": e.read().decode(errors="replace")[:500]}
    after = server.post(request(prompt, 4, "route", corpus, 10**6, vocab, False), timeout=120)
    out["after"] = {"tokens": len(after["output_ids"]), "server_alive": server.proc.poll() is None}
    return out


def vectors(meta: dict[str, Any], vocab: int) -> list[list[float]]:
    """Per output position, the log-softmax over the whole vocabulary."""
    out = []
    for step in meta["output_token_ids_logprobs"]:
        v = [math.nan] * vocab
        for lp, tok, *_ in step:
            v[int(tok)] = float(lp)
        out.append(v)
    return out


def measure(
    server: Server, mode: str, corpus: str, corpus_tokens: list[int], suffixes: list[list[int]],
    n_tokens: int, vocab: int, teacher: list[list[int]] | None, forced_steps: int,
    streams: tuple[int, ...] = (8,),
) -> dict[str, Any]:  # fmt: skip
    """(1) Free-running greedy answers, one request at a time; (2) teacher-forced steps: for
    every position of the reference answers (``teacher``, stock's; this mode's own when None),
    the log-softmax of the next token given the same context, so noise at one step does not
    change the context of the next; (3) the same requests as 8 concurrent streams, timed, with
    SGLang's KV-pool use sampled; their tokens are (1)'s computed in one batch."""
    prompts = [s if mode == "route" else corpus_tokens + s for s in suffixes]
    greedy = []
    for i, p in enumerate(prompts):
        r = server.post(request(p, n_tokens, mode, corpus, i, vocab, logprobs=False))
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

    def forced(i: int) -> list[list[float]]:
        out = []
        for j in range(min(n_tokens, forced_steps)):
            body = request(prompts[i] + ref[i][:j], 1, mode, corpus, i, vocab, logprobs=True)
            out.append(vectors(server.post(body)["meta_info"], vocab)[0])
        return out

    with ThreadPoolExecutor(len(prompts)) as pool:  # one thread per prompt
        steps = list(pool.map(forced, range(len(prompts))))
    result["forced"] = steps
    by_streams = {s: concurrent(server, mode, corpus, prompts, s, n_tokens, vocab) for s in streams}
    result["concurrent"] = by_streams[streams[0]]
    result["concurrent_by_streams"] = {str(s): c for s, c in by_streams.items()}
    return result


def concurrent(
    server: Server, mode: str, corpus: str, prompts: list[list[int]], streams: int,
    n_tokens: int, vocab: int,
) -> dict[str, Any]:  # fmt: skip
    """``streams`` concurrent streamed requests (the prompts in turn), timed client-side, with
    SGLang's KV-pool use sampled; their tokens are the prompts' greedy answers in one batch."""
    peak = [server.used_tokens()]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.append(server.used_tokens())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    chosen = [prompts[i % len(prompts)] for i in range(streams)]
    with ThreadPoolExecutor(streams) as pool:
        t0 = time.monotonic()
        futs = [
            pool.submit(server.stream, request(p, n_tokens, mode, corpus, 100 + i, vocab, False))
            for i, p in enumerate(chosen)
        ]
        arrivals, batched = zip(*(f.result() for f in futs), strict=True)
    stop.set()
    sampler.join()
    gaps = [b - a for t in arrivals for a, b in itertools.pairwise(t)]
    ttft = [t[0] - t0 for t in arrivals if t]
    return {
        "streams": streams,
        "tokens_each": n_tokens,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "inter_token_p50_ms": 1e3 * statistics.median(gaps),
        "inter_token_p90_ms": 1e3 * statistics.quantiles(gaps, n=10)[-1],
        "kv_pool_peak_tokens": max(v for v in peak if not math.isnan(v)),
        "tokens": list(batched[: len(prompts)]),
    }


def argmax(v: list[float]) -> int:
    return max(range(len(v)), key=v.__getitem__)


def free_running(ref: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """Greedy tokens equal position by position, and each request's first differing step."""
    same = total = 0
    first_div = []
    for ta, tb in zip(ref, got, strict=True):
        same += sum(x == y for x, y in zip(ta, tb, strict=True))
        total += len(ta)
        first_div.append(
            next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        )
    return {"greedy_agree": same / total, "first_divergence": first_div}


def compare(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Free-running greedy agreement position by position; teacher-forced argmax agreement and
    log-softmax differences (entries above −30 in both) at every step and at the first."""
    free = free_running([g["tokens"] for g in ref["greedy"]], [g["tokens"] for g in got["greedy"]])
    agree = steps = 0
    diffs: list[float] = []
    first: list[float] = []
    margins = []
    for ra, rb in zip(ref["forced"], got["forced"], strict=True):
        for j, (va, vb) in enumerate(zip(ra, rb, strict=True)):
            steps += 1
            if argmax(va) == argmax(vb):
                agree += 1
            else:
                top = sorted(va, reverse=True)
                margins.append(top[0] - top[1])
            d = [abs(x - y) for x, y in zip(va, vb, strict=True) if x > -30 and y > -30]
            diffs += d
            if j == 0:
                first += d
    return {
        **free,
        "forced_agree": agree / steps,
        "forced_steps": steps,
        "ref_top2_margin_where_forced_differs": margins,
        "logprob_max_abs_diff": max(diffs),
        "logprob_mean_abs_diff": statistics.fmean(diffs),
        "first_step_logprob_max_abs_diff": max(first),
        "first_step_logprob_mean_abs_diff": statistics.fmean(first),
    }


REGIMES = {
    # corpus + question + answer < index_topk: every key attended, no top-k selection anywhere
    "dense": (1900, "layers.py"),
    # corpus > index_topk: the indexer's top-k selects 2048 keys of the corpus and the request
    "sparse": (3600, "README.md"),
}


def run(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        init = work / "model-init" if a.fit_steps else model
        cmd = [sys.executable, "-m", "corpusd", "model", "init", str(init), "--preset", "sglang"]
        cmd += ["--index-topk", "2048"]
        # fp8: the pin prefill selects with SGLang's indexer arithmetic (indexer/fp8.py)
        subprocess.run([*cmd, "--index-arith", a.index_arith], check=True)
        if a.fit_steps:  # decisive logits: near-ties no longer flip free-running greedy tokens
            fit = [sys.executable, "-m", "tools.fit_tiny", "--src", str(init), "--out", str(model)]
            fit += ["--steps", str(a.fit_steps), "--device", a.fit_device or a.holder_device]
            subprocess.run([*fit, "--log-every", "50"], check=True)
    cfg = json.loads((model / "config.json").read_text())
    got = cfg.get("index_arith", "exact")
    assert got == a.index_arith, f"{model} has index_arith {got}; use another --work"
    vocab, topk = int(cfg["vocab_size"]), int(cfg["index_topk"])
    modes = a.modes.split(",")
    regimes = {r: REGIMES[r] for r in a.regimes.split(",")}
    if a.probe_only:  # a route server and its binding probe only (no stock, no timing)
        return probe_only(a, work, model, regimes, vocab)
    assert modes[0] == "stock", "stock runs first: it is the reference"
    cd = start_corpusd(work, model, regimes, a.holders, a.holder_device)
    tok = ByteTokenizer()
    suffixes = [tok.encode(f"\n\nQ: {q}\nA:") for q in QUESTIONS[: a.requests]]
    runs: dict[str, dict[str, Any]] = {r: {} for r in regimes}
    failed: dict[str, str] = {}
    try:
        for mode in modes:
            print(f"== {mode}", flush=True)
            log = work / f"sglang-{mode}.log"
            graph_bs = () if a.no_cuda_graph else (a.graph_bs or a.streams)
            server = Server(mode, model, a.port, cd, log, graph_bs=graph_bs)
            try:
                start_s = server.wait()
                for r in regimes:
                    teacher = None
                    if mode != "stock":
                        teacher = [g["tokens"] for g in runs[r]["stock"]["greedy"]]
                    m = measure(
                        server, mode, r, cd.tokens[r], suffixes, a.tokens, vocab, teacher,
                        forced_steps=a.forced_steps, streams=a.streams,
                    )  # fmt: skip
                    if mode == "route":
                        m["binding_probe"] = binding_probe(server, r, suffixes[0], vocab)
                        print(f"binding probe: {m['binding_probe']}", flush=True)
                    runs[r][mode] = {"server_start_s": start_s, **m}
                    # after every step, so a run cut short by a time limit keeps what it measured
                    save(a.out, summarize(a, cd, runs, failed, topk, suffixes))
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
    return summarize(a, cd, runs, failed, topk, suffixes)


def probe_only(
    a: argparse.Namespace, work: Path, model: Path, regimes: dict[str, tuple[int, str]], vocab: int
) -> dict[str, Any]:
    """``--probe-only``: a route server over each regime's pinned corpus, and requests it cannot
    bind (:func:`binding_probe`), which must fail alone while the server serves on."""
    cd = start_corpusd(work, model, regimes, a.holders, a.holder_device)
    out: dict[str, Any] = {"holder_device": a.holder_device, "sglang_flags": SGLANG_FLAGS}
    try:
        graph_bs = () if a.no_cuda_graph else (a.graph_bs or a.streams)
        server = Server("route", model, a.port, cd, work / "sglang-route.log", graph_bs=graph_bs)
        try:
            out["server_start_s"] = server.wait()
            suffix = ByteTokenizer().encode(f"\n\nQ: {QUESTIONS[0]}\nA:")
            out["binding_probe"] = {r: binding_probe(server, r, suffix, vocab) for r in regimes}
        finally:
            server.stop()
    finally:
        cd.stop()
    save(a.out, out)
    print(json.dumps(out["binding_probe"], indent=1), flush=True)
    return out


def save(path: str, out: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)


def summarize(
    a: argparse.Namespace, cd: Corpusd, runs: dict[str, dict[str, Any]], failed: dict[str, str],
    topk: int, suffixes: list[list[int]],
) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {
        "index_topk": topk,
        "index_arith": a.index_arith,
        "fit_steps": a.fit_steps,
        "requests": len(suffixes),
        "tokens_each": a.tokens,
        "holders": a.holders,
        "holder_device": a.holder_device,
        "cuda_graph_bs": [] if a.no_cuda_graph else list(a.graph_bs or a.streams),
        "streams": list(a.streams),
        "sglang_flags": SGLANG_FLAGS,
        "sglang_env": SGLANG_ENV,
        "failed": failed,
        "regimes": {},
    }
    for r, by_mode in runs.items():
        if "stock" not in by_mode:
            continue
        out["regimes"][r] = {
            "corpus_tokens": len(cd.tokens[r]),
            "prompt_tokens_max": len(cd.tokens[r]) + max(map(len, suffixes)) + a.tokens,
            "tokens": {m: [g["tokens"] for g in v["greedy"]] for m, v in by_mode.items()},
            "cached_tokens": {
                m: [g["cached_tokens"] for g in v["greedy"]] for m, v in by_mode.items()
            },
            "concurrent": {m: v["concurrent"] for m, v in by_mode.items() if "concurrent" in v},
            "concurrent_by_streams": {
                m: v["concurrent_by_streams"] for m, v in by_mode.items() if "concurrent" in v
            },
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
        if "route" in by_mode and "fetch" in by_mode:
            out["regimes"][r]["route_vs_fetch"] = compare(by_mode["fetch"], by_mode["route"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results/sglang-h200.json")
    ap.add_argument("--work", default="/tmp/corpusd-bench-sglang")
    ap.add_argument("--modes", default="stock,route,fetch")
    ap.add_argument(
        "--probe-only", action="store_true",
        help="start only a route server and send it requests it cannot bind (issue 17, item 4)",
    )  # fmt: skip
    ap.add_argument("--regimes", default="dense,sparse")
    ap.add_argument("--tokens", type=int, default=32, help="generated per request")
    ap.add_argument("--forced-steps", type=int, default=16, help="teacher-forced per request")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--holders", type=int, default=2)
    ap.add_argument("--holder-device", default="cpu")
    ap.add_argument(
        "--streams",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=(8,),
        help="concurrent stream counts to time, comma-separated (the first is 'concurrent')",
    )
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
        "--fit-steps",
        type=int,
        default=0,
        help="fit the tiny model to this repo's text first (tools/fit_tiny.py); 0: random weights",
    )
    ap.add_argument("--fit-device", default="", help="where to fit (default: --holder-device)")
    ap.add_argument(
        "--index-arith",
        choices=ARITHS,
        default="fp8",
        help="the pinned model's indexer arithmetic (fp8: as SGLang computes it)",
    )
    a = ap.parse_args(argv)
    out = run(a)
    if a.probe_only:
        return 0
    save(a.out, out)
    print(f"{'regime':<7} {'vs':<11} {'greedy':>6} {'forced':>6} {'lp max':>7} {'lp mean':>8}")
    for r, v in out["regimes"].items():
        pairs = {f"{m}/stock": c for m, c in v["vs_stock"].items()}
        if "route_vs_fetch" in v:
            pairs["route/fetch"] = v["route_vs_fetch"]
        for name, c in pairs.items():
            print(
                f"{r:<7} {name:<11} {c['greedy_agree']:>6.3f} {c['forced_agree']:>6.3f} "
                f"{c['logprob_max_abs_diff']:>7.4f} {c['logprob_mean_abs_diff']:>8.5f}"
            )
        for m, c in v["batched_vs_sequential"].items():
            print(f"{r:<7} {m + ' b8/b1':<11} {c['greedy_agree']:>6.3f}")
    for r, v in out["regimes"].items():
        ans = v["stock_answers"]
        print(f"{r}: stock answers {ans['distinct']} distinct, {ans['corpus_dependent']} change "
              f"without the corpus: {ans['text'][:2]}")  # fmt: skip
    print(f"{'regime':<7} {'mode':<6} {'streams':>7} {'ttft ms':>8} {'itl p50 ms':>10} {'kv':>6}")
    for r, v in out["regimes"].items():
        for m, by in v.get("concurrent_by_streams", {}).items():
            for n, c in by.items():
                print(
                    f"{r:<7} {m:<6} {n:>7} {c['ttft_p50_ms']:>8.1f} "
                    f"{c['inter_token_p50_ms']:>10.1f} {c['kv_pool_peak_tokens']:>6.0f}"
                )
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
